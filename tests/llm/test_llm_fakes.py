"""The fakes are read by the official clients, and every reply and event they build is held
strictly to the providers' response models (``provider_schemas``), so they cannot drift from
the real APIs."""

from __future__ import annotations

import copy
import json

import anthropic
import httpx
import openai
import pytest
import trio
from llm_fakes import (
    anthropic_error,
    anthropic_ok,
    anthropic_stream,
    ollama_error,
    ollama_ok,
    ollama_stream,
    openai_error,
    openai_ok,
    openai_stream,
    start_fake,
)
from provider_schemas import (
    FakeDrift,
    check_anthropic_error,
    check_anthropic_event,
    check_anthropic_message,
    check_ollama_chat,
    check_ollama_error,
    check_openai_chunk,
    check_openai_completion,
    check_openai_error,
)


async def test_openai_client_reads_fake_completion(nursery):
    fake = await start_fake(nursery, "openai")

    def call():
        client = openai.OpenAI(base_url=fake.base_url, api_key="sk-test", max_retries=0)
        try:
            return client.chat.completions.create(
                model="gpt-test",
                messages=[{"role": "user", "content": "ping"}],
                max_tokens=10,
            )
        finally:
            client.close()

    out = await trio.to_thread.run_sync(call)
    assert out.choices[0].message.content == "echo: ping"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.total_tokens == 15
    seen = fake.requests[0]
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["authorization"] == "Bearer sk-test"
    assert seen.body["messages"] == [{"role": "user", "content": "ping"}]


async def test_openai_client_reads_fake_stream(nursery):
    fake = await start_fake(nursery, "openai", openai_stream(["a", "b", "c"]))

    def call():
        client = openai.OpenAI(base_url=fake.base_url, api_key="k", max_retries=0)
        try:
            chunks = client.chat.completions.create(
                model="gpt-test",
                messages=[{"role": "user", "content": "x"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            return list(chunks)
        finally:
            client.close()

    chunks = await trio.to_thread.run_sync(call)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "abc"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("status", "exc_type"),
    [
        (429, openai.RateLimitError),
        (400, openai.BadRequestError),
        (401, openai.AuthenticationError),
        (404, openai.NotFoundError),
        (503, openai.InternalServerError),
    ],
)
async def test_openai_client_reads_fake_errors(nursery, status, exc_type):
    fake = await start_fake(
        nursery,
        "openai",
        openai_error(
            status, "You exceeded your current quota", type="insufficient_quota", code="q"
        ),
    )

    def call():
        client = openai.OpenAI(base_url=fake.base_url, api_key="k", max_retries=0)
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        finally:
            client.close()

    with pytest.raises(exc_type) as info:
        await trio.to_thread.run_sync(call)
    assert info.value.status_code == status
    assert info.value.code == "q"
    assert info.value.type == "insufficient_quota"
    assert "exceeded your current quota" in info.value.message


async def test_anthropic_client_reads_fake_message(nursery):
    fake = await start_fake(nursery, "anthropic")

    def call():
        client = anthropic.Anthropic(base_url=fake.base_url, api_key="ak", max_retries=0)
        try:
            return client.messages.create(
                model="claude-test",
                max_tokens=10,
                system="be brief",
                messages=[{"role": "user", "content": "ping"}],
            )
        finally:
            client.close()

    out = await trio.to_thread.run_sync(call)
    assert out.content[0].text == "echo: ping"
    assert out.stop_reason == "end_turn"
    assert out.usage.input_tokens == 10 and out.usage.output_tokens == 5
    seen = fake.requests[0]
    assert seen.path == "/v1/messages"
    # Clients of this era send the key as a Bearer token; older ones as x-api-key.
    assert seen.headers.get("x-api-key") == "ak" or seen.headers["authorization"] == "Bearer ak"
    assert "anthropic-version" in seen.headers


async def test_anthropic_client_reads_fake_stream(nursery):
    fake = await start_fake(nursery, "anthropic", anthropic_stream(["Hel", "lo"]))

    def call():
        client = anthropic.Anthropic(base_url=fake.base_url, api_key="ak", max_retries=0)
        try:
            with client.messages.stream(
                model="claude-test", max_tokens=10, messages=[{"role": "user", "content": "x"}]
            ) as s:
                text = "".join(s.text_stream)
                final = s.get_final_message()
            return text, final
        finally:
            client.close()

    text, final = await trio.to_thread.run_sync(call)
    assert text == "Hello"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 2


async def test_anthropic_client_sees_stream_error_event(nursery):
    fake = await start_fake(
        nursery, "anthropic", anthropic_stream(["a"], error=("overloaded_error", "Overloaded"))
    )

    def call():
        client = anthropic.Anthropic(base_url=fake.base_url, api_key="ak", max_retries=0)
        try:
            with client.messages.stream(
                model="claude-test", max_tokens=10, messages=[{"role": "user", "content": "x"}]
            ) as s:
                "".join(s.text_stream)
        finally:
            client.close()

    with pytest.raises(anthropic.APIStatusError) as info:
        await trio.to_thread.run_sync(call)
    assert "Overloaded" in str(info.value)


@pytest.mark.parametrize(
    ("status", "exc_type"),
    [
        (429, anthropic.RateLimitError),
        (400, anthropic.BadRequestError),
        (401, anthropic.AuthenticationError),
        (529, anthropic.APIStatusError),
    ],
)
async def test_anthropic_client_reads_fake_errors(nursery, status, exc_type):
    fake = await start_fake(
        nursery,
        "anthropic",
        anthropic_error(status, "Your credit balance is too low", type="rate_limit_error"),
    )

    def call():
        client = anthropic.Anthropic(base_url=fake.base_url, api_key="ak", max_retries=0)
        try:
            client.messages.create(
                model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]
            )
        finally:
            client.close()

    with pytest.raises(exc_type) as info:
        await trio.to_thread.run_sync(call)
    assert info.value.status_code == status
    assert info.value.body["error"]["type"] == "rate_limit_error"
    assert "credit balance" in info.value.message


async def test_ollama_fake_matches_documented_shapes(nursery):
    # No official Ollama client is a dependency; check the documented fields directly.
    fake = await start_fake(
        nursery, "ollama", ollama_stream(["a", "b"]), ollama_error(404, "model 'x' not found")
    )
    async with httpx.AsyncClient(base_url=fake.base_url) as client:
        r = await client.post("/api/chat", json={"model": "m", "messages": [], "stream": True})
        lines = [line for line in r.text.splitlines() if line]
        assert r.headers["content-type"] == "application/x-ndjson"
        objs = [json.loads(line) for line in lines]
        assert [o["done"] for o in objs] == [False, False, True]
        assert objs[-1]["eval_count"] == 2 and "prompt_eval_count" in objs[-1]
        r = await client.post("/api/chat", json={"model": "x", "messages": []})
        assert r.status_code == 404 and r.json() == {"error": "model 'x' not found"}
        r = await client.post("/api/chat", json={"model": "m", "messages": [], "stream": False})
        assert r.json()["done"] is True and r.json()["message"]["role"] == "assistant"


async def test_fake_breaks_stream_after_n_chunks(nursery):
    fake = await start_fake(nursery, "openai", openai_stream(["a", "b", "c"], break_after=2))
    async with httpx.AsyncClient() as client:
        got = []
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", fake.base_url + "/chat/completions", json={}) as r:
                async for line in r.aiter_lines():
                    got.append(line)
        assert sum(1 for line in got if line.startswith("data:")) == 2


# -- every reply and event is held to the providers' response models ---------------------


def _sse_events(script) -> list[tuple[str | None, object]]:
    out = []
    for chunk in script.chunks:
        event, data = None, None
        for line in chunk.decode().splitlines():
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
        out.append((event, data if data == "[DONE]" else json.loads(data)))
    return out


def _without(data, path: str):
    """A deep copy of ``data`` with the key at dotted ``path`` removed (``choices.0.index``)."""
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    del node[last]
    return data


def _with(data, path: str, value):
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return data


def test_every_builder_variant_passes_the_strict_checks():
    # The builders check what they build; these variants must all be accepted.
    openai_ok("x", finish_reason="length")
    openai_stream(["a"], include_usage=False)
    openai_stream([], completion_tokens=0)
    openai_error(429, "slow down", type="requests", code="rate_limit_exceeded")
    anthropic_ok("x", stop_reason="max_tokens")
    anthropic_stream(["a", "b"], stop_reason="stop_sequence")
    anthropic_stream(["a"], error=("overloaded_error", "Overloaded"))
    anthropic_error(529, "Overloaded", type="overloaded_error")
    ollama_ok("x", done_reason="length")
    ollama_stream(["a", "b"])
    ollama_stream(["a"], error="boom")
    ollama_error(404, "model 'x' not found")


OPENAI_REQUIRED = [
    "id",
    "object",
    "created",
    "model",
    "choices",
    "choices.0.index",
    "choices.0.message",
    "choices.0.message.role",
    "choices.0.message.content",
    "choices.0.message.refusal",
    "choices.0.logprobs",
    "choices.0.finish_reason",
    "usage.prompt_tokens",
    "usage.completion_tokens",
    "usage.total_tokens",
]


@pytest.mark.parametrize("path", OPENAI_REQUIRED)
def test_openai_completion_without_a_required_field_is_drift(path):
    body = json.loads(openai_ok("hi").body)
    check_openai_completion(body)
    with pytest.raises(FakeDrift):
        check_openai_completion(_without(body, path))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("created", "1700000000"),  # a string where the API sends an integer
        ("object", "chat.completions"),
        ("choices.0.message.role", "user"),
        ("choices.0.finish_reason", "done"),
        ("choices.0.finish_reasn", "stop"),  # a field the API does not have
    ],
)
def test_openai_completion_with_a_wrong_field_is_drift(path, value):
    body = json.loads(openai_ok("hi").body)
    with pytest.raises(FakeDrift):
        check_openai_completion(_with(body, path, value))


@pytest.mark.parametrize(
    "path",
    [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "choices.0.index",
        "choices.0.delta",
        "choices.0.finish_reason",
    ],
)
def test_openai_chunk_without_a_required_field_is_drift(path):
    events = [data for _, data in _sse_events(openai_stream(["a"])) if data != "[DONE]"]
    for event in events:
        check_openai_chunk(event)
    with pytest.raises(FakeDrift):
        check_openai_chunk(_without(events[1], path))


def test_openai_stream_usage_chunk_is_checked():
    *_, usage, done = _sse_events(openai_stream(["a"]))
    assert done == (None, "[DONE]") and usage[1]["choices"] == []
    with pytest.raises(FakeDrift):
        check_openai_chunk(_without(usage[1], "usage.total_tokens"))


@pytest.mark.parametrize("path", ["error.message", "error.type", "error"])
def test_openai_error_without_a_required_field_is_drift(path):
    body = json.loads(openai_error(400, "bad").body)
    with pytest.raises(FakeDrift):
        check_openai_error(_without(body, path))


@pytest.mark.parametrize(
    "path",
    [
        "id",
        "type",
        "role",
        "model",
        "content",
        "content.0.type",
        "content.0.text",
        "stop_reason",
        "stop_sequence",
        "usage",
        "usage.input_tokens",
        "usage.output_tokens",
    ],
)
def test_anthropic_message_without_a_required_field_is_drift(path):
    body = json.loads(anthropic_ok("hi").body)
    check_anthropic_message(body)
    with pytest.raises(FakeDrift):
        check_anthropic_message(_without(body, path))


ANTHROPIC_EVENT_REQUIRED = {
    "message_start": ["message", "message.id", "message.stop_reason", "message.usage"],
    "content_block_start": ["index", "content_block", "content_block.text"],
    "content_block_delta": ["index", "delta", "delta.type", "delta.text"],
    "content_block_stop": ["index"],
    "message_delta": [
        "delta",
        "delta.stop_reason",
        "delta.stop_sequence",
        "usage",
        "usage.output_tokens",
    ],
}


@pytest.mark.parametrize(
    ("event", "path"), [(e, p) for e, paths in ANTHROPIC_EVENT_REQUIRED.items() for p in paths]
)
def test_anthropic_event_without_a_required_field_is_drift(event, path):
    events = dict(_sse_events(anthropic_stream(["a"])))
    assert set(events) == {*ANTHROPIC_EVENT_REQUIRED, "ping", "message_stop"}
    check_anthropic_event(event, events[event])
    with pytest.raises(FakeDrift):
        check_anthropic_event(event, _without(events[event], path))


def test_anthropic_event_name_must_match_its_type():
    events = dict(_sse_events(anthropic_stream(["a"])))
    with pytest.raises(FakeDrift):
        check_anthropic_event("content_block_stop", events["message_stop"])
    with pytest.raises(FakeDrift):
        check_anthropic_event("ping", {"type": "ping", "extra": 1})
    error = dict(_sse_events(anthropic_stream(["a"], error=("overloaded_error", "x"))))["error"]
    with pytest.raises(FakeDrift):
        check_anthropic_event("error", _without(error, "error.message"))


@pytest.mark.parametrize("path", ["type", "error", "error.type", "error.message"])
def test_anthropic_error_without_a_required_field_is_drift(path):
    body = json.loads(anthropic_error(400, "bad").body)
    with pytest.raises(FakeDrift):
        check_anthropic_error(_without(body, path))


@pytest.mark.parametrize(
    "path",
    [
        "model",
        "created_at",
        "message",
        "message.role",
        "message.content",
        "done",
        "done_reason",
        "prompt_eval_count",
        "eval_count",
    ],
)
def test_ollama_reply_without_a_documented_field_is_drift(path):
    body = json.loads(ollama_ok("hi").body)
    check_ollama_chat(body)
    with pytest.raises(FakeDrift):
        check_ollama_chat(_without(body, path))


def test_ollama_stream_lines_are_checked():
    lines = [json.loads(c) for c in ollama_stream(["a"]).chunks]
    for line in lines:
        check_ollama_chat(line)
    with pytest.raises(FakeDrift):
        check_ollama_chat(_with(lines[0], "done", "false"))
    with pytest.raises(FakeDrift):
        check_ollama_chat(_without(lines[-1], "eval_count"))
    with pytest.raises(FakeDrift):
        check_ollama_error({"error": "x", "code": 1})
