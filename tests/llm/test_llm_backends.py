"""Each backend against its fake: request shape, replies, streams and error mapping."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from llm_fakes import (
    Script,
    _sse,
    anthropic_error,
    anthropic_ok,
    anthropic_stream,
    backend_for,
    ollama_error,
    ollama_ok,
    ollama_stream,
    openai_error,
    openai_ok,
    openai_stream,
    start_fake,
)

from agentserver.llm import ErrorKind, LLMError, Message, Request
from agentserver.llm.backends import BackendStream, make_backend
from agentserver.llm.types import Reply

REQ = Request(
    [Message.system("sys"), Message.user("hi"), Message.assistant("yo"), Message.user("more")],
    model="m",
    max_tokens=7,
    temperature=0.5,
    stop=["END"],
)


async def drain(stream: BackendStream) -> tuple[list[str], Reply]:
    chunks: list[str] = []
    try:
        while True:
            item = await stream.next()
            if isinstance(item, Reply):
                return chunks, item
            chunks.append(item)
    finally:
        await stream.aclose()


@pytest.fixture
async def client():
    async with httpx.AsyncClient() as c:
        yield c


async def test_openai_request_and_reply(nursery, client):
    fake = await start_fake(
        nursery, "openai", openai_ok("out", model="gpt-x", finish_reason="length")
    )
    backend = make_backend(backend_for(fake, "o"), client, "sk-1")
    reply = await backend.complete(REQ, "gpt-real", 5)
    assert reply == Reply("out", "gpt-x", reply.usage, "length")
    assert reply.usage.prompt_tokens == 10 and reply.usage.completion_tokens == 5
    seen = fake.requests[0]
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["authorization"] == "Bearer sk-1"
    assert seen.body == {
        "model": "gpt-real",
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "more"},
        ],
        "max_tokens": 7,
        "temperature": 0.5,
        "stop": ["END"],
    }


async def test_anthropic_request_and_reply(nursery, client):
    fake = await start_fake(nursery, "anthropic", anthropic_ok("out", stop_reason="max_tokens"))
    backend = make_backend(backend_for(fake, "a"), client, "ak-1")
    reply = await backend.complete(REQ, "claude-real", 5)
    assert (reply.content, reply.finish_reason) == ("out", "length")
    seen = fake.requests[0]
    assert seen.path == "/v1/messages"
    assert seen.headers["x-api-key"] == "ak-1" and seen.headers["anthropic-version"]
    assert seen.body["system"] == "sys"
    assert [m["role"] for m in seen.body["messages"]] == ["user", "assistant", "user"]
    assert seen.body["stop_sequences"] == ["END"] and seen.body["max_tokens"] == 7


async def test_ollama_request_and_reply(nursery, client):
    fake = await start_fake(nursery, "ollama", ollama_ok("out", eval_count=3))
    backend = make_backend(backend_for(fake, "l"), client, None)
    reply = await backend.complete(REQ, "llama3", 5)
    assert (reply.content, reply.usage.completion_tokens, reply.finish_reason) == ("out", 3, "stop")
    seen = fake.requests[0]
    assert seen.path == "/api/chat" and "authorization" not in seen.headers
    assert seen.body["stream"] is False
    assert seen.body["options"] == {"num_predict": 7, "temperature": 0.5, "stop": ["END"]}


@pytest.mark.parametrize(
    ("provider", "script"),
    [
        ("openai", openai_stream(["a", "b", "c"], completion_tokens=3)),
        ("anthropic", anthropic_stream(["a", "b", "c"])),
        ("ollama", ollama_stream(["a", "b", "c"])),
    ],
)
async def test_streams(nursery, client, provider, script):
    fake = await start_fake(nursery, provider, script)
    backend = make_backend(backend_for(fake, "x"), client, "k")
    chunks, reply = await drain(await backend.open_stream(REQ, "m", 5))
    assert chunks == ["a", "b", "c"]
    assert reply.content == "abc" and reply.finish_reason == "stop"
    assert reply.usage.completion_tokens == 3 and reply.usage.prompt_tokens == 10
    assert fake.requests[0].body["stream"] is True


@pytest.mark.parametrize(
    ("provider", "script"),
    [("openai", openai_ok("whole reply")), ("ollama", ollama_ok("whole reply"))],
)
async def test_server_ignoring_stream_flag_is_read_as_one_chunk(nursery, client, provider, script):
    # Some OpenAI-compatible servers answer "stream": true with a plain JSON body.
    fake = await start_fake(nursery, provider, script)
    backend = make_backend(backend_for(fake, "x"), client, "k")
    chunks, reply = await drain(await backend.open_stream(REQ, "m", 5))
    assert chunks == ["whole reply"]
    assert reply.content == "whole reply"


async def test_openai_stream_without_usage_is_estimated(nursery, client):
    fake = await start_fake(nursery, "openai", openai_stream(["abcdef"], include_usage=False))
    backend = make_backend(backend_for(fake, "x"), client, "k")
    _, reply = await drain(await backend.open_stream(REQ, "m", 5))
    assert reply.usage.completion_tokens == 2  # 6 bytes / 3
    assert reply.usage.prompt_tokens > 0


async def test_whole_reply_without_usage_is_estimated_like_a_stream(nursery, client):
    script = openai_ok("abcdef")
    body = json.loads(script.body)
    del body["usage"]
    script.body = json.dumps(body).encode()
    fake = await start_fake(nursery, "openai", script)
    backend = make_backend(backend_for(fake, "x"), client, "k")
    reply = await backend.complete(REQ, "m", 5)
    assert reply.content == "abcdef"
    assert reply.usage.completion_tokens == 2  # 6 bytes / 3, as for a stream
    assert reply.usage.prompt_tokens > 0


@pytest.mark.parametrize(
    ("provider", "script", "kind", "status", "retry_after", "text"),
    [
        (
            "openai",
            openai_error(
                429,
                "Rate limit reached",
                type="requests",
                code="rate_limit_exceeded",
                headers=[("retry-after", "2"), ("retry-after-ms", "1500")],
            ),
            ErrorKind.RATE_LIMIT,
            429,
            1.5,
            "Rate limit reached",
        ),
        (
            "openai",
            openai_error(
                429,
                "You exceeded your current quota",
                type="insufficient_quota",
                code="insufficient_quota",
            ),
            ErrorKind.BILLING,
            429,
            None,
            "quota",
        ),
        (
            "anthropic",
            anthropic_error(529, "Overloaded", type="overloaded_error"),
            ErrorKind.OVERLOADED,
            529,
            None,
            "Overloaded",
        ),
        (
            "anthropic",
            anthropic_error(400, "prompt is too long: 300000 tokens > 200000 maximum"),
            ErrorKind.CONTEXT_OVERFLOW,
            400,
            None,
            "too long",
        ),
        (
            "ollama",
            ollama_error(404, "model 'x' not found, try pulling it first"),
            ErrorKind.MODEL_NOT_FOUND,
            404,
            None,
            "not found",
        ),
        (
            "openai",
            Script(502, body=b"<html>bad gateway</html>", content_type="text/html"),
            ErrorKind.SERVER_ERROR,
            502,
            None,
            "bad gateway",
        ),
        ("openai", Script(200, body=b"{not json"), ErrorKind.UNKNOWN, 200, None, "malformed"),
    ],
    ids=["rate-limit", "quota", "overloaded", "context", "ollama-404", "html-502", "malformed"],
)
async def test_error_mapping(nursery, client, provider, script, kind, status, retry_after, text):
    fake = await start_fake(nursery, provider, script)
    backend = make_backend(backend_for(fake, "x"), client, "k")
    with pytest.raises(LLMError) as info:
        await backend.complete(REQ, "m", 5)
    err = info.value
    assert (err.kind, err.status, err.backend, err.retry_after) == (kind, status, "x", retry_after)
    assert text in err.provider_message


@pytest.mark.parametrize(
    ("provider", "script", "kind"),
    [
        (
            "anthropic",
            anthropic_stream(["a"], error=("overloaded_error", "Overloaded")),
            ErrorKind.OVERLOADED,
        ),
        (
            "ollama",
            ollama_stream(["a"], error="an error was encountered while running the model"),
            ErrorKind.UNKNOWN,
        ),
        ("openai", openai_stream(["a", "b"], break_after=2), ErrorKind.TIMEOUT),
        ("anthropic", anthropic_stream(["a", "b"], break_after=4), ErrorKind.TIMEOUT),
        ("ollama", ollama_stream(["a", "b"], break_after=1), ErrorKind.TIMEOUT),
    ],
    ids=[
        "anthropic-error-event",
        "ollama-error-line",
        "openai-break",
        "anthropic-break",
        "ollama-break",
    ],
)
async def test_stream_failures_after_first_chunk(nursery, client, provider, script, kind):
    fake = await start_fake(nursery, provider, script)
    backend = make_backend(backend_for(fake, "x"), client, "k")
    stream = await backend.open_stream(REQ, "m", 5)
    assert await stream.next() == "a"
    with pytest.raises(LLMError) as info:
        await drain(stream)
    assert info.value.kind is kind and info.value.status is None


def _with_bad_event(script: Script, bad: bytes) -> Script:
    """``script`` with ``bad`` inserted right after its first text chunk."""
    first = next(i for i, c in enumerate(script.chunks) if b'"a"' in c)
    script.chunks.insert(first + 1, bad)
    return script


@pytest.mark.parametrize(
    ("provider", "script"),
    [
        ("openai", _with_bad_event(openai_stream(["a", "b"]), _sse({"choices": ["x"]}))),
        (
            "anthropic",
            _with_bad_event(anthropic_stream(["a", "b"]), _sse([1], "content_block_delta")),
        ),
        ("ollama", _with_bad_event(ollama_stream(["a", "b"]), b'{"message": "x"}\n')),
    ],
    ids=["openai", "anthropic", "ollama"],
)
async def test_stream_event_of_the_wrong_shape_is_malformed(nursery, client, provider, script):
    # Valid JSON, wrong shape: an LLMError like a malformed body, never a raw TypeError.
    fake = await start_fake(nursery, provider, script)
    backend = make_backend(backend_for(fake, "x"), client, "k")
    stream = await backend.open_stream(REQ, "m", 5)
    assert await stream.next() == "a"
    with pytest.raises(LLMError) as info:
        await drain(stream)
    assert info.value.kind is ErrorKind.UNKNOWN and "malformed" in info.value.provider_message


async def test_stream_error_status_is_classified(nursery, client):
    fake = await start_fake(
        nursery, "anthropic", anthropic_error(401, "invalid x-api-key", type="authentication_error")
    )
    backend = make_backend(backend_for(fake, "x"), client, "k")
    with pytest.raises(LLMError) as info:
        await backend.open_stream(REQ, "m", 5)
    assert (info.value.kind, info.value.status) == (ErrorKind.AUTH, 401)


async def test_connection_refused_is_unreachable(client):
    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from agentserver.llm import BackendConfig, Provider

    cfg = BackendConfig("x", Provider.OPENAI, f"http://127.0.0.1:{port}/v1", ("m",))
    with pytest.raises(LLMError) as info:
        await make_backend(cfg, client, None).complete(REQ, "m", 5)
    assert info.value.kind is ErrorKind.UNREACHABLE
    assert "ConnectError" in info.value.provider_message


async def test_connect_failures_are_unreachable_and_other_transport_failures_timeout(client):
    # What httpx raises for a DNS failure and an unreachable network (no lookup here:
    # tests never touch the network), for a connect timeout and a connection reset.
    from agentserver.llm import BackendConfig, Provider

    backend = make_backend(
        BackendConfig("x", Provider.OPENAI, "http://127.0.0.1:9/v1", ("m",)), client, None
    )
    kinds = [
        backend.transport_error(exc).kind
        for exc in (
            httpx.ConnectError("[Errno -2] Name or service not known"),
            httpx.ConnectError("[Errno 101] Network is unreachable"),
            httpx.ConnectTimeout("timed out"),
            httpx.ReadError("[Errno 104] Connection reset by peer"),
        )
    ]
    assert kinds == [ErrorKind.UNREACHABLE, ErrorKind.UNREACHABLE] + [ErrorKind.TIMEOUT] * 2


def test_sse_decoder():
    from agentserver.llm.backends.base import SSEDecoder

    d = SSEDecoder()
    lines = [": keep-alive", "event: delta", 'data: {"a":', "data: 1}", "", "", "data:x", ""]
    events = [e for e in map(d.feed, lines) if e is not None]
    assert events == [("delta", '{"a":\n1}'), ("message", "x")]
