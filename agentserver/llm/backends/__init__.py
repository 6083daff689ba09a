"""Provider wire formats. Each backend turns a :class:`~agentserver.llm.types.Request`
into one HTTP call and the answer into a :class:`~agentserver.llm.types.Reply` or
an :class:`~agentserver.llm.types.LLMError`; choosing, retrying and limiting are
the router's business. The local backend (``llama-cpp``) makes no HTTP call: it runs
a GGUF model in-process, with the same two methods."""

from __future__ import annotations

import httpx

from ..config import BackendConfig, Provider
from .anthropic import AnthropicBackend
from .base import Backend, BackendStream, ReplyStream
from .llama_cpp import LlamaCppBackend, LocalStream
from .ollama import OllamaBackend
from .openai import OpenAIBackend

__all__ = [
    "AnthropicBackend",
    "Backend",
    "BackendStream",
    "LlamaCppBackend",
    "LocalStream",
    "OllamaBackend",
    "OpenAIBackend",
    "ReplyStream",
    "make_backend",
]

_CLASSES: dict[Provider, type[Backend]] = {
    Provider.OPENAI: OpenAIBackend,
    Provider.ANTHROPIC: AnthropicBackend,
    Provider.OLLAMA: OllamaBackend,
}


def make_backend(
    config: BackendConfig, client: httpx.AsyncClient, api_key: str | None
) -> Backend | LlamaCppBackend:
    if config.provider is Provider.LLAMA_CPP:
        return LlamaCppBackend(config)
    return _CLASSES[config.provider](config, client, api_key)
