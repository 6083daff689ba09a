"""OpenAI-compatible chat completions (OpenAI, vLLM, llama.cpp, LM Studio,
Ollama's /v1, OpenRouter, ...): ``POST {base_url}/chat/completions``, SSE stream."""

from __future__ import annotations

from typing import Any

from ..types import Reply, Request, Usage
from .base import Backend, SSEDecoder, StreamParser

__all__ = ["OpenAIBackend"]


def _error_fields(data: Any) -> tuple[str, str]:
    err = data.get("error", data) if isinstance(data, dict) else {}
    if isinstance(err, str):  # some compatible servers send {"error": "text"}
        return err, ""
    message = str(err.get("message") or "")
    code = " ".join(str(err[k]) for k in ("type", "code") if err.get(k))
    return message, code


def _usage(data: Any) -> Usage | None:
    if not isinstance(data, dict):
        return None
    return Usage(int(data.get("prompt_tokens") or 0), int(data.get("completion_tokens") or 0))


class _OpenAIStream(StreamParser):
    def __init__(self, backend: Backend, request: Request, model: str) -> None:
        super().__init__(backend, request, model)
        self._sse = SSEDecoder()

    def feed(self, line: str) -> list[str | Reply]:
        event = self._sse.feed(line)
        if event is None:
            return []
        data = event[1]
        if data == "[DONE]":
            if self.finish_reason is None:
                self.finish_reason = "stop"
            return [self.reply()]
        obj = self.load(data)
        if not isinstance(obj, dict):
            raise self.backend.malformed(f"unexpected stream event: {data[:200]!r}")
        if "error" in obj:
            raise self.backend.stream_error(*_error_fields(obj))
        if obj.get("model"):
            self.model = obj["model"]
        if obj.get("usage"):
            self.usage = _usage(obj["usage"])
        out: list[str | Reply] = []
        for choice in obj.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            out += self.text(delta.get("content") or "")
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out


class OpenAIBackend(Backend):
    def endpoint(self, base_url: str) -> str:
        return base_url + "/chat/completions"

    def auth_headers(self, api_key: str | None) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, request: Request, model: str, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": m.role.value, "content": m.content} for m in request.messages],
            "max_tokens": request.max_tokens,
        }
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.stop:
            body["stop"] = list(request.stop)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def parse_reply(self, data: Any, request: Request, model: str) -> Reply:
        choice = data["choices"][0]
        usage = _usage(data.get("usage")) or Usage()
        return Reply(
            content=choice["message"].get("content") or "",
            model=data.get("model") or model,
            usage=usage,
            finish_reason=choice.get("finish_reason"),
        )

    def error_fields(self, data: Any) -> tuple[str, str]:
        return _error_fields(data)

    def stream_parser(self, request: Request, model: str) -> StreamParser:
        return _OpenAIStream(self, request, model)
