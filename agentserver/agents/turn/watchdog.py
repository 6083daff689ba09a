"""The watchdog: the safety net that makes every accepted Turn end.

Each :meth:`Watchdog.tick` (every ``settings.watchdog_interval_s``):

* requeues inbox rows stuck in ``processing`` longer than ``processing_timeout_s``;
* for each suspended Turn past its ``resume_deadline``, injects one ``timeout`` report per
  tool still waiting (once: the deadline is cleared in the same transaction); the worker
  applies them like results and resumes the Turn; a result arriving later is acknowledged
  and changes nothing;
* ends with a ``timed_out`` deliverable every Turn ``dispatched`` longer than
  ``dispatch_timeout_s`` (measured from ``dispatched_at``) and every Turn ``running``
  longer than ``max_running_s`` (measured from ``running_since``); the epoch moves on, so
  a worker still holding such a Turn can no longer write anything;
* rings the doorbell when due rows exist, and resends replies still pending after a crash
  or a failed send.
"""

from __future__ import annotations

import logging

import trio

from agentserver.agents.errors import StaleTurn
from agentserver.agents.governance.budgets import Budgets
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import TaskStatus, WatchdogStore
from agentserver.agents.store.sql import inbox, replies, tools, watchdog
from agentserver.agents.store.states import HeadStatus
from agentserver.agents.turn.delivery import TurnEnder

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(
        self, *, ender: TurnEnder, settings: StoreSettings, budgets: Budgets | None = None
    ) -> None:
        self.store: WatchdogStore = ender.store
        #: Spend budgets: a dead process's holds are released here (None: none declared).
        self.budgets = budgets
        self.ender = ender
        self.doorbell = ender.doorbell
        self.settings = settings

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick forever (cancellable); an error in one tick is logged, not fatal."""
        task_status.started()
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("watchdog tick failed")
            await trio.sleep(self.settings.watchdog_interval_s)

    async def tick(self) -> dict[str, int]:
        """One pass; returns counts of what it did (for tests and logs)."""
        s = self.settings
        done = {"requeued": 0, "timeouts": 0, "ended": 0, "replies": 0}
        done["requeued"] = await self.store.run1(inbox.requeue_stuck, s.processing_timeout_s)
        for token in await self.store.read(watchdog.expired_suspensions):
            try:
                done["timeouts"] += await self.store.run(tools.inject_timeouts, token)
            except StaleTurn:
                continue
        for head in await self.store.read(watchdog.stale_dispatched, s.dispatch_timeout_s):
            text = f"the task was dispatched but never started within {s.dispatch_timeout_s:g} s"
            done["ended"] += await self._end(
                head.agent_id, head.agent_turn_id, head.turn_epoch, HeadStatus.DISPATCHED, text
            )
        for head in await self.store.read(watchdog.overdue_running, s.max_running_s):
            text = f"the task ran longer than {s.max_running_s:g} s and was ended"
            done["ended"] += await self._end(
                head.agent_id, head.agent_turn_id, head.turn_epoch, HeadStatus.RUNNING, text
            )
        for reply in await self.store.read(
            replies.pending_replies, 64, older_than_s=s.processing_timeout_s
        ):
            done["replies"] += await self.ender.resend(reply)
        if self.budgets is not None:
            done["holds"] = await self.budgets.release_expired()
            if done["holds"]:
                log.warning("budget holds of dead calls released: %d", done["holds"])
        if done["requeued"] or done["timeouts"] or bool(await self.store.read(inbox.due_agents, 1)):
            self.doorbell.ring()
        return done

    async def _end(
        self, agent_id: str, turn_id: str | None, epoch: int, expect: str, text: str
    ) -> int:
        ended = await self.ender.force_end(
            agent_id,
            TaskStatus.TIMED_OUT,
            text,
            agent_turn_id=turn_id,
            turn_epoch=epoch,
            expect_status=[expect],
        )
        if ended is not None:
            log.warning("agent %s: turn %s ended by the watchdog: %s", agent_id, turn_id, text)
        return int(ended is not None)
