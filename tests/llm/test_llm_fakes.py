"""The fakes are checked by the official clients, so they cannot drift from the real APIs."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
import trio
from llm_fakes import (
    anthropic_error,
    anthropic_stream,
    ollama_error,
    ollama_stream,
    openai_error,
    openai_stream,
    start_fake,
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
