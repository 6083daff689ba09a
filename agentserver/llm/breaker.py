"""Circuit breaker: pure state machine, the caller passes the time.

CLOSED: calls flow; ``threshold`` consecutive unhealthy outcomes open it.
OPEN: no calls until ``cooldown`` seconds have passed since it opened.
HALF_OPEN: the cooldown is over; exactly one caller gets a *probe* permit. The
probe's healthy outcome closes the breaker, an unhealthy one reopens it for
another cooldown. While the probe is out nobody else gets a permit; if the
probe is abandoned (cancelled, never sent) :meth:`Breaker.release` lets the
next caller probe instead.

Outcomes of calls admitted before the breaker opened (permits of an older
generation) are ignored: they say nothing about the backend after it opened.

:class:`Cooling` is the same probe discipline for a provider's ``Retry-After``: the
backend is held back for the (capped) wait, then exactly one probe goes out, and only its
outcome ends the cooling or starts another.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Breaker", "BreakerState", "Cooling", "Permit"]


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True, slots=True)
class Permit:
    probe: bool
    generation: int
    #: this call is also the one probe of a :class:`Cooling` that ended
    cooling_probe: bool = False


class Breaker:
    def __init__(self, threshold: int, cooldown: float) -> None:
        if threshold < 1:
            raise ValueError("threshold must be >= 1")
        if cooldown < 0:
            raise ValueError("cooldown must be >= 0")
        self.threshold = threshold
        self.cooldown = cooldown
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self.probe_out = False
        self.generation = 0
        self.opens = 0  # how many times it opened, for accounting

    def state(self, now: float) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        if now < self.opened_at + self.cooldown:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def available_at(self, now: float) -> float | None:
        """When :meth:`try_acquire` would next succeed: ``now`` if it would now,
        the end of the cooldown if open, ``None`` if unknown because a probe is
        out (its outcome decides)."""
        if self.opened_at is None:
            return now
        if self.probe_out:
            return None
        return max(now, self.opened_at + self.cooldown)

    def try_acquire(self, now: float) -> Permit | None:
        """A permit to call the backend, or ``None`` if the breaker refuses."""
        if self.opened_at is None:
            return Permit(probe=False, generation=self.generation)
        if self.probe_out or now < self.opened_at + self.cooldown:
            return None
        self.probe_out = True
        return Permit(probe=True, generation=self.generation)

    def record(self, permit: Permit, healthy: bool, now: float) -> None:
        """Report the outcome of a call made under ``permit``."""
        if permit.generation != self.generation:
            return
        if permit.probe:
            self.probe_out = False
            if healthy:
                self._close()
            else:
                self._open(now)
            return
        if self.opened_at is not None:
            return
        if healthy:
            self.consecutive_failures = 0
            return
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.threshold:
            self._open(now)

    def release(self, permit: Permit) -> None:
        """The call under ``permit`` was never made or has no verdict (cancelled)."""
        if permit.probe and permit.generation == self.generation:
            self.probe_out = False

    def _open(self, now: float) -> None:
        self.opened_at = now
        self.generation += 1
        self.opens += 1

    def _close(self) -> None:
        self.opened_at = None
        self.consecutive_failures = 0
        self.generation += 1


class Cooling:
    """A backend held back by a provider's ``Retry-After`` (a 429), shared by all requests.

    :meth:`cool` holds it until ``now + seconds`` (the caller caps ``seconds``: a provider
    asking for an hour must not take a backend out for an hour). When that time has passed
    the backend is not simply open again: exactly one caller gets a probe
    (:meth:`try_acquire` returns True) and everyone else waits for its outcome, as with the
    breaker's half-open state. :meth:`probe_done` ends the cooling (the caller cools again
    if the probe was rate-limited once more); :meth:`release` hands the probe to the next
    caller when it was abandoned. Outcomes of other calls do not end it.
    """

    __slots__ = ("probe_out", "until")

    def __init__(self) -> None:
        self.until: float | None = None  # None: not cooling
        self.probe_out = False

    def cool(self, now: float, seconds: float) -> None:
        end = now + max(0.0, seconds)
        self.until = end if self.until is None else max(self.until, end)

    def remaining(self, now: float) -> float:
        """Seconds until the probe may go (0 when not cooling or already due)."""
        return 0.0 if self.until is None else max(0.0, self.until - now)

    def available_at(self, now: float) -> float | None:
        """When :meth:`try_acquire` would next grant: ``now`` if it would now, the end of
        the wait while cooling, ``None`` while the probe is out (its outcome decides)."""
        if self.until is None:
            return now
        if self.probe_out:
            return None
        return max(now, self.until)

    def ready(self, now: float) -> bool:
        """Would :meth:`try_acquire` grant now? (No side effect.)"""
        return self.until is None or (not self.probe_out and now >= self.until)

    def try_acquire(self, now: float) -> bool | None:
        """None: held back; False: not cooling, call freely; True: you are the probe."""
        if self.until is None:
            return False
        if self.probe_out or now < self.until:
            return None
        self.probe_out = True
        return True

    def probe_done(self) -> None:
        """The probe got an answer: the cooling is over."""
        self.until = None
        self.probe_out = False

    def release(self) -> None:
        """The probe was never sent or has no verdict: the next caller probes."""
        self.probe_out = False
