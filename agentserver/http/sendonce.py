"""One send at a time per thread, in this process, for the doors that send a task on a
thread they chose (an A2A task's id, an AG-UI run's thread).

Why: the gateway keeps one exchange per thread. A second send on a thread whose first is
still in flight replaces the first's exchange and releases its endpoint, so the first
message may be dropped before its agent queues it; and the pump gives the second one a
new thread (a client never joins another endpoint's conversation), so it arrives as a
different task. A door that checks "is this task queued yet?" and then sends makes two
awaits, and two requests can both pass the check. :class:`SendOnce` makes the check
and the send one step per key, and remembers the sends it made for a while: the next
holder of a key sent recently waits until the store holds that task (:meth:`settle`)
before it checks, so it sees it. The send itself returns at once (a non-blocking
``SendMessage`` answers before its task runs).

Across processes that share a store each process may still send once; the store drops a
repeat of an A2A task (agents/store/sql/a2a.py, ``earlier_send``) and docs/ag-ui.md says
what an AG-UI run does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import trio

T = TypeVar("T")

#: How long a send waits for the store to hold its task (seconds): the pump delivers it
#: to its agent after the send returns, in a few milliseconds unless the agent's queue is
#: full. Bounded, so that a task the pump refused later does not hold its key for ever.
STORED_WAIT = 5.0
#: The first and the longest gap between two looks at the store (seconds).
FIRST_POLL = 0.002
LONGEST_POLL = 0.05


#: The sends remembered at most (the oldest are forgotten first).
MAX_REMEMBERED = 4096


class SendOnce:
    """A lock per key, whose entry lives only while a holder holds it or waits for it
    (bounded by the requests in flight), and the keys sent in the last
    :data:`STORED_WAIT` seconds (bounded by :data:`MAX_REMEMBERED`)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[trio.Lock, list[int]]] = {}
        #: key → when it was sent (trio's clock), oldest first.
        self._sent: dict[str, float] = {}

    def sent(self, key: str) -> None:
        """``key``'s task was just sent: the next holder settles it first."""
        self._sent.pop(key, None)
        self._sent[key] = trio.current_time()
        while len(self._sent) > MAX_REMEMBERED:
            del self._sent[next(iter(self._sent))]

    async def settle(self, key: str, stored: Callable[[], Awaitable[bool]]) -> None:
        """If ``key`` was sent in the last :data:`STORED_WAIT` seconds, wait until the
        store holds its task (``stored``), for what is left of that time. Call holding
        ``key``."""
        at = self._sent.get(key)
        if at is None:
            return
        left = at + STORED_WAIT - trio.current_time()
        if left > 0 and await until_stored(stored, left):
            return
        self._sent.pop(key, None)

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """Hold ``key``: one holder at a time, in the order they came (trio's locks are
        fair). Cancelled while waiting: the entry is still released."""
        lock, users = self._locks.setdefault(key, (trio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)


async def until_found(
    look: Callable[[], Awaitable[T | None]],
    wait: float = STORED_WAIT,
    *,
    first: float = FIRST_POLL,
    longest: float = LONGEST_POLL,
) -> T | None:
    """Look at the store (``look``) until it finds something, at most ``wait`` seconds,
    the gaps growing from ``first`` to ``longest``; what it found (None: not within
    ``wait``). Polled, not told: the store is the truth, and another process may be the
    one that writes it."""
    gap = first
    with trio.move_on_after(wait):
        while True:
            found = await look()
            if found is not None:
                return found
            await trio.sleep(gap)
            gap = min(gap * 2, longest)
    return None


async def until_stored(stored: Callable[[], Awaitable[bool]], wait: float = STORED_WAIT) -> bool:
    """:func:`until_found` for a yes-or-no look (``stored``): False when not within
    ``wait``."""

    async def look() -> bool | None:
        return True if await stored() else None

    return await until_found(look, wait) is not None
