"""What the pump queues for a listener (Delivery), and the senders waiting for room in a
full queue (Waiters).

Nothing here blocks except :meth:`Waiters.wait`; cancelling it leaves nothing queued.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import outcome
import trio
from lxml import etree
from opentelemetry.trace import Span

from agentserver.core.payloads import PayloadType
from agentserver.core.threads import ThreadRecord

#: The sender name of the pump's own messages (refusals, the boot primitive).
SYSTEM = "system"


@dataclass(slots=True)
class Delivery:
    payload: etree._Element
    ptype: PayloadType
    thread: ThreadRecord
    from_id: str
    is_self_call: bool
    response_thread: str | None
    #: The bytes as received from an endpoint (for ``original-attempt``), else None.
    original: bytes | None
    #: The span that sent it (tracing on only): the parent of its ``handle`` span.
    trace: Span | None = None
    #: The idempotency key its sender gave (an agent's tool call); None: the hop's id.
    key: str | None = None


class Waiter:
    __slots__ = ("deadline", "delivery", "task")

    def __init__(self, task: trio.lowlevel.Task, delivery: Delivery, deadline: float) -> None:
        self.task = task
        self.delivery = delivery
        self.deadline = deadline


class Waiters:
    """Senders waiting for room in one listener's queue, oldest first.

    trio's blocking ``send`` would need a cancel scope per wait for the delivery timeout,
    and under load a wait costs more than the delivery itself (measured). A waiter here
    parks without one:

    - a worker that takes a delivery off the full queue hands the freed slot to the oldest
      waiter at once (its delivery is queued, then it wakes): first come, first served,
      and a newcomer never overtakes a waiter (:meth:`Pump._put_nowait` checks);
    - the deadline monitor wakes waiters whose deadline has passed (deadlines grow with
      arrival order, so only the front needs looking at);
    - cancelling a waiter removes it, with nothing queued.

    Invariant: while anyone waits, the queue is full.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: collections.deque[Waiter] = collections.deque()

    def __len__(self) -> int:
        return len(self._entries)

    async def wait(self, delivery: Delivery, deadline: float) -> bool:
        """Park until handed a slot (True: ``delivery`` is queued) or until woken at or
        after ``deadline`` (False: nothing was queued)."""
        entry = Waiter(trio.lowlevel.current_task(), delivery, deadline)
        self._entries.append(entry)

        def abort(_: object) -> trio.lowlevel.Abort:
            self._entries.remove(entry)
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    def hand_over(self, send: trio.MemorySendChannel[Delivery]) -> None:
        """One slot has just been freed: queue the oldest waiter's delivery, wake it."""
        entry = self._entries.popleft()
        send.send_nowait(entry.delivery)
        trio.lowlevel.reschedule(entry.task, outcome.Value(True))

    def expire(self, now: float) -> None:
        """Wake, unserved, every waiter whose deadline is ``now`` or earlier."""
        entries = self._entries
        while entries and entries[0].deadline <= now:
            trio.lowlevel.reschedule(entries.popleft().task, outcome.Value(False))
