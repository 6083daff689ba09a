"""In-process event stream: step, task, chunk and state-activity events.

Publishing never blocks and never fails: each subscriber has a bounded buffer, and an
event that does not fit is dropped for that subscriber only (counted in ``dropped``).
Events are observations, not the source of truth: the store is. The one exception to
"best effort" is the guarantee that the worker *publishes* exactly one :class:`TaskEvent`
per Turn; a slow subscriber can still miss it (and can reread the deliverable card).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import trio

from agentserver.observability.metrics import AgentCounters


@dataclass(frozen=True, slots=True)
class StepEvent:
    agent_id: str
    agent_turn_id: str
    step_id: str
    phase: str  # started | planning | executing | completed | retrying
    #: ``retrying`` only: which retry this is, the error kind and the wait before it.
    #: The step's chunks published so far belong to the failed attempt.
    attempt: int = 0
    kind: str = ""
    delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TaskEvent:
    """The one terminal event of a Turn; content is reread via ``deliverable_card_id``."""

    agent_id: str
    agent_turn_id: str
    status: str  # succeeded | failed | stopped | timed_out
    output_box_id: str
    deliverable_card_id: str


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    agent_id: str
    agent_turn_id: str
    step_id: str
    text: str


@dataclass(frozen=True, slots=True)
class StateEvent:
    agent_id: str
    agent_turn_id: str | None
    status: str
    activity: str = ""  # thinking | executing_tool | awaiting_tool_result
    current_tool: str = ""
    waiting_tool_count: int = 0


@dataclass(frozen=True, slots=True)
class NoticeEvent:
    """A typed event of any other feature, named by its dotted ``event_type``
    (``approval.requested``, ``webhook.disabled``, ``budget.soft``, ``schedule.failed``,
    ...): what webhooks deliver by that name (docs/webhooks.md), with ``data`` (JSON
    values) as the payload's data. Any event object with a string ``event_type``
    attribute is taken the same way; this class is the ready-made one."""

    event_type: str
    agent_id: str = ""
    agent_turn_id: str | None = None
    data: dict[str, object] = field(default_factory=dict)
    #: Events with the same key are the same event (one delivery per webhook); empty:
    #: every event is new.
    dedupe_key: str = ""


@dataclass(frozen=True, slots=True)
class BudgetEvent:
    """A budget crossed its ``soft`` mark (once per period; docs/budgets.md). ``agent_id``
    and ``agent_turn_id``: the call that crossed it (for the bus's filters); ``kind`` is
    ``budget.soft``."""

    agent_id: str
    agent_turn_id: str | None
    budget: str
    period: str
    period_start: float
    spent_tokens: int
    spent_cost: float
    limit_tokens: int | None
    limit_cost: float | None
    kind: str = "budget.soft"

    @property
    def event_type(self) -> str:
        """The webhook event type (agents/edge/webhooks.py delivers it by this name)."""
        return self.kind

    @property
    def dedupe_key(self) -> str:
        """One crossing per budget and period: a webhook delivers it once."""
        return f"{self.kind}:{self.budget}:{self.period_start}"


Event: TypeAlias = StepEvent | TaskEvent | ChunkEvent | StateEvent | NoticeEvent | BudgetEvent
#: An event's outbox rows now (the store's ``OutboxItem``, a floor above this one: hence
#: ``Any``). Pure: it may run in the store's transaction, off trio.
OutboxRender: TypeAlias = Callable[[Event], Sequence[Any]]


def _no_rows(event: Event) -> Sequence[Any]:
    return ()


class Subscription:
    """A bounded view of the stream. Use as ``async with bus.subscribe() as sub``."""

    def __init__(self, bus: EventBus, capacity: int) -> None:
        self._bus = bus
        self._send, self._recv = trio.open_memory_channel[Event](capacity)
        self.dropped = 0

    def offer(self, event: Event) -> None:
        """Buffer ``event`` if there is room, else count it dropped. Never blocks."""
        try:
            self._send.send_nowait(event)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self.dropped += 1

    async def receive(self) -> Event:
        """Wait (cancellably) for the next event."""
        return await self._recv.receive()

    def drain(self) -> list[Event]:
        """Every buffered event, without waiting."""
        out: list[Event] = []
        while True:
            try:
                out.append(self._recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return out

    def close(self) -> None:
        self._bus.unsubscribe(self)
        self._send.close()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._recv.__aiter__()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class EventBus:
    """Fan-out of events to a bounded number of bounded subscribers."""

    def __init__(self, max_subscribers: int = 64) -> None:
        self._subscribers: set[Subscription] = set()
        self._observers: list[Callable[[Event], None]] = []
        #: The observers that make events durable (the webhooks' outbox writer), each
        #: with its render factory (:meth:`outbox_render`).
        self._durable: list[tuple[Callable[[Event], None], Callable[[], OutboxRender]]] = []
        self.max_subscribers = max_subscribers

    def observe(self, callback: Callable[[Event], None]) -> None:
        """Call ``callback`` with every event, synchronously (e.g. to count them for the
        metrics). It must be quick and must not raise."""
        self._observers.append(callback)

    def observe_durably(
        self, callback: Callable[[Event], None], render: Callable[[], OutboxRender]
    ) -> None:
        """:meth:`observe` for an observer that writes events to the store's outbox (the
        webhooks): ``render()`` snapshots what it wants into a pure function of an event
        to its outbox rows, which a publisher whose store transaction causes the event
        writes in that transaction (:meth:`outbox_render`), publishing it afterwards with
        ``written=True``: this observer then skips it (written already, and durable from
        the same commit as its cause, so a crash between the two loses nothing)."""
        self._durable.append((callback, render))

    def outbox_render(self) -> OutboxRender:
        """The outbox rows of an event, as the durable observers would write them (none
        while there is none: a server without webhooks writes nothing more). Take it on
        trio's side, call it anywhere."""
        if not self._durable:
            return _no_rows
        renders = [render() for _, render in self._durable]
        if len(renders) == 1:
            return renders[0]
        return lambda event: [row for r in renders for row in r(event)]

    def subscribe(self, capacity: int = 1024) -> Subscription:
        """Open a subscription buffering up to ``capacity`` events (must be finite)."""
        if capacity <= 0 or math.isinf(capacity):
            raise ValueError("subscriber buffers are bounded")
        if len(self._subscribers) >= self.max_subscribers:
            raise RuntimeError("too many event subscribers")
        sub = Subscription(self, capacity)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop offering events to ``sub`` (its ``close``). Idempotent."""
        self._subscribers.discard(sub)

    def publish(self, event: Event, *, written: bool = False) -> None:
        """Offer ``event`` to every subscriber; never blocks. ``written``: its outbox rows
        (:meth:`outbox_render`) were committed with its cause; the durable observers skip
        it."""
        if not written:
            for durable, _ in self._durable:
                durable(event)
        for callback in self._observers:
            callback(event)
        for sub in tuple(self._subscribers):
            sub.offer(event)


def counting(counters: AgentCounters) -> Callable[[Event], None]:
    """An observer for :meth:`EventBus.observe` that counts the events in ``counters``
    (quick, never raises: what the bus asks of an observer)."""

    def observe(event: Event) -> None:
        if isinstance(event, StepEvent):
            if event.phase == "started":
                counters.step_started(event.agent_id)
            elif event.phase == "retrying":
                counters.step_retrying(event.agent_id, event.kind)
        elif isinstance(event, TaskEvent):
            counters.turn_ended(event.agent_id, event.status)
        elif isinstance(event, StateEvent) and event.status == "running":
            counters.turn_started(event.agent_id)

    return observe
