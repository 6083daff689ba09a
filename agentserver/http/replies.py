"""What one message sent over HTTP gets back on its thread (sans I/O but for an Event).

A message sent over HTTP has an endpoint of its own; its :class:`Exchange` is that
endpoint's sink. A waiting request reads the first reply; a ``?wait=false`` one is kept in
:class:`PendingThreads` for ``GET /v1/threads/{id}``, bounded in count, in replies per
thread and in time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import trio

from agentserver.pump.endpoint import Endpoint, Sink


class Exchange:
    """One message's thread: its replies (at most ``max_replies``, later ones dropped and
    counted) and the requests of it that ended without an answer.

    It opens its endpoint itself, last in its constructor, with
    ``open_endpoint(sink, on_chain_end)`` (its :meth:`take` and :meth:`chain_ended`): the
    endpoint is made with its hooks. What ``open_endpoint`` raises propagates."""

    __slots__ = (
        "changed",
        "deadline",
        "dropped",
        "endpoint",
        "fresh",
        "max_replies",
        "owner",
        "replies",
        "thread",
        "unanswered",
    )

    def __init__(
        self,
        thread: str,
        owner: str | None,
        open_endpoint: Callable[[Sink, Callable[[], None]], Endpoint],
        max_replies: int,
    ) -> None:
        self.thread = thread
        #: The client who sent it (None: anonymous); only it may read the thread.
        self.owner = owner
        self.max_replies = max_replies
        self.replies: list[bytes] = []
        self.dropped = 0
        self.unanswered = 0
        #: When a kept thread is forgotten (set once it is kept).
        self.deadline = 0.0
        #: Something came since the last :meth:`PendingThreads.touch`.
        self.fresh = False
        self.changed = trio.Event()
        # Last: the endpoint may deliver to take as soon as it exists.
        self.endpoint = open_endpoint(self.take, self.chain_ended)

    def take(self, data: bytes) -> bool:
        """The endpoint's sink: never blocks, never refuses (the endpoint never closes on a
        slow HTTP caller: what does not fit is dropped and counted)."""
        if len(self.replies) < self.max_replies:
            self.replies.append(data)
        else:
            self.dropped += 1
        self.fresh = True
        self.changed.set()
        return True

    def chain_ended(self) -> None:
        self.unanswered += 1
        self.fresh = True
        self.changed.set()

    @property
    def settled(self) -> bool:
        """Something came back: a reply, or the end of the request without one."""
        return bool(self.replies) or self.unanswered > 0

    async def wait_settled(self) -> None:
        while not self.settled:
            self.changed = trio.Event()
            await self.changed.wait()


@dataclass(frozen=True, slots=True)
class ThreadView:
    """What ``GET /v1/threads/{id}`` shows."""

    thread: str
    replies: list[bytes]
    unanswered: int
    dropped: int
    expires_in: float
    #: The client that sent the message (None: an anonymous caller).
    owner: str | None = None


class PendingThreads:
    """The threads of ``?wait=false`` messages, each kept ``ttl`` seconds after its last
    reply (or its start), at most ``max_threads`` at once. Pure: times are passed in.

    A message sent again on a kept thread takes the thread's place for reading; the one it
    replaces, if nothing has come back to it yet, is still held (:meth:`keep`) until it
    settles or its time is up, so its message is not dropped before its listener takes
    it (closing an endpoint drops what it sent that is still queued). Held ones count
    towards ``max_threads``."""

    def __init__(self, max_threads: int, ttl: float) -> None:
        self.max_threads = max_threads
        self.ttl = ttl
        self._threads: dict[str, Exchange] = {}
        #: Replaced on their thread before anything came back to them.
        self._held: list[Exchange] = []

    def __len__(self) -> int:
        return len(self._threads) + len(self._held)

    @property
    def full(self) -> bool:
        return len(self) >= self.max_threads

    def keep(self, exchange: Exchange, now: float) -> Exchange | None:
        """Keep ``exchange``; returns the one it replaces (same thread id) if that one is
        done with (something came back to it: its endpoint to close), else holds it."""
        exchange.deadline = now + self.ttl
        old = self._threads.get(exchange.thread)
        self._threads[exchange.thread] = exchange
        if old is None or old is exchange or old.settled:
            return old
        self._held.append(old)
        return None

    def view(
        self, thread: str, owner: str | None, now: float, *, any_owner: bool = False
    ) -> ThreadView | None:
        """The thread if ``owner`` sent it (or whoever did, with ``any_owner``: the
        caller applies the authorization rule to :attr:`ThreadView.owner`) and it is still
        kept; None otherwise (an unknown thread and another client's look the same)."""
        exchange = self._threads.get(thread)
        if exchange is None or exchange.deadline <= now:
            return None
        if not any_owner and exchange.owner != owner:
            return None
        return ThreadView(
            thread,
            list(exchange.replies),
            exchange.unanswered,
            exchange.dropped,
            exchange.deadline - now,
            exchange.owner,
        )

    def touch(self, now: float) -> None:
        """Threads that got something since they were kept live ``ttl`` from now."""
        for exchange in self._threads.values():
            if exchange.fresh:
                exchange.fresh = False
                exchange.deadline = now + self.ttl

    def expire(self, now: float) -> list[Exchange]:
        """Forget the threads whose time is up, and the held ones that settled or whose
        time is up; returns them (their endpoints to close)."""
        gone = [e for e in self._threads.values() if e.deadline <= now]
        for exchange in gone:
            del self._threads[exchange.thread]
        if self._held:
            still: list[Exchange] = []
            for exchange in self._held:
                (gone if exchange.settled or exchange.deadline <= now else still).append(exchange)
            self._held = still
        return gone

    def clear(self) -> list[Exchange]:
        gone = list(self._threads.values()) + self._held
        self._threads.clear()
        self._held = []
        return gone
