"""The pump's per-listener state (ListenerRuntime), its workers' bookkeeping (Slot) and
its lifecycle states (PumpState). Plain data: the Pump reads and writes it directly (these
are the hot path's attribute lookups)."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Coroutine
from typing import Any, TypeAlias, cast

import trio
from lxml import etree

from agentserver.core.handler_types import unreadable
from agentserver.core.listener import HandlerMetadata, HandlerResult, Listener
from agentserver.observability.metrics import LatencyHistogram
from agentserver.primitives.core import CORE_MODELS
from agentserver.pump.delivery import Delivery, Waiters

#: A ``sync=True`` listener's handler: a plain function of the raw element (see Listener).
SyncHandler: TypeAlias = Callable[[etree._Element, HandlerMetadata], HandlerResult]


def _not_sync(payload: etree._Element, meta: HandlerMetadata) -> HandlerResult:
    """The ``sync`` of a listener that has no synchronous handler: never called (the
    roster puts only ``sync=True`` listeners on the fast path)."""
    raise RuntimeError(f"{meta.own_name} has no synchronous handler")


class PumpState(enum.Enum):
    """A pump's life: registering listeners, running, draining after close(), closed."""

    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


class Slot:
    """A worker's bookkeeping, read by the deadline monitor."""

    __slots__ = ("current", "deadline", "delivery", "expired", "listener", "scope")

    def __init__(self, listener: str) -> None:
        #: The listener and the delivery being (or last) handled: log records of this
        #: worker's task name them (``observability.logs.add_chain``).
        self.listener = listener
        self.delivery: Delivery | None = None
        self.current: Delivery | None = None
        self.deadline = math.inf
        self.expired: Delivery | None = None
        self.scope = trio.CancelScope()


class ListenerRuntime:
    """One registered listener inside a running pump: its bounded queue (``send`` /
    ``receive``, ``queue_size`` deliveries) and the senders waiting for room in it, its
    workers' slots, the handler as workers and the fast path call it, and its counters."""

    __slots__ = (
        "call",
        "chain",
        "handled",
        "latency",
        "listener",
        "receive",
        "send",
        "skip",
        "slots",
        "sync",
        "unreadable",
        "usage",
        "waiters",
        "weight",
    )

    def __init__(self, listener: Listener, usage: str) -> None:
        self.listener = listener
        self.usage = usage
        #: The handler as workers call it (``await call(payload, meta)``).
        self.call = awaitable(listener.handler) if listener.sync else listener.handler
        #: The synchronous handler of the fast path (see Pump._inject_sync); for a listener
        #: that is not ``sync``, one that raises. Listener.handler's type names the
        #: coroutine function every other handler is: a ``sync=True`` one is a plain
        #: function (Listener checks it), which the type cannot say.
        self.sync: SyncHandler = cast(SyncHandler, listener.handler) if listener.sync else _not_sync
        #: Fast-path calls not to time, and the weight of the next timing (as in _serve).
        self.skip, self.weight = 0, 1
        #: The tail of the chain of a hop to this listener.
        self.chain = (listener.name,)
        #: Primitives the handler's annotation does not admit (see handler_types).
        self.unreadable = unreadable(listener.handler, CORE_MODELS, raw=listener.raw)
        self.send, self.receive = trio.open_memory_channel[Delivery](listener.queue_size)
        self.waiters = Waiters()
        self.handled = 0
        self.latency = LatencyHistogram()
        self.slots: list[Slot] = []


def awaitable(handler: Callable[..., Any]) -> Callable[..., Coroutine[Any, Any, Any]]:
    """A sync handler as workers call every handler."""

    async def call(payload: object, meta: HandlerMetadata) -> object:
        return handler(payload, meta)

    return call
