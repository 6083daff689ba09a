"""Value types of the LLM router: requests, completions, usage and the one error type.

Everything here is immutable and free of I/O. Times are on trio's clock
(``trio.current_time()``), never the wall clock, so tests can drive them with
``trio.testing.MockClock``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from .classify import ErrorKind

__all__ = [
    "Attempt",
    "Completion",
    "ErrorKind",
    "LLMError",
    "Message",
    "Reply",
    "Request",
    "Role",
    "Usage",
]


class Role(StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str

    @classmethod
    def system(cls, content: str) -> Message:
        return cls(Role.SYSTEM, content)

    @classmethod
    def user(cls, content: str) -> Message:
        return cls(Role.USER, content)

    @classmethod
    def assistant(cls, content: str) -> Message:
        return cls(Role.ASSISTANT, content)


@dataclass(frozen=True, slots=True, init=False)
class Request:
    """One chat completion request, independent of any provider.

    ``model`` is either a model name listed by a backend or an alias declared
    by it; matching is exact (no substring or prefix matching).

    ``deadline`` is an *absolute* time on trio's clock (compare
    ``trio.current_time()``), covering everything the router does for this
    request: queueing on rate limits, every attempt, every retry delay. It
    composes with ``trio.move_on_at``. ``None`` means the router's configured
    default timeout, counted from the moment the router receives the request.

    ``agent`` names the calling agent for accounting only.
    """

    messages: tuple[Message, ...]
    model: str
    max_tokens: int = 1024
    temperature: float | None = None
    stop: tuple[str, ...] = ()
    deadline: float | None = None
    agent: str = ""
    #: A GBNF grammar the reply must follow, for a backend that constrains decoding (the
    #: local one); other backends ignore it. See agentserver/core/xsd_gbnf.py.
    grammar: str | None = None

    def __init__(
        self,
        messages: Iterable[Message],
        model: str,
        max_tokens: int = 1024,
        temperature: float | None = None,
        stop: Iterable[str] = (),
        deadline: float | None = None,
        agent: str = "",
        grammar: str | None = None,
    ) -> None:
        msgs = tuple(messages)
        if not msgs:
            raise ValueError("a request needs at least one message")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        # frozen dataclass: assign through object.__setattr__ so callers may pass
        # lists and still get a hashable, immutable request.
        object.__setattr__(self, "messages", msgs)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "deadline", deadline)
        object.__setattr__(self, "agent", agent)
        object.__setattr__(self, "grammar", grammar)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: True: the provider reported none; these are the router's estimates (spend budgets
    #: then settle at the reserved worst case instead).
    estimated: bool = field(default=False, compare=False)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Reply:
    """What a backend returns for one successful call (before the router adds
    backend name, latency and cost)."""

    content: str
    model: str
    usage: Usage
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished completion.

    ``latency`` is seconds on trio's clock from the router receiving the
    request to this completion, including rate-limit queueing and retries.
    ``cost`` is in the currency of the backend's price table, ``None`` when the
    backend has none. ``attempts`` counts the HTTP calls this request made.
    """

    content: str
    model: str
    backend: str
    usage: Usage
    finish_reason: str | None
    latency: float
    cost: float | None = None
    attempts: int = 1


@dataclass(frozen=True, slots=True)
class Attempt:
    """One failed attempt, kept on the final error for diagnosis."""

    backend: str
    kind: ErrorKind
    status: int | None


class LLMError(Exception):
    """The only exception the router raises for a failed request.

    ``kind`` is the classified :class:`ErrorKind`; ``backend`` the backend that
    produced the deciding failure (``None`` when no backend was called);
    ``status`` the HTTP status if there was one; ``provider_message`` the
    provider's own error text (or the router's explanation when no provider
    spoke); ``retry_after`` the wait in seconds the provider or the router says
    would have been needed, when known. ``attempts`` lists the failed attempts
    of this request in order.
    """

    def __init__(
        self,
        kind: ErrorKind,
        provider_message: str,
        *,
        backend: str | None = None,
        status: int | None = None,
        retry_after: float | None = None,
        attempts: tuple[Attempt, ...] = (),
    ) -> None:
        self.kind = kind
        self.backend = backend
        self.status = status
        self.provider_message = provider_message
        self.retry_after = retry_after
        self.attempts = attempts
        super().__init__(self._describe())

    def _describe(self) -> str:
        where = f" from {self.backend}" if self.backend else ""
        status = f" (HTTP {self.status})" if self.status is not None else ""
        wait = f"; retry after {self.retry_after:.3g}s" if self.retry_after is not None else ""
        return f"{self.kind.value}{where}{status}: {self.provider_message}{wait}"

    def with_attempts(self, attempts: tuple[Attempt, ...]) -> LLMError:
        return LLMError(
            self.kind,
            self.provider_message,
            backend=self.backend,
            status=self.status,
            retry_after=self.retry_after,
            attempts=attempts,
        )
