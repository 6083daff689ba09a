"""Anthropic Messages API: ``POST {base_url}/v1/messages``, SSE stream.

Finish reasons are mapped to the OpenAI vocabulary (``stop``, ``length``,
``content_filter``) so agents see one set; unknown ones pass through.
"""

from __future__ import annotations

from typing import Any

from ..types import Reply, Request, Role, Usage
from .base import Backend, SSEDecoder, StreamParser

__all__ = ["ANTHROPIC_VERSION", "AnthropicBackend"]

ANTHROPIC_VERSION = "2023-06-01"

_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
}


def _finish(reason: str | None) -> str | None:
    return None if reason is None else _FINISH.get(reason, reason)


def _error_fields(data: Any) -> tuple[str, str]:
    err = data.get("error", data) if isinstance(data, dict) else {}
    if isinstance(err, str):
        return err, ""
    return str(err.get("message") or ""), str(err.get("type") or "")


class _AnthropicStream(StreamParser):
    def __init__(self, backend: Backend, request: Request, model: str) -> None:
        super().__init__(backend, request, model)
        self._sse = SSEDecoder()
        self._input = 0
        self._output = 0

    def feed(self, line: str) -> list[str | Reply]:
        event = self._sse.feed(line)
        if event is None:
            return []
        name, data = event
        if name == "ping":
            return []
        obj = self.load(data)
        kind = obj.get("type", name) if isinstance(obj, dict) else name
        if kind == "error":
            raise self.backend.stream_error(*_error_fields(obj))
        if kind == "message_start":
            message = obj.get("message") or {}
            self.model = message.get("model") or self.model
            self._input = int((message.get("usage") or {}).get("input_tokens") or 0)
            self._output = int((message.get("usage") or {}).get("output_tokens") or 0)
        elif kind == "content_block_delta":
            delta = obj.get("delta") or {}
            if delta.get("type") == "text_delta":
                return self.text(delta.get("text") or "")
        elif kind == "message_delta":
            reason = (obj.get("delta") or {}).get("stop_reason")
            if reason:
                self.finish_reason = _finish(reason)
            usage = obj.get("usage") or {}
            self._output = int(usage.get("output_tokens") or self._output)
            self._input = int(usage.get("input_tokens") or self._input)
        elif kind == "message_stop":
            if self.finish_reason is None:
                self.finish_reason = "stop"
            self.usage = Usage(self._input, self._output)
            return [self.reply()]
        return []


class AnthropicBackend(Backend):
    def endpoint(self, base_url: str) -> str:
        return base_url + "/v1/messages"

    def auth_headers(self, api_key: str | None) -> dict[str, str]:
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        return headers

    def body(self, request: Request, model: str, stream: bool) -> dict[str, Any]:
        system = [m.content for m in request.messages if m.role is Role.SYSTEM]
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": request.max_tokens,
            "messages": [
                {"role": m.role.value, "content": m.content}
                for m in request.messages
                if m.role is not Role.SYSTEM
            ],
        }
        if system:
            body["system"] = "\n\n".join(system)
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.stop:
            body["stop_sequences"] = list(request.stop)
        if stream:
            body["stream"] = True
        return body

    def parse_reply(self, data: Any, request: Request, model: str) -> Reply:
        text = "".join(
            block.get("text", "") for block in data["content"] if block.get("type") == "text"
        )
        usage = data.get("usage") or {}
        return Reply(
            content=text,
            model=data.get("model") or model,
            usage=Usage(int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)),
            finish_reason=_finish(data.get("stop_reason")),
        )

    def error_fields(self, data: Any) -> tuple[str, str]:
        return _error_fields(data)

    def stream_parser(self, request: Request, model: str) -> StreamParser:
        return _AnthropicStream(self, request, model)
