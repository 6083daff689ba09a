"""Strict checks of what the LLM fakes send, against the providers' own response models.

The official clients do not validate responses (a reply without ``id`` or ``created`` reads
fine), so a fake could drift from the real API without any SDK test noticing. Every reply
and every streamed event the fakes build is checked here instead, by
``llm_fakes``' builders, against:

- OpenAI: ``openai.types.chat.ChatCompletion``, ``ChatCompletionChunk``, and
  ``openai.types.ErrorObject`` for error bodies;
- Anthropic: ``anthropic.types.Message``, ``RawMessageStreamEvent`` (plus the documented
  ``ping`` event, which the SDK has no model for) and ``ErrorResponse``;
- Ollama (no official client is a dependency): its documented ``/api/chat`` schema, written
  down once below.

Strict means: JSON types exactly (no coercion of ``"1"`` to 1), no field the model does not
declare (a typo is drift), and every required field present. The SDK models give fields
that the API reference marks required but nullable (``logprobs``, ``stop_reason``…) a
default of ``None``, so those are listed in :data:`API_REQUIRED` and enforced on top.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any, Literal

import pydantic
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from anthropic.types.raw_message_delta_event import Delta as AnthropicMessageDelta
from openai.types import ErrorObject
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as CompletionChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice

__all__ = [
    "API_REQUIRED",
    "FakeDrift",
    "check_anthropic_error",
    "check_anthropic_event",
    "check_anthropic_message",
    "check_ollama_chat",
    "check_ollama_error",
    "check_openai_chunk",
    "check_openai_completion",
    "check_openai_error",
]


class FakeDrift(AssertionError):
    """A fake's reply does not match the provider's documented response."""


# Required (nullable) in the providers' API references, defaulted to None by the SDKs.
# OpenAI: "The chat completion object" / "The chat completion chunk object";
# Anthropic: "Messages" response and the message_delta streaming event.
API_REQUIRED: dict[type[pydantic.BaseModel], frozenset[str]] = {
    CompletionChoice: frozenset({"logprobs", "finish_reason"}),
    ChatCompletionMessage: frozenset({"content", "refusal"}),
    ChunkChoice: frozenset({"finish_reason"}),
    Message: frozenset({"stop_reason", "stop_sequence"}),
    AnthropicMessageDelta: frozenset({"stop_reason", "stop_sequence"}),
}


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)


class AnthropicPing(_Strict):
    """The keep-alive event of Anthropic's stream (documented; no SDK model)."""

    type: Literal["ping"]


class OpenAIErrorBody(_Strict):
    error: dict[str, Any]


# -- Ollama /api/chat (docs/api.md of ollama/ollama: "Generate a chat completion") -------


class OllamaMessage(_Strict):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    images: list[str] | None = None


class OllamaChat(_Strict):
    """One response object: the whole reply (``stream: false``) or one line of a stream.
    The last one (``done: true``) also carries why it stopped and the counts and timings."""

    model: str
    created_at: str
    message: OllamaMessage
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None

    @pydantic.model_validator(mode="after")
    def _final_has_counts(self) -> OllamaChat:
        if self.done:
            missing = [
                name
                for name in ("done_reason", "prompt_eval_count", "eval_count")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(f"a done response needs {missing}")
        return self


class OllamaError(_Strict):
    error: str


# -- the checks -----------------------------------------------------------------------


@cache
def _adapter(kind: Any) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(kind)


def _validate(kind: Any, data: Any) -> Any:
    # Through JSON, strictly: exactly what goes on the wire, with JSON's own types.
    raw = data if isinstance(data, bytes | str) else json.dumps(data)
    try:
        value = _adapter(kind).validate_json(raw, strict=True)
    except pydantic.ValidationError as exc:
        raise FakeDrift(f"not a valid {getattr(kind, '__name__', kind)}: {exc}") from None
    _check_fields(value, getattr(kind, "__name__", "reply"))
    return value


def _check_fields(value: Any, path: str) -> None:
    """Every declared-required and API-required field present, no undeclared one, at
    every depth of the validated SDK model."""
    if isinstance(value, pydantic.BaseModel):
        kind = type(value)
        required = {n for n, f in kind.model_fields.items() if f.is_required()}
        required |= API_REQUIRED.get(kind, frozenset())
        missing = required - value.model_fields_set
        if missing:
            raise FakeDrift(f"{path} ({kind.__name__}) lacks {sorted(missing)}")
        extra = value.model_extra or {}
        if extra:
            raise FakeDrift(f"{path} ({kind.__name__}) has undeclared {sorted(extra)}")
        for name in value.model_fields_set:
            _check_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_fields(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_fields(item, f"{path}.{key}")


def check_openai_completion(body: dict[str, Any]) -> None:
    _validate(ChatCompletion, body)


def check_openai_chunk(chunk: dict[str, Any]) -> None:
    _validate(ChatCompletionChunk, chunk)


def check_openai_error(body: dict[str, Any]) -> None:
    _validate(OpenAIErrorBody, body)
    _validate(ErrorObject, body["error"])


def check_anthropic_message(body: dict[str, Any]) -> None:
    _validate(Message, body)


def check_anthropic_event(event: str, data: dict[str, Any]) -> None:
    """One server-sent event: its ``event:`` name is its data's ``type``."""
    if data.get("type") != event:
        raise FakeDrift(f"event {event!r} carries data of type {data.get('type')!r}")
    if event == "ping":
        _validate(AnthropicPing, data)
    elif event == "error":
        _validate(ErrorResponse, data)
    else:
        _validate(RawMessageStreamEvent, data)


def check_anthropic_error(body: dict[str, Any]) -> None:
    _validate(ErrorResponse, body)


def check_ollama_chat(body: dict[str, Any]) -> None:
    _validate(OllamaChat, body)


def check_ollama_error(body: dict[str, Any]) -> None:
    _validate(OllamaError, body)
