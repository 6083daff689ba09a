"""Choosing a backend for the next attempt: the strategy's order over the routes still
usable, breakers and Retry-After cooling permitting, and the wait while every candidate
cools down (woken by :meth:`BackendSelector.wake` whenever an attempt is settled)."""

from __future__ import annotations

import math

import trio

from .backend_state import BackendRuntime, Route
from .breaker import Permit
from .classify import ErrorKind
from .config import Strategy
from .types import Attempt, LLMError


class BackendSelector:
    """One router's backend choice. Holds only the round-robin position and the waiters
    on a cooling backend; the backends' own state is in their :class:`BackendRuntime`."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self._rr = 0
        self._changed = trio.Event()
        self._waiting = 0  # tasks in choose() waiting on _changed

    def wake(self) -> None:
        """An attempt was settled: wake the requests waiting for a cooling backend (a
        probe may have resolved). Never blocks."""
        if self._waiting:
            changed, self._changed = self._changed, trio.Event()
            changed.set()

    async def choose(
        self,
        routes: tuple[Route, ...],
        excluded: set[BackendRuntime],
        window_floor: float,
        deadline: float,
        last: LLMError | None,
        failures: list[Attempt],
    ) -> tuple[Route, Permit]:
        """The next backend by strategy and a permit for it, waiting (up to ``deadline``,
        cancellably) while every candidate cools down. Raises :class:`LLMError` when none
        is left or none comes back in time (``last`` and ``failures``: the request's
        attempts so far)."""
        while True:
            candidates = [
                r
                for r in routes
                if r.runtime not in excluded
                and (window_floor < 0 or (r.runtime.config.context_window or -1) > window_floor)
            ]
            if not candidates:
                if last is not None:
                    raise last.with_attempts(tuple(failures))
                raise LLMError(ErrorKind.UNKNOWN, "no usable backend")  # pragma: no cover
            now = trio.current_time()
            for r in self.order(candidates):
                permit = r.runtime.try_permit(now)
                if permit is not None:
                    return r, permit
            # Every candidate is cooling down: find the first to come back, and
            # whether a Retry-After (RATE_LIMIT) or a breaker (OVERLOADED) holds it.
            earliest = math.inf
            kind: ErrorKind | None = None
            probing = False  # a probe is out: its outcome, not the clock, decides
            for r in candidates:
                rt = r.runtime
                back = rt.breaker.available_at(now)
                cool = rt.cooling.available_at(now)
                probing = probing or back is None or cool is None
                breaker_at = math.inf if back is None else back
                cooling_at = math.inf if cool is None else cool
                at = max(cooling_at, breaker_at)
                if kind is None or at < earliest:
                    earliest = at
                    limited = cooling_at >= breaker_at
                    kind = ErrorKind.RATE_LIMIT if limited else ErrorKind.OVERLOADED
            assert kind is not None  # candidates is not empty
            if all(r.runtime.down for r in candidates):
                # Every backend refused the connection last time: waiting for a breaker's
                # probe would only delay the failure (a backend that is down is not busy).
                names = ", ".join(r.runtime.name for r in candidates)
                raise LLMError(
                    ErrorKind.UNREACHABLE,
                    f"every backend for this model is unreachable ({names}); "
                    "it is tried again when its breaker lets a probe through",
                    retry_after=earliest - now if math.isfinite(earliest) else None,
                    attempts=tuple(failures),
                )
            if earliest > deadline and (not probing or now >= deadline):
                wait = earliest - now if math.isfinite(earliest) else None
                names = ", ".join(r.runtime.name for r in candidates)
                needed = (
                    f"the first returns in {wait:.3g}s"
                    if wait is not None
                    else "a probe is still out"
                )
                raise LLMError(
                    kind,
                    f"every backend for this model is cooling down ({names}); {needed}, "
                    "after the request's deadline",
                    retry_after=wait,
                    attempts=tuple(failures),
                )
            changed = self._changed
            self._waiting += 1
            try:
                with trio.move_on_at(min(earliest, deadline)):
                    await changed.wait()
            finally:
                self._waiting -= 1

    def order(self, candidates: list[Route]) -> list[Route]:
        """``candidates`` in the order the strategy tries them."""
        strategy = self.strategy
        if strategy is Strategy.FAILOVER or len(candidates) < 2:
            return candidates
        if strategy is Strategy.ROUND_ROBIN:
            start = self._rr % len(candidates)
            self._rr += 1
            return candidates[start:] + candidates[:start]
        return sorted(candidates, key=lambda r: (r.runtime.active, r.runtime.rank))
