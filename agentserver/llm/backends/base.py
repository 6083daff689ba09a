"""The backend interface and what the three wire formats share.

A backend makes exactly one HTTP call per :meth:`Backend.complete` or
:meth:`Backend.open_stream`; it never retries, sleeps or limits. Failures come
out as :class:`LLMError` already classified. Parsing is sans-IO: the stream
parsers are fed lines and return text chunks and a final :class:`Reply`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import httpx

from ..classify import classify, parse_retry_after
from ..config import BackendConfig
from ..tokens import estimate_prompt_tokens, estimate_text_tokens
from ..types import LLMError, Reply, Request, Usage

#: What parsing a provider's JSON of an unexpected shape raises (``data["x"][0].get``...).
_SHAPE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError)


def reported_or_estimated(usage: Usage | None, request: Request, content: str) -> Usage:
    """The provider's usage, or an estimate when it reported none (or only zeros: no real
    call uses no tokens), so the tokens bucket is charged either way."""
    if usage is not None and usage.total_tokens > 0:
        return usage
    return Usage(
        estimate_prompt_tokens(request.messages), estimate_text_tokens(content), estimated=True
    )


__all__ = [
    "Backend",
    "BackendStream",
    "ReplyStream",
    "SSEDecoder",
    "StreamParser",
    "WholeReplyStream",
]


class SSEDecoder:
    """Server-sent events, line by line (the subset LLM APIs use)."""

    __slots__ = ("_data", "_event")

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> tuple[str, str] | None:
        """Feed one line without its terminator; returns ``(event, data)`` when
        a blank line completes an event that carried data."""
        if not line:
            if not self._data:
                self._event = ""
                return None
            out = (self._event or "message", "\n".join(self._data))
            self._event = ""
            self._data = []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None


class StreamParser(ABC):
    """Turns a provider's stream, line by line, into text chunks and one final Reply."""

    def __init__(self, backend: Backend, request: Request, model: str) -> None:
        self.backend = backend
        self.request = request
        self.model = model
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    @abstractmethod
    def feed(self, line: str) -> list[str | Reply]:
        """Parse one line. Raises :class:`LLMError` for an error the provider
        reports inside the stream."""

    def finish(self) -> Reply:
        """The body ended. A stream that never said it was complete is a broken
        stream (classified like a dropped connection)."""
        if self.finish_reason is None:
            raise self.backend.transport_error("stream ended before the provider finished it")
        return self.reply()

    def text(self, chunk: str) -> list[str | Reply]:
        if not chunk:
            return []
        self.parts.append(chunk)
        return [chunk]

    def reply(self) -> Reply:
        content = "".join(self.parts)
        usage = reported_or_estimated(self.usage, self.request, content)
        return Reply(content, self.model, usage, self.finish_reason)

    def load(self, data: str) -> Any:
        try:
            return json.loads(data)
        except ValueError:
            raise self.backend.malformed(f"malformed stream event: {data[:200]!r}") from None


class ReplyStream(Protocol):
    """What the router reads of an open stream, whichever backend opened it
    (:class:`BackendStream`, :class:`WholeReplyStream`, the local backend's LocalStream):
    text chunks, then the final :class:`Reply` once; :meth:`aclose` must be called."""

    async def next(self) -> str | Reply: ...

    async def aclose(self) -> None: ...


class BackendStream:
    """An open streaming response. :meth:`next` returns the next non-empty text
    chunk, or the final :class:`Reply` once; then the stream is exhausted.
    :meth:`aclose` is idempotent and must be called (the router does)."""

    def __init__(self, backend: Backend, response: httpx.Response, parser: StreamParser) -> None:
        self._backend = backend
        self._response = response
        self._parser = parser
        self._lines: AsyncIterator[str] = response.aiter_lines()
        self._pending: deque[str | Reply] = deque()
        self._ended = False

    async def next(self) -> str | Reply:
        while not self._pending:
            if self._ended:
                raise RuntimeError("stream already finished")
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                self._pending.append(self._parser.finish())
                break
            except httpx.TransportError as exc:
                raise self._backend.transport_error(exc) from exc
            try:
                self._pending.extend(self._parser.feed(line))
            except LLMError:
                raise
            except _SHAPE_ERRORS as exc:  # an event of the wrong shape, like a bad body
                raise self._backend.malformed(f"malformed stream event: {exc!r}") from None
        item = self._pending.popleft()
        if isinstance(item, Reply):
            self._ended = True
            self._pending.clear()
        return item

    async def aclose(self) -> None:
        await self._response.aclose()


class WholeReplyStream:
    """A complete reply presented as a stream: its text as one chunk, then the reply."""

    def __init__(self, reply: Reply) -> None:
        self._items: deque[str | Reply] = deque(
            [reply.content, reply] if reply.content else [reply]
        )

    async def next(self) -> str | Reply:
        if not self._items:
            raise RuntimeError("stream already finished")
        return self._items.popleft()

    async def aclose(self) -> None:
        return None


class Backend(ABC):
    """One configured backend speaking one provider's wire format."""

    def __init__(self, config: BackendConfig, client: httpx.AsyncClient, api_key: str | None):
        self.config = config
        self.name = config.name
        self._client = client
        self.url = self.endpoint(config.base_url)
        self.headers = self.auth_headers(api_key)

    # -- provider specifics ------------------------------------------------

    @abstractmethod
    def endpoint(self, base_url: str) -> str: ...

    @abstractmethod
    def auth_headers(self, api_key: str | None) -> dict[str, str]: ...

    @abstractmethod
    def body(self, request: Request, model: str, stream: bool) -> dict[str, Any]: ...

    @abstractmethod
    def parse_reply(self, data: Any, request: Request, model: str) -> Reply: ...

    @abstractmethod
    def error_fields(self, data: Any) -> tuple[str, str]:
        """``(message, type-and-code)`` from a provider's error body."""

    @abstractmethod
    def stream_parser(self, request: Request, model: str) -> StreamParser: ...

    # -- errors --------------------------------------------------------------

    def error_from_response(
        self, status: int, headers: Mapping[str, str], content: bytes
    ) -> LLMError:
        message = code = ""
        try:
            message, code = self.error_fields(json.loads(content))
        except (ValueError, TypeError, KeyError, AttributeError):
            message = content[:500].decode("utf-8", "replace").strip()
        if not message:
            message = f"HTTP {status} {httpx.codes.get_reason_phrase(status)}".strip()
        retry_after = parse_retry_after(
            headers.get("retry-after"), headers.get("retry-after-ms"), now_wall=time.time()
        )
        kind = classify(status, message, code=code).kind
        return LLMError(kind, message, backend=self.name, status=status, retry_after=retry_after)

    def stream_error(self, message: str, code: str) -> LLMError:
        """An error event inside a stream (no HTTP status to go by)."""
        kind = classify(None, message, code=code).kind
        return LLMError(kind, message or code or "error event in stream", backend=self.name)

    def transport_error(self, exc: BaseException | str) -> LLMError:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}".rstrip(": ")
        # ConnectError: refused, DNS failure, network unreachable (a connect *timeout* is
        # a ConnectTimeout, still TIMEOUT: a slow network is not a down backend).
        connect = isinstance(exc, httpx.ConnectError)
        kind = classify(None, text, transport=True, connect=connect).kind
        return LLMError(kind, text, backend=self.name)

    def malformed(self, message: str) -> LLMError:
        # A 200 we cannot read: nothing in the taxonomy is more specific.
        kind = classify(200, message).kind
        return LLMError(kind, message, backend=self.name, status=200)

    # -- calls -------------------------------------------------------------------

    async def complete(self, request: Request, model: str, phase_timeout: float) -> Reply:
        """One non-streaming call. ``phase_timeout`` bounds each network phase
        (connect, write, each read), not the call as a whole."""
        body = self.body(request, model, False)
        try:
            resp = await self._client.post(
                self.url, json=body, headers=self.headers, timeout=phase_timeout
            )
        except httpx.TransportError as exc:
            raise self.transport_error(exc) from exc
        if resp.status_code != 200:
            raise self.error_from_response(resp.status_code, resp.headers, resp.content)
        return self._whole_reply(resp.content, request, model)

    def _whole_reply(self, content: bytes, request: Request, model: str) -> Reply:
        """Parse a complete JSON reply body; a body of the wrong shape is malformed."""
        try:
            reply = self.parse_reply(json.loads(content), request, model)
        except _SHAPE_ERRORS as exc:
            raise self.malformed(f"malformed response body: {exc!r}") from None
        usage = reported_or_estimated(reply.usage, request, reply.content)
        return reply if usage is reply.usage else dataclasses.replace(reply, usage=usage)

    async def open_stream(
        self, request: Request, model: str, phase_timeout: float
    ) -> BackendStream | WholeReplyStream:
        """Send a streaming call and return once the response headers are in.
        ``phase_timeout`` also bounds the silence between two chunks."""
        body = self.body(request, model, True)
        req = self._client.build_request(
            "POST", self.url, json=body, headers=self.headers, timeout=phase_timeout
        )
        try:
            resp = await self._client.send(req, stream=True)
        except httpx.TransportError as exc:
            raise self.transport_error(exc) from exc
        if resp.status_code != 200:
            try:
                content = await resp.aread()
            except httpx.TransportError:
                content = b""
            finally:
                await resp.aclose()
            raise self.error_from_response(resp.status_code, resp.headers, content)
        if resp.headers.get("content-type", "").startswith("application/json"):
            # Some OpenAI-compatible servers ignore "stream": true and send the whole
            # reply as JSON: accept it as a stream of one chunk rather than fail.
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:
                raise self.transport_error(exc) from exc
            finally:
                await resp.aclose()
            return WholeReplyStream(self._whole_reply(content, request, model))
        return BackendStream(self, resp, self.stream_parser(request, model))
