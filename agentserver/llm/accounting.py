"""Counters the router keeps per backend and per agent, and their snapshots.

Counters are plain integers updated synchronously by the router (trio runs one
task at a time, so no locking). :class:`RouterStats` is an immutable snapshot,
``as_dict()`` gives plain JSON-ready data for the server to expose.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .classify import ErrorKind
from .types import Usage

__all__ = ["AgentStats", "BackendStats", "Counters", "RouterStats"]


@dataclass(slots=True)
class Counters:
    """Per backend, ``requests`` counts HTTP attempts sent to it and ``errors``
    every failed attempt. Per agent, ``requests`` counts calls to the router and
    ``errors`` the failures the agent finally saw."""

    requests: int = 0
    successes: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)

    def success(self, usage: Usage, cost: float | None) -> None:
        self.successes += 1
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        if cost:
            self.cost += cost

    def error(self, kind: ErrorKind) -> None:
        self.failures += 1
        self.errors[kind.value] = self.errors.get(kind.value, 0) + 1

    def copy(self) -> Counters:
        return Counters(
            self.requests,
            self.successes,
            self.failures,
            self.prompt_tokens,
            self.completion_tokens,
            self.cost,
            dict(self.errors),
        )


@dataclass(frozen=True, slots=True)
class BackendStats:
    name: str
    provider: str
    #: why the backend is not in use (e.g. its API key variable is unset), else None
    skipped: str | None
    counters: Counters
    breaker: str
    consecutive_failures: int
    breaker_opens: int
    #: attempts holding or waiting for a concurrency slot or rate-limit admission
    active: int
    #: seconds until a provider's Retry-After expires (0 if not cooling)
    cooling_for: float
    #: bucket level / capacity; None when that limit is not configured
    requests_bucket_fill: float | None
    tokens_bucket_fill: float | None


@dataclass(frozen=True, slots=True)
class AgentStats:
    name: str
    counters: Counters


@dataclass(frozen=True, slots=True)
class RouterStats:
    backends: dict[str, BackendStats]
    agents: dict[str, AgentStats]

    def as_dict(self) -> dict[str, Any]:
        return {
            "backends": {k: asdict(v) for k, v in self.backends.items()},
            "agents": {k: asdict(v) for k, v in self.agents.items()},
        }
