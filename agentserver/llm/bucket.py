"""Token buckets: pure arithmetic plus a trio limiter with a fair queue.

:class:`TokenBucket` is sans-IO: it is told the time and only does sums.
:class:`Limiter` puts one or more buckets (for example requests-per-minute and
tokens-per-minute) behind a single FIFO queue on trio and grants all of them in
one step, so the instant a caller is admitted is the instant every bucket is
charged. Two separate queues could admit a caller on one bucket, keep it waiting
on the other and later release a burst; one queue cannot.

Waiters may name who they wait for (``key``: the router passes the agent): the queue is
then one FIFO lane per key, served round robin, so one hot agent cannot take the whole
bucket while others wait (each waiting agent gets a grant in turn). Without keys there is
one lane: strict FIFO.

Guarantee: over any interval of length ``T`` the amount granted by a bucket is
at most ``capacity + rate * T`` (plus whatever was given back with
:meth:`Limiter.give_back`), so concurrent callers can never overshoot a limit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import trio

__all__ = [
    "ExceedsCapacity",
    "Limiter",
    "LimiterError",
    "QueueFull",
    "TokenBucket",
]

# Float sums of refills can land a hair below the requested amount; without a
# tolerance the head waiter would sleep for femtoseconds in a loop.
_EPSILON = 1e-9


class LimiterError(Exception):
    """Base class of the limiter's own refusals."""


class ExceedsCapacity(LimiterError):
    """The amount asked for is larger than the bucket can ever hold; waiting would never end."""

    def __init__(self, index: int, amount: float, capacity: float) -> None:
        self.index = index
        self.amount = amount
        self.capacity = capacity
        super().__init__(f"asked for {amount:g} but bucket {index} holds at most {capacity:g}")


class QueueFull(LimiterError):
    """The limiter's queue of waiters is at its bound."""


@dataclass(slots=True)
class TokenBucket:
    """A token bucket; all methods take the current time explicitly.

    ``level`` may go negative: :meth:`take` after the fact (reconciling a call
    that used more than was reserved) creates a debt that later callers wait
    out. ``level`` never exceeds ``capacity``.
    """

    capacity: float
    rate: float  # tokens per second
    level: float
    stamp: float

    @classmethod
    def per_minute(cls, limit: float, now: float, *, capacity: float | None = None) -> TokenBucket:
        """A bucket refilling ``limit`` per minute, starting full.

        The default capacity is one minute's worth, the usual meaning of a
        provider's "per minute" limit.
        """
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        cap = float(limit if capacity is None else capacity)
        return cls(capacity=cap, rate=limit / 60.0, level=cap, stamp=now)

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_time(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` is available if nobody else takes any; 0 if now."""
        self.refill(now)
        deficit = amount - self.level
        if deficit <= _EPSILON * max(1.0, self.capacity):
            return 0.0
        return deficit / self.rate

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)


class _Waiter:
    __slots__ = ("amounts", "key", "wake")

    def __init__(self, amounts: Sequence[float], key: object) -> None:
        self.amounts = amounts
        self.key = key
        self.wake = trio.Event()


class Limiter:
    """Several token buckets behind one queue, on trio.

    - :meth:`acquire` is atomic across buckets: a caller is charged on every
      bucket at the same instant or on none.
    - Waiters of one key are served strictly in arrival order; a later small request
      never overtakes an earlier large one (that would starve large requests). Keys
      take turns (round robin over the keys waiting, in order of arrival): a key that
      was just granted goes behind the others.
    - A cancelled wait takes nothing and lets the next waiter move up.
    - The queue is bounded by ``max_waiters``; beyond it :meth:`acquire` raises
      :class:`QueueFull` at once rather than growing without bound.
    - Asking for more than a bucket's capacity raises :class:`ExceedsCapacity`
      at once, since it could never be granted.
    """

    def __init__(self, buckets: Sequence[TokenBucket], *, max_waiters: int = 1000) -> None:
        if max_waiters < 0:
            raise ValueError("max_waiters must be >= 0")
        self.buckets: tuple[TokenBucket, ...] = tuple(buckets)
        self.max_waiters = max_waiters
        #: key -> its FIFO lane; the dict's order is the round robin's (bounded: one
        #: lane per key waiting, removed when empty).
        self._lanes: dict[object, deque[_Waiter]] = {}
        self._waiting = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    def _head(self) -> _Waiter | None:
        for lane in self._lanes.values():
            return lane[0]
        return None

    def _remove(self, waiter: _Waiter, *, granted: bool) -> None:
        lane = self._lanes.get(waiter.key)
        if lane is None or waiter not in lane:
            return
        lane.remove(waiter)
        self._waiting -= 1
        if not lane:
            del self._lanes[waiter.key]
        elif granted:
            # Its turn is over: behind every other key waiting.
            del self._lanes[waiter.key]
            self._lanes[waiter.key] = lane

    def _check(self, amounts: Sequence[float]) -> None:
        if len(amounts) != len(self.buckets):
            raise ValueError(f"expected {len(self.buckets)} amounts, got {len(amounts)}")
        for i, (bucket, amount) in enumerate(zip(self.buckets, amounts, strict=True)):
            if amount > bucket.capacity:
                raise ExceedsCapacity(i, amount, bucket.capacity)

    def _wait_time(self, amounts: Sequence[float], now: float) -> float:
        wait = 0.0
        for bucket, amount in zip(self.buckets, amounts, strict=True):
            w = bucket.wait_time(amount, now)
            if w > wait:
                wait = w
        return wait

    def _grant(self, amounts: Sequence[float], now: float) -> None:
        for bucket, amount in zip(self.buckets, amounts, strict=True):
            bucket.take(amount, now)

    def _wake_head(self) -> None:
        head = self._head()
        if head is not None:
            head.wake.set()

    def try_acquire(self, amounts: Sequence[float]) -> bool:
        """Take ``amounts`` now if nobody is queued and every bucket has enough."""
        self._check(amounts)
        if self._waiting:
            return False
        now = trio.current_time()
        if self._wait_time(amounts, now) > 0.0:
            return False
        self._grant(amounts, now)
        return True

    async def acquire(self, amounts: Sequence[float], key: object = None) -> None:
        """Wait in line (``key``'s lane) until every bucket can give its amount, then
        take them all.

        Always a checkpoint. Cancellation while waiting takes nothing.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.try_acquire(amounts):
            # Still yield once so acquire() is a full checkpoint; shielded, so the grant
            # just made cannot be lost to a cancellation.
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if self._waiting >= self.max_waiters:
            raise QueueFull(f"{self._waiting} callers already waiting")
        waiter = _Waiter(amounts, key)
        self._lanes.setdefault(key, deque()).append(waiter)
        self._waiting += 1
        try:
            while True:
                if self._head() is waiter:
                    now = trio.current_time()
                    wait = self._wait_time(amounts, now)
                    if wait <= 0.0:
                        self._grant(amounts, now)
                        self._remove(waiter, granted=True)
                        self._wake_head()
                        return
                    with trio.move_on_at(now + wait):
                        await waiter.wake.wait()
                else:
                    await waiter.wake.wait()
                waiter.wake = trio.Event()
        except BaseException:
            was_head = self._head() is waiter
            self._remove(waiter, granted=False)
            if was_head:
                self._wake_head()
            raise

    def give_back(self, amounts: Sequence[float]) -> None:
        """Return (positive) or charge further (negative) amounts, e.g. after
        reconciling an estimate with the usage a provider reported. A charge may
        push a bucket into debt; a return never raises it above capacity."""
        now = trio.current_time()
        for bucket, amount in zip(self.buckets, amounts, strict=True):
            if amount > 0:
                bucket.give(amount, now)
            elif amount < 0:
                bucket.take(-amount, now)
        self._wake_head()

    def fill(self, now: float) -> tuple[float, ...]:
        """Each bucket's level at ``now`` as a fraction of its capacity (negative in debt)."""
        out = []
        for bucket in self.buckets:
            bucket.refill(now)
            out.append(bucket.level / bucket.capacity)
        return tuple(out)
