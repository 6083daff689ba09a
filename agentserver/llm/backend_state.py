"""A backend's state inside one router (its breaker, cooling, buckets, slots and counters),
a route to it, and what one attempt holds (a lease, settled exactly once by
:meth:`Router.settle <agentserver.llm.router.Router.settle>`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import trio

from .accounting import BackendStats, Counters
from .backends import Backend, LlamaCppBackend
from .breaker import Breaker, Cooling, Permit
from .bucket import Limiter, TokenBucket
from .classify import DECISIONS
from .config import BackendConfig, RouterConfig
from .types import LLMError


class BackendRuntime:
    """Mutable state of one backend inside one router."""

    __slots__ = (
        "active",
        "backend",
        "breaker",
        "config",
        "cooling",
        "counters",
        "down",
        "limiter",
        "name",
        "rank",
        "req_index",
        "slots",
        "tok_index",
    )

    def __init__(
        self,
        config: BackendConfig,
        backend: Backend | LlamaCppBackend,
        rank: int,
        router_cfg: RouterConfig,
    ):
        self.config = config
        self.name = config.name
        self.backend = backend
        self.rank = rank
        self.breaker = Breaker(router_cfg.breaker.failures, router_cfg.breaker.cooldown)
        self.cooling = Cooling()
        self.counters = Counters()
        self.active = 0
        #: Its last attempt could not connect (UNREACHABLE): while its breaker is open,
        #: a request fails at once instead of waiting for the probe (see BackendSelector.choose).
        self.down = False
        now = trio.current_time() if in_trio() else 0.0
        buckets: list[TokenBucket] = []
        self.req_index: int | None = None
        self.tok_index: int | None = None
        if config.requests_per_minute:
            self.req_index = len(buckets)
            buckets.append(TokenBucket.per_minute(config.requests_per_minute, now))
        if config.tokens_per_minute:
            self.tok_index = len(buckets)
            buckets.append(TokenBucket.per_minute(config.tokens_per_minute, now))
        self.limiter = Limiter(buckets, max_waiters=router_cfg.queue_limit) if buckets else None
        self.slots = trio.Semaphore(config.max_concurrent) if config.max_concurrent else None

    def amounts(self, tokens: int) -> list[float]:
        out = [0.0] * len(self.limiter.buckets) if self.limiter else []
        if self.req_index is not None:
            out[self.req_index] = 1.0
        if self.tok_index is not None:
            out[self.tok_index] = float(tokens)
        return out

    def try_permit(self, now: float) -> Permit | None:
        """A breaker permit, unless a Retry-After still cools this backend down. The
        first call after the cooling ends is its probe (``cooling_probe``)."""
        if not self.cooling.ready(now):
            return None
        permit = self.breaker.try_acquire(now)
        if permit is None:
            return None
        if self.cooling.try_acquire(now):
            return Permit(permit.probe, permit.generation, cooling_probe=True)
        return permit

    def token_capacity(self) -> float:
        if self.limiter is None or self.tok_index is None:
            return math.inf
        return self.limiter.buckets[self.tok_index].capacity

    def stats(self, now: float | None) -> BackendStats:
        """A snapshot of this backend's accounting (``now`` None: outside trio)."""
        fill: tuple[float, ...] = ()
        if self.limiter is not None and now is not None:
            fill = self.limiter.fill(now)
        return BackendStats(
            name=self.name,
            provider=self.config.provider.value,
            skipped=None,
            counters=self.counters.copy(),
            breaker=self.breaker.state(now if now is not None else math.inf).value,
            consecutive_failures=self.breaker.consecutive_failures,
            breaker_opens=self.breaker.opens,
            active=self.active,
            cooling_for=self.cooling.remaining(now) if now is not None else 0.0,
            requests_bucket_fill=fill[self.req_index]
            if fill and self.req_index is not None
            else None,
            tokens_bucket_fill=fill[self.tok_index]
            if fill and self.tok_index is not None
            else None,
        )


def in_trio() -> bool:
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


@dataclass(slots=True)
class Route:
    runtime: BackendRuntime
    model: str  # the provider's name for the requested model or alias


class Lease:
    """What one attempt holds; settled exactly once by ``Router.settle``."""

    __slots__ = ("permit", "reserved", "runtime", "settled", "slot")

    def __init__(self, runtime: BackendRuntime, permit: Permit) -> None:
        self.runtime = runtime
        self.permit = permit
        self.reserved = 0
        self.slot = False
        self.settled = False


class DeadlineReached(LLMError):
    """An attempt cut short by the request's own deadline: it ends the request
    (no time left to fail over) and is no verdict on the backend."""


def verdict(err: LLMError) -> bool | None:
    """What a failed attempt tells the breaker: healthy, unhealthy, or nothing (the
    request's own deadline cut it short, before or after the first chunk alike)."""
    if isinstance(err, DeadlineReached):
        return None
    return not DECISIONS[err.kind].breaker
