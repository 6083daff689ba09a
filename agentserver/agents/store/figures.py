"""Figures of the agent store for ``/metrics``: a snapshot refreshed by a task.

Prometheus collectors are synchronous and run on the trio thread, where a PostgreSQL
query must not run (it is a thread hop), so :meth:`StoreFigures.run` reads the figures
through the store every :data:`REFRESH_S` seconds (two grouped, indexed reads; one
transaction; cancellable between reads) and the collector reads the snapshot. How stale:
which agents have waiting tasks and pending approvals is as of the last refresh (at most
:data:`REFRESH_S` plus one read old); the inbox lag is computed at scrape time from the
oldest waiting task's enqueue time, so it keeps growing between refreshes. A failed
refresh drops the snapshot (the figures leave the scrape, the rest of it stays whole)
until one succeeds.
"""

from __future__ import annotations

import logging
import sqlite3

import trio

from agentserver.agents.clock import Clock
from agentserver.agents.errors import StoreError
from agentserver.agents.store.base import ViewStore
from agentserver.agents.store.sql import views
from agentserver.agents.store.sql.views import FigureRows

log = logging.getLogger(__name__)

#: Seconds between two reads of the store's figures.
REFRESH_S = 5.0


class StoreFigures:
    """The snapshot of ``store`` (its :class:`~agentserver.agents.store.base.ViewStore` role)
    that the metrics read; None until the first refresh, and after a failed one."""

    def __init__(self, store: ViewStore, clock: Clock, *, period: float = REFRESH_S) -> None:
        self.store = store
        self.clock = clock
        self.period = period
        self.snapshot: FigureRows | None = None
        #: When the snapshot was read (the store's clock).
        self.taken_at: float | None = None
        self._failing = False

    async def refresh(self) -> bool:
        """Read the figures now; False (and no snapshot) if the store could not answer."""
        try:
            rows = await self.store.read(views.figures)
        except (StoreError, sqlite3.Error) as exc:
            self.snapshot = self.taken_at = None
            if not self._failing:  # once per run of failures
                log.warning("agent store figures unavailable: %s", exc)
            self._failing = True
            return False
        self.snapshot, self.taken_at, self._failing = rows, self.clock.now(), False
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh now, then every :attr:`period` seconds, until cancelled."""
        await self.refresh()
        task_status.started()
        while True:
            await trio.sleep(self.period)
            await self.refresh()

    def inbox_lag(self) -> dict[str, float] | None:
        """Agent → age in seconds (now) of its oldest task not yet started, as of the
        snapshot (agents with none are absent); None without a snapshot."""
        snap = self.snapshot
        if snap is None:
            return None
        now = self.clock.now()
        return {agent: max(0.0, now - oldest) for agent, oldest in snap.oldest_waiting.items()}

    def approvals_pending(self) -> dict[str, int] | None:
        """Agent → approval requests waiting for a decision (agents with none absent);
        None without a snapshot."""
        snap = self.snapshot
        return None if snap is None else dict(snap.approvals_pending)
