"""The requests of one connection that wait for replies: the bound that makes the server
stop reading from a client that sends faster than it is answered (TCP then pushes back).

At most ``max_inflight`` requests, of at most ``max_inflight_bytes`` bytes in all, are
counted at once. A request stops counting when a reply is written, when it ends without
one, or after ``inflight_ttl`` seconds. One request is always admitted when none waits,
however large: the byte bound must not shut out a big request. Replies are not matched to
requests (a broadcast may answer one request several times): each retires the oldest.
"""

from __future__ import annotations

import collections

import trio

from agentserver.net.limits import Limits


class Inflight:
    """The in-flight requests of one connection (see the module docstring). Synchronous
    except :meth:`wait_for_room` and :meth:`wait_reply`."""

    __slots__ = ("_room", "bytes", "limits", "requests")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        #: (deadline, size) of each request waiting for a reply, oldest first; bounded by
        #: max_inflight, and by max_inflight_bytes on ``bytes``, their sum of sizes.
        self.requests: collections.deque[tuple[float, int]] = collections.deque()
        self.bytes = 0
        self._room = trio.Event()

    def has_room(self, size: int) -> bool:
        """May a request of ``size`` bytes join those in flight? (One always may when
        none is, however large: the byte bound must not shut out a big request.)"""
        requests = self.requests
        return not requests or (
            len(requests) < self.limits.max_inflight
            and self.bytes + size <= self.limits.max_inflight_bytes
        )

    def add(self, now: float, size: int) -> None:
        """A request of ``size`` bytes was read at ``now``: it counts until replied to, or
        until ``inflight_ttl`` has passed."""
        self.requests.append((now + self.limits.inflight_ttl, size))
        self.bytes += size

    async def wait_for_room(self, size: int) -> None:
        """Wait until the connection may have one more request, of ``size`` bytes, in
        flight. Cancellable; bounded by ``inflight_ttl`` (old requests stop counting)."""
        requests = self.requests
        while not self.has_room(size):
            now = trio.current_time()
            while requests and requests[0][0] <= now:
                # Unanswered for inflight_ttl: stop counting it.
                self.bytes -= requests.popleft()[1]
            if self.has_room(size):
                break
            self._room = trio.Event()
            with trio.move_on_at(requests[0][0]):
                await self._room.wait()

    def replied(self, count: int) -> None:
        """``count`` replies were written: as many of the oldest requests stop counting."""
        requests = self.requests
        for _ in range(min(count, len(requests))):
            self.bytes -= requests.popleft()[1]
        self._room.set()

    async def wait_reply(self) -> None:
        """Wait (cancellably, unbounded) for the next :meth:`replied`."""
        self._room = trio.Event()
        await self._room.wait()
