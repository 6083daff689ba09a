"""Runs on a schedule (docs/runs.md): the loop that fires the store's schedules.

Every process runs one; the store decides which of them fires a tick (one compare-and-set,
agents/store/sql/schedules.py), so each tick fires exactly once across processes, and the
claim and the run's task commit together, so across a crash too. The loop sleeps until
the earliest due tick (its jitter added) or ``poll_s``, whichever comes first, or until
:meth:`Scheduler.wake` (a schedule made, resumed or triggered here). A server with no
schedule pays one small read every :data:`IDLE_POLL_S`, nothing per Turn.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final

import trio

from agentserver.agents.clock import Clock
from agentserver.agents.doorbell import Doorbell
from agentserver.agents.errors import StaleTurn, StoreError
from agentserver.agents.ports import ReplyRef
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.schedule import ScheduleInvalid, ScheduleSpec, missed
from agentserver.agents.store.base import AgentStore, Finished, Fired, ScheduleRow
from agentserver.agents.store.sql import schedules
from agentserver.agents.turn.answer import answer_bytes
from agentserver.agents.turn.memory import CLIENT

log = logging.getLogger(__name__)

#: The source of a schedule made at run time (``api:NAME`` when a declared client made it).
API_SOURCE = "api"

#: The longest the loop sleeps without reading the schedules (others may make some).
POLL_S = 1.0
#: The same while the store has no schedule at all (one made here wakes the loop).
IDLE_POLL_S = 5.0
#: The reply reference's key naming the schedule a run belongs to (its "client").
SCHEDULE_KEY: Final = "schedule"
CANCELLED_TEXT = "cancelled: the schedule's next run started (overlap cancel-other)"


def run_ref(name: str, agent: str, tick: float) -> ReplyRef:
    """A run's reply reference: a caller named ``schedule:NAME`` with a thread of its own
    (the run's tool calls go through the pump on it; its answer goes nowhere but the
    store, and to whoever watches the agent's events)."""
    return ReplyRef(
        hop=str(uuid.uuid4()),
        caller_thread=str(uuid.uuid4()),
        chain=[f"schedule:{name}", agent],
        schedule=name,
        tick=tick,
    )


class Scheduler:
    """Fires schedules (boot.xml's, synchronised into the store at start, and those made
    at run time) until cancelled. ``ended``: what to do with a run cancel-other ended
    (the runtime cancels its run here and publishes its end)."""

    def __init__(
        self,
        store: AgentStore,
        profiles: Mapping[str, AgentProfile],
        clock: Clock,
        doorbell: Doorbell,
        ended: Callable[[Finished], Awaitable[None]],
        *,
        declared: Sequence[ScheduleSpec] = (),
        poll_s: float = POLL_S,
    ) -> None:
        self.store = store
        self.profiles = profiles
        self.clock = clock
        self.doorbell = doorbell
        self.ended = ended
        self.declared = tuple(declared)
        self.poll_s = poll_s
        self._wake = trio.Event()
        #: Outcomes of the ticks this process fired, for tests and the bench: (name,
        #: tick, outcome, the clock when it committed).
        self.fired: list[tuple[str, float, str, float]] = []

    def wake(self) -> None:
        """Read the schedules again now (one was made, resumed or triggered)."""
        self._wake.set()

    async def sync_declared(self) -> None:
        """boot.xml's schedules into the store: new ones from the next tick, changed ones
        from the next tick after now, unchanged ones keep their state (a tick missed while
        down is due now); those no longer declared are deleted."""
        now = self.clock.now()
        for spec in self.declared:
            await self.store.run(
                schedules.put_schedule, spec, "boot", spec.next_tick(now), new=False
            )
        await self.store.run(schedules.drop_boot_schedules, [s.name for s in self.declared])

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.sync_declared()
        task_status.started()
        while True:
            try:
                until = await self.fire_due()
            except StaleTurn:
                # cancel-other raced another end of the run it cancels: rolled back, the
                # tick is still due; look again at once.
                until = self.clock.now()
            except StoreError as exc:
                log.warning("schedules: %s", exc)
                until = self.clock.now() + self.poll_s
            delay = until - self.clock.now()
            if delay > 0:
                with trio.move_on_after(delay):
                    await self._wake.wait()
            self._wake = trio.Event()

    async def fire_due(self) -> float:
        """Fire (or count skipped) every tick due now; returns when to look again. Each
        tick is one store transaction; a tick another process claimed is left alone."""
        now = self.clock.now()
        rows = await self.store.read(schedules.list_schedules)
        until = now + (self.poll_s if rows else max(self.poll_s, IDLE_POLL_S))
        for row in rows:
            if row.paused or row.next_tick is None or row.spec.agent not in self.profiles:
                continue
            spec, tick = row.spec, row.next_tick
            due_at = tick + spec.offset(tick)
            if due_at > now:
                until = min(until, due_at)
                continue
            until = now  # more may be due: look again at once
            if now - tick > spec.catchup_window_s:
                count, after = missed(spec, tick, now - spec.catchup_window_s)
                if await self.store.run(schedules.skip_missed, spec.name, tick, after, count):
                    log.warning("schedule %s: %d tick(s) missed, skipped", spec.name, count)
                continue
            await self.fire(row, tick, spec.next_tick(tick))
        return until

    async def fire(self, row: ScheduleRow, tick: float, next_tick: float | None) -> Fired | None:
        """Claim ``tick`` (None ``next_tick``: a manual trigger, now) and start its run."""
        spec = row.spec
        profile = self.profiles[spec.agent]
        fired = await self.store.run(
            schedules.fire,
            spec.name,
            tick,
            next_tick,
            run_ref(spec.name, spec.agent, tick),
            f"schedule:{spec.name}" if profile.memory == CLIENT else None,
            answer_bytes(profile, CANCELLED_TEXT, failed=True),
        )
        if fired is None:
            return None
        self.fired.append((spec.name, fired.tick, fired.outcome, self.clock.now()))
        if fired.ended is not None:
            await self.ended(fired.ended)
        if fired.inbox_id is not None:
            self.doorbell.ring()
        log.info("schedule %s: tick %.0f %s", spec.name, fired.tick, fired.outcome)
        return fired

    async def trigger(self, name: str) -> Fired | None:
        """Start a run of ``name`` now (its overlap applies), outside its ticks."""
        row = await self.store.read(schedules.get_schedule, name)
        if row.spec.agent not in self.profiles:
            raise StoreError(f"schedule {name!r}: agent {row.spec.agent!r} is not served here")
        return await self.fire(row, self.clock.now(), None)

    async def add(self, spec: ScheduleSpec, owner: str | None = None) -> ScheduleRow:
        """Make schedule ``spec`` (ScheduleExists if its name is taken, ScheduleInvalid if
        its agent is not one of these); fires from its next tick after now. ``owner``: the
        declared client that made it (kept in its source, ``api:NAME``: the
        authorization rule's owner, docs/security.md), None for an anonymous caller."""
        if spec.agent not in self.profiles:
            raise ScheduleInvalid(f"no agent {spec.agent!r}")
        source = API_SOURCE if owner is None else f"{API_SOURCE}:{owner}"
        await self.store.run(
            schedules.put_schedule, spec, source, spec.next_tick(self.clock.now()), new=True
        )
        self.wake()
        return await self.store.read(schedules.get_schedule, spec.name)

    async def pause(self, name: str, paused: bool) -> ScheduleRow:
        row = await self.store.read(schedules.get_schedule, name)
        nxt = None if paused else row.spec.next_tick(self.clock.now())
        out = await self.store.run(schedules.set_paused, name, paused, nxt)
        self.wake()
        return out

    async def delete(self, name: str) -> None:
        await self.store.run(schedules.delete_schedule, name)

    async def get(self, name: str) -> ScheduleRow:
        return await self.store.read(schedules.get_schedule, name)

    async def list(self) -> list[ScheduleRow]:
        return await self.store.read(schedules.list_schedules)
