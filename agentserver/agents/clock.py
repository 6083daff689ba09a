"""Injectable wall clock for everything the agent store records.

Times stored in the database (``created_at``, ``dispatched_at``, ``resume_deadline``, ...)
are float seconds since the Unix epoch and always come from a :class:`Clock`, never from
``time.time()`` directly, so tests can move time by hand. Sleeping and timeouts inside the
worker use trio's clock (``trio.testing.MockClock`` in tests); the two are independent.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Source of wall-clock time in seconds since the epoch."""

    def now(self) -> float: ...


class SystemClock:
    """The real wall clock."""

    __slots__ = ()

    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock that only moves when told to (tests, benchmarks)."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock never goes back")
        self._now += seconds

    def set(self, when: float) -> None:
        if when < self._now:
            raise ValueError("a clock never goes back")
        self._now = when
