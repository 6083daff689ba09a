"""A pump's life under trio: start, the background tasks, drain and shutdown.

:meth:`Lifecycle.run` opens the root thread, starts every listener's workers, the idle
thread expirer and the deadline monitor, and waits for :meth:`Lifecycle.close`; then it
drains (queued work may finish for up to ``drain_timeout`` seconds), cancels what is left
and refuses, synchronously, every delivery still queued, so no external caller's request
is lost silently. Cancelled from outside, it skips the drain and refuses the same way.

The per-message work (a worker's loop, ``Pump.serve``) stays in the pump; this module runs
once per pump, per worker start or timeout and per monitor tick, and reaches the pump
only through :class:`Engine`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Protocol

import trio

from agentserver.core.errors import DeliveryRefused, Refusal, SystemErrorCode
from agentserver.core.threads import ThreadRecord, ThreadRegistry
from agentserver.observability.logs import current_slot
from agentserver.pump.config import PumpConfig
from agentserver.pump.delivery import SYSTEM, Delivery
from agentserver.pump.roster import Roster
from agentserver.pump.runtime import ListenerRuntime, PumpState, Slot

log = logging.getLogger("agentserver.pump")


class Engine(Protocol):
    """What the lifecycle drives: the Pump (declared here so that this module does not
    import the pump, which imports it). The pump's hot path reads ``state`` and ``now`` as
    its own attributes (no lookup through another object per message), so the lifecycle
    sets them there."""

    config: PumpConfig
    threads: ThreadRegistry
    counters: dict[str, int]
    state: PumpState
    #: trio's clock as of the deadline monitor's last tick.
    now: float
    root_thread: ThreadRecord | None

    async def serve(self, rt: ListenerRuntime, slot: Slot) -> None:
        """Take deliveries off ``rt``'s queue until it ends (see ``Pump.serve``)."""
        ...

    async def fail(self, thread: ThreadRecord, refusal: Refusal, d: Delivery | None) -> None:
        """The owner of ``thread`` failed: its caller gets one primitive (``Pump.fail``)."""
        ...

    async def drained(self) -> None:
        """Return once nothing is queued or being handled."""
        ...

    def refuse_queued(self, d: Delivery, refusal: Refusal) -> None:
        """``d`` was taken off a queue unhandled at shutdown: tell its caller now."""
        ...


class Lifecycle:
    """Runs one pump (``engine``) with the listeners and endpoints of ``roster``."""

    def __init__(self, engine: Engine, roster: Roster) -> None:
        self.engine = engine
        self.roster = roster
        self._close_requested = trio.Event()

    async def run(self, started: Callable[[], None]) -> None:
        """Run the frozen roster until :meth:`close` (then drain) or until cancelled (then
        refuse what is left). ``started()`` is called once every worker is up and the root
        thread exists. On return (or any exit) the pump is closed: senders still waiting
        for room are refused, queued deliveries refused, endpoints closed."""
        engine = self.engine
        runtimes = self.roster.runtimes
        now = engine.now = trio.current_time()
        engine.root_thread = engine.threads.open_root((SYSTEM, engine.config.organism), now)
        engine.threads.pin(engine.root_thread)
        try:
            async with trio.open_nursery() as nursery:
                for rt in runtimes.values():
                    for _ in range(rt.listener.concurrency):
                        nursery.start_soon(self._worker, rt)
                nursery.start_soon(self._expirer)
                nursery.start_soon(self._deadline_monitor)
                engine.state = PumpState.RUNNING
                started()
                await self._close_requested.wait()
                engine.state = PumpState.DRAINING
                with trio.move_on_after(engine.config.drain_timeout):
                    await engine.drained()
                nursery.cancel_scope.cancel()
        finally:
            engine.state = PumpState.CLOSED
            # Senders still waiting for room (from outside the pump) are refused now: the
            # monitor that would time them out has stopped.
            for rt in runtimes.values():
                rt.waiters.expire(math.inf)
            self._refuse_leftovers()
            for endpoint in list(self.roster.endpoints.values()):
                endpoint.close()

    def close(self) -> None:
        """Begin a graceful shutdown. Idempotent; :meth:`run` returns once drained."""
        self._close_requested.set()

    async def _worker(self, rt: ListenerRuntime) -> None:
        """One concurrency slot of a listener. A handler that overruns its timeout is
        cancelled by :meth:`_deadline_monitor` through this slot's cancel scope; the slot
        then answers the caller with a timeout and starts over in a fresh scope. (A cancel
        scope per call would cost more than the rest of a delivery.)"""
        engine = self.engine
        slot = Slot(rt.listener.name)
        current_slot.set(slot)  # this task's log records name the delivery it handles
        while True:
            with trio.CancelScope() as scope:
                slot.scope = scope
                rt.slots.append(slot)
                try:
                    await engine.serve(rt, slot)
                finally:
                    rt.slots.remove(slot)
                return
            expired, slot.expired = slot.expired, None
            if expired is not None:
                engine.counters["timeouts"] += 1
                log.warning(
                    "%s: handler timed out after %ss on %s",
                    rt.listener.name,
                    rt.listener.timeout,
                    expired.thread.dotted,
                )
                await engine.fail(
                    expired.thread,
                    DeliveryRefused(SystemErrorCode.TIMEOUT, retry_allowed=True),
                    expired,
                )

    async def _deadline_monitor(self) -> None:
        """Keep the pump's coarse clock and cancel handlers that overrun their timeout.

        Every ``tick`` it records the time (hot paths stamp threads with it instead of
        reading the clock per message) and looks at each busy slot: a call seen for the
        first time gets its deadline, ``now + timeout``; a call past its deadline is
        cancelled. So a handler is cancelled after at least ``timeout`` and at most
        ``timeout + 2 * tick`` seconds, never early. Senders waiting for room past their
        deadline are refused on the same tick.
        """
        engine = self.engine
        runtimes = list(self.roster.runtimes.values())
        timeouts = [rt.listener.timeout for rt in runtimes]
        tick = min(max(min(timeouts, default=1.0) / 10, 0.005), 1.0)
        tick = min(tick, max(engine.config.delivery_timeout / 10, 0.005))
        while True:
            await trio.sleep(tick)
            now = engine.now = trio.current_time()
            for rt in runtimes:
                if rt.waiters:
                    rt.waiters.expire(now)
                timeout = rt.listener.timeout
                for slot in rt.slots:
                    if slot.current is None:
                        continue
                    if slot.deadline == math.inf:
                        slot.deadline = now + timeout
                    elif slot.deadline <= now:
                        slot.expired = slot.current
                        slot.current = None
                        slot.scope.cancel()

    async def _expirer(self) -> None:
        """Drop idle threads every ``expire_interval`` seconds."""
        engine = self.engine
        while True:
            await trio.sleep(engine.config.expire_interval)
            removed = engine.threads.expire(trio.current_time())
            if removed:
                log.debug("expired %d idle threads", len(removed))

    def _refuse_leftovers(self) -> None:
        """After cancellation: refuse every delivery still queued, so none is lost silently."""
        refusal = DeliveryRefused(SystemErrorCode.TIMEOUT, retry_allowed=True, detail="shutdown")
        for rt in self.roster.runtimes.values():
            while True:
                try:
                    d = rt.receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                self.engine.refuse_queued(d, refusal)
