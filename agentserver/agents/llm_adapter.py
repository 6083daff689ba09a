"""Adapter from the worker's :class:`~agentserver.agents.ports.LLMPort` to the LLM router.

Imports the router lazily-typed through a small Protocol so this package keeps working if
the router's module layout changes; only the value types are imported.
"""

from __future__ import annotations

from typing import Protocol

from agentserver.agents.errors import LLMUnavailable
from agentserver.agents.ports import LLMCompletion, LLMRequest, LLMUsage
from agentserver.llm.types import Completion, LLMError, Message, Request, Role

DEFAULT_MAX_TOKENS = 1024


class _Router(Protocol):
    async def complete(self, request: Request) -> Completion: ...


class RouterLLM:
    """``LLMPort`` over ``agentserver.llm.router.Router``; ``LLMError`` → ``LLMUnavailable``."""

    def __init__(self, router: _Router) -> None:
        self._router = router

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        req = Request(
            [Message(Role(m.role), m.content) for m in request.messages],
            model=request.model,
            max_tokens=request.max_tokens or DEFAULT_MAX_TOKENS,
            agent=request.agent,
        )
        try:
            done = await self._router.complete(req)
        except LLMError as exc:
            raise LLMUnavailable(str(exc), kind=str(exc.kind.value)) from exc
        return LLMCompletion(
            content=done.content,
            usage=LLMUsage(
                done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens
            ),
            cost=done.cost or 0.0,
            model=done.model,
            backend=done.backend,
        )
