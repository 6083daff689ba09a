"""Adapter from the worker's :class:`~agentserver.agents.ports.LLMPort` to the LLM router.

Imports the router lazily-typed through a small Protocol so this package keeps working if
the router's module layout changes; only the value types are imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from agentserver.agents.errors import LLMUnavailable
from agentserver.agents.ports import LLMCompletion, LLMRequest, LLMUsage
from agentserver.llm.types import Completion, LLMError, Message, Request, Role

DEFAULT_MAX_TOKENS = 1024


class _Router(Protocol):
    async def complete(self, request: Request) -> Completion: ...

    def stream(self, request: Request) -> contextlib.AbstractAsyncContextManager: ...


class RouterLLM:
    """``LLMPort`` over ``agentserver.llm.router.Router``; ``LLMError`` → ``LLMUnavailable``."""

    def __init__(self, router: _Router) -> None:
        self._router = router
        #: The router itself, for status and readiness (agentserver status, /readyz).
        self.router = router

    def context_window(self, model: str) -> int | None:
        """The model's declared window in the router's configuration (None: unknown)."""
        config = getattr(self._router, "config", None)
        if config is None:
            return None
        from agentserver.llm.config import model_context_window

        return model_context_window(config, model)

    def _request(self, request: LLMRequest) -> Request:
        return Request(
            [Message(Role(m.role), m.content) for m in request.messages],
            model=request.model,
            max_tokens=request.max_tokens or DEFAULT_MAX_TOKENS,
            agent=request.agent,
            grammar=request.grammar,
        )

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        try:
            done = await self._router.complete(self._request(request))
        except LLMError as exc:
            raise _unavailable(exc) from exc
        return _completion(done)

    @contextlib.asynccontextmanager
    async def stream(
        self, request: LLMRequest
    ) -> AsyncIterator[AsyncIterator[str | LLMCompletion]]:
        """Text chunks as the model produces them, then the final :class:`LLMCompletion`.

        Fails over only before the first chunk (the router's rule); an error after that
        surfaces as ``LLMUnavailable`` and no chunk is repeated.
        """
        try:
            async with self._router.stream(self._request(request)) as chunks:
                yield _adapt(chunks)
        except LLMError as exc:
            raise _unavailable(exc) from exc


def _unavailable(exc: LLMError) -> LLMUnavailable:
    return LLMUnavailable(str(exc), kind=str(exc.kind.value), retry_after=exc.retry_after)


async def _adapt(chunks: AsyncIterator[str | Completion]) -> AsyncIterator[str | LLMCompletion]:
    async for item in chunks:
        yield item if isinstance(item, str) else _completion(item)


def _completion(done: Completion) -> LLMCompletion:
    return LLMCompletion(
        content=done.content,
        usage=LLMUsage(
            done.usage.prompt_tokens,
            done.usage.completion_tokens,
            done.usage.total_tokens,
            estimated=done.usage.estimated,
        ),
        cost=done.cost or 0.0,
        model=done.model,
        backend=done.backend,
    )
