"""Provider wire formats. Each backend turns a :class:`~agentserver.llm.types.Request`
into one HTTP call and the answer into a :class:`~agentserver.llm.types.Reply` or
an :class:`~agentserver.llm.types.LLMError`; choosing, retrying and limiting are
the router's business."""

from __future__ import annotations

import httpx

from ..config import BackendConfig, Provider
from .anthropic import AnthropicBackend
from .base import Backend, BackendStream
from .ollama import OllamaBackend
from .openai import OpenAIBackend

__all__ = [
    "AnthropicBackend",
    "Backend",
    "BackendStream",
    "OllamaBackend",
    "OpenAIBackend",
    "make_backend",
]

_CLASSES: dict[Provider, type[Backend]] = {
    Provider.OPENAI: OpenAIBackend,
    Provider.ANTHROPIC: AnthropicBackend,
    Provider.OLLAMA: OllamaBackend,
}


def make_backend(config: BackendConfig, client: httpx.AsyncClient, api_key: str | None) -> Backend:
    return _CLASSES[config.provider](config, client, api_key)
