"""Ollama's native chat API: ``POST {base_url}/api/chat``, NDJSON stream.

(Ollama's OpenAI-compatible ``/v1`` is served by the OpenAI backend.)
"""

from __future__ import annotations

import json
from typing import Any

from ..types import Reply, Request, Usage
from .base import Backend, StreamParser

__all__ = ["OllamaBackend"]


def _usage(data: dict[str, Any]) -> Usage:
    return Usage(int(data.get("prompt_eval_count") or 0), int(data.get("eval_count") or 0))


class _OllamaStream(StreamParser):
    def feed(self, line: str) -> list[str | Reply]:
        if not line.strip():
            return []
        obj = self.load(line)
        if not isinstance(obj, dict):
            raise self.backend.malformed(f"unexpected stream line: {line[:200]!r}")
        if "error" in obj:
            raise self.backend.stream_error(str(obj["error"]), "")
        if obj.get("model"):
            self.model = obj["model"]
        out = self.text((obj.get("message") or {}).get("content") or "")
        if obj.get("done"):
            self.finish_reason = obj.get("done_reason") or "stop"
            self.usage = _usage(obj)
            out.append(self.reply())
        return out


class OllamaBackend(Backend):
    def endpoint(self, base_url: str) -> str:
        return base_url + "/api/chat"

    def auth_headers(self, api_key: str | None) -> dict[str, str]:
        # Plain Ollama has no auth; a key is sent for proxies that add it.
        return {"authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, request: Request, model: str, stream: bool) -> dict[str, Any]:
        options: dict[str, Any] = {"num_predict": request.max_tokens}
        if request.temperature is not None:
            options["temperature"] = request.temperature
        if request.stop:
            options["stop"] = list(request.stop)
        return {
            "model": model,
            "messages": [{"role": m.role.value, "content": m.content} for m in request.messages],
            "stream": stream,
            "options": options,
        }

    def parse_reply(self, data: Any, request: Request, model: str) -> Reply:
        if not data.get("done", True):
            raise ValueError("response not done")
        return Reply(
            content=(data.get("message") or {}).get("content") or "",
            model=data.get("model") or model,
            usage=_usage(data),
            finish_reason=data.get("done_reason") or "stop",
        )

    def error_fields(self, data: Any) -> tuple[str, str]:
        if isinstance(data, dict):
            err = data.get("error", "")
            return (err if isinstance(err, str) else json.dumps(err)), ""
        return "", ""

    def stream_parser(self, request: Request, model: str) -> StreamParser:
        return _OllamaStream(self, request, model)
