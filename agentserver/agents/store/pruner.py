"""The pruner (issue 38): applies ``<retention>`` to the store in the background.

Every ``interval`` it takes the prune lease (``prune_lease``: with several processes on
one PostgreSQL database one prunes at a time; a dead one's lease expires after
``prune.LEASE_S``), then, agent by agent, removes finished tasks, orphaned boxes and old
edges, then delivered replies and idle step log rows, each in batches of at most
:data:`TASK_BATCH` tasks or :data:`ROW_BATCH` rows, one short transaction per batch
(fenced on the lease, looking at no more than ``prune.SCAN_WINDOW`` rows by primary key:
a pass resumes each batch where the last ended), with a pause between batches so a
Turn's transactions come first. On SQLite it then gives the freed pages back to the file,
:data:`VACUUM_PAGES` at a time (a file made before retention was on keeps its pages
until ``agentserver store prune`` converts it, docs/operations.md).

What it never removes is listed in ``agents/store/sql/prune.py``. A cancel lands between
batches (or aborts the batch in flight, which rolls back whole); the next run redoes it.
Started by the agent service only when retention is configured: without it, no task,
no statement.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import trio

from agentserver.agents.profile.retention import RetentionSettings
from agentserver.agents.store.sql.prune import Pruned

log = logging.getLogger(__name__)

#: Finished tasks per transaction (each is about ten indexed deletes).
TASK_BATCH = 16
#: Rows per transaction of the row-wise passes (edges, replies, step log, boxes).
ROW_BATCH = 500
#: Pages (4 KiB) given back per ``incremental_vacuum`` (a few milliseconds each).
VACUUM_PAGES = 128
#: The pause between two batches: the store's other transactions go first.
PAUSE_S = 0.002
#: A dry run counts up to this many of each kind in one read.
DRY_LIMIT = 1 << 31


class PruneStore(Protocol):
    """What the pruner needs of the store (:class:`~agentserver.agents.store.sql_store.SqlAgentStore`)."""

    async def take_prune_lease(self, owner: str, lease_s: float) -> bool: ...
    async def release_prune_lease(self, owner: str) -> None: ...
    async def prune_tasks(
        self,
        owner: str | None,
        agent_id: str,
        max_age_s: float,
        keep_last: int | None,
        limit: int,
        dry_run: bool = False,
        after: int = 0,
    ) -> Pruned: ...
    async def prune_orphan_boxes(
        self,
        owner: str | None,
        agent_id: str,
        max_age_s: float,
        limit: int,
        dry_run: bool = False,
    ) -> Pruned: ...
    async def prune_events(
        self,
        owner: str | None,
        agent_id: str,
        max_age_s: float,
        limit: int,
        dry_run: bool = False,
        after: int = 0,
    ) -> Pruned: ...
    async def prune_replies(
        self, owner: str | None, max_age_s: float, limit: int, dry_run: bool = False
    ) -> Pruned: ...
    async def prune_step_log(
        self,
        owner: str | None,
        max_age_s: float,
        limit: int,
        dry_run: bool = False,
        after: int = 0,
    ) -> Pruned: ...
    async def prune_tombstones(
        self, owner: str | None, max_age_s: float, limit: int, dry_run: bool = False
    ) -> Pruned: ...
    async def store_agents(self) -> list[str]: ...
    async def reclaim_pages(self, max_pages: int) -> int: ...


@dataclass(slots=True)
class PruneReport:
    """What one run removed (or, dry, would remove): tasks, and rows by kind (``task_rows``:
    every row a task and its Turn had; a dry run cannot count those, and may count an
    edge both with its Turn and by age)."""

    tasks: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    pages: int = 0
    #: Another process held the lease: this run did nothing.
    skipped: bool = False
    batches: int = 0

    def add(self, kind: str, got: Pruned) -> None:
        self.tasks += got.tasks
        self.rows[kind] = self.rows.get(kind, 0) + got.rows
        self.batches += 1

    def as_dict(self) -> dict[str, object]:
        return {
            "tasks": self.tasks,
            "rows": dict(self.rows),
            "pages_freed": self.pages,
            "skipped": self.skipped,
        }


class Pruner:
    """Runs retention over ``store`` (see the module docstring). ``agents``: the
    configured agents (the store's other agents get the global values)."""

    def __init__(
        self,
        store: PruneStore,
        settings: RetentionSettings,
        agents: Sequence[str] = (),
        *,
        owner: str | None = None,
        lease_s: float = 60.0,
        pause_s: float = PAUSE_S,
    ) -> None:
        self.store = store
        self.settings = settings
        self.agents = tuple(agents)
        self.owner = owner or f"pruner:{uuid.uuid4().hex}"
        self.lease_s = lease_s
        self.pause_s = pause_s
        #: Runs completed, and the last one's report (metrics, tests).
        self.runs = 0
        self.last: PruneReport | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Prune every ``interval`` until cancelled. A failed run is logged and retried
        at the next interval (a store error must not stop the server)."""
        task_status.started()
        while True:
            try:
                report = await self.prune_once()
                if report.tasks or any(report.rows.values()):
                    log.info("retention: pruned %s", report.as_dict())
            except Exception:
                log.exception(
                    "retention: a prune run failed (retried in %ss)", self.settings.interval_s
                )
            await trio.sleep(self.settings.interval_s)

    async def prune_once(
        self, *, dry_run: bool = False, progress: Callable[[PruneReport], None] | None = None
    ) -> PruneReport:
        """One pass over the store; ``progress`` is called after every batch. A dry run
        takes no lease and deletes nothing (it counts)."""
        report = PruneReport()
        owner: str | None = None
        if not dry_run:
            if not await self.store.take_prune_lease(self.owner, self.lease_s):
                report.skipped = True
                return report
            owner = self.owner
        try:
            await self._pass(report, owner, dry_run, progress)
        finally:
            if owner is not None:
                with trio.CancelScope(shield=True):
                    await self.store.release_prune_lease(owner)
        self.runs += 1
        self.last = report
        return report

    async def _batches(
        self,
        report: PruneReport,
        kind: str,
        call: Callable[[int, int], Awaitable[Pruned]],
        limit: int,
        dry_run: bool,
        progress: Callable[[PruneReport], None] | None,
    ) -> None:
        """Run ``call(limit, after)`` batch after batch, each starting where the last
        ended, until one says the pass is done (dry: once, counting everything)."""
        after = 0
        while True:
            got = await call(DRY_LIMIT if dry_run else limit, after)
            report.add(kind, got)
            if progress is not None:
                progress(report)
            if dry_run or got.done:
                return
            after = got.after
            await trio.sleep(self.pause_s)

    async def _pass(
        self,
        report: PruneReport,
        owner: str | None,
        dry_run: bool,
        progress: Callable[[PruneReport], None] | None,
    ) -> None:
        s = self.store
        agents = sorted(set(self.agents) | set(await s.store_agents()))
        for agent in agents:
            r = self.settings.for_agent(agent)
            if r.finished_tasks_s is not None:
                age, keep = r.finished_tasks_s, r.keep_last
                await self._batches(
                    report,
                    "task_rows",
                    lambda n, after, a=agent, age=age, keep=keep: s.prune_tasks(
                        owner, a, age, keep, n, dry_run, after
                    ),
                    TASK_BATCH,
                    dry_run,
                    progress,
                )
                await self._batches(
                    report,
                    "boxes",
                    lambda n, _after, a=agent, age=age: s.prune_orphan_boxes(
                        owner, a, age, n, dry_run
                    ),
                    ROW_BATCH,
                    dry_run,
                    progress,
                )

            if r.events_s is not None:
                ev = r.events_s
                await self._batches(
                    report,
                    "execution_edges",
                    lambda n, after, a=agent, ev=ev: s.prune_events(
                        owner, a, ev, n, dry_run, after
                    ),
                    ROW_BATCH,
                    dry_run,
                    progress,
                )
        g = self.settings
        if g.acknowledged_replies_s is not None:
            age_r = g.acknowledged_replies_s
            await self._batches(
                report,
                "agent_replies",
                lambda n, _after: s.prune_replies(owner, age_r, n, dry_run),
                ROW_BATCH,
                dry_run,
                progress,
            )
        if g.tombstones_s is not None:
            age_t = g.tombstones_s
            await self._batches(
                report,
                "pruned_turns",
                lambda n, _after: s.prune_tombstones(owner, age_t, n, dry_run),
                ROW_BATCH,
                dry_run,
                progress,
            )
        if g.step_log_s is not None:
            age_s = g.step_log_s
            await self._batches(
                report,
                "step_log",
                lambda n, after: s.prune_step_log(owner, age_s, n, dry_run, after),
                ROW_BATCH,
                dry_run,
                progress,
            )
        if not dry_run:
            while (freed := await s.reclaim_pages(VACUUM_PAGES)) > 0:
                report.pages += freed
                if progress is not None:
                    progress(report)
                await trio.sleep(self.pause_s)
