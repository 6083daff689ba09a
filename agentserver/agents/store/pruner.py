"""The pruner (issue 38): applies ``<retention>`` to the store in the background.

Every ``interval`` it takes the prune lease (``prune_lease``: with several processes on
one PostgreSQL database one prunes at a time; a dead one's lease expires after
``prune.LEASE_S``), then, agent by agent, removes finished tasks, orphaned boxes, old
schedule run records, refused A2A tasks and old edges, then delivered replies, old
tombstones (with their A2A task records), idle step log rows and done webhook
deliveries (with their sequence counters), each in batches of at most
:data:`TASK_BATCH` tasks or :data:`ROW_BATCH` rows, one short transaction per batch
(fenced on the lease, looking at no more than ``prune.SCAN_WINDOW`` rows by primary key:
a pass resumes each batch where the last ended), with a pause between batches so a
Turn's transactions come first. On SQLite it then gives the freed pages back to the file,
:data:`VACUUM_PAGES` at a time (a file made before retention was on keeps its pages
until ``agentserver store prune`` converts it, docs/operations.md), and checkpoints the
WAL inline, so the log starts over after each run (``checkpoint_after_prune``).

What it never removes is listed in ``agents/store/sql/prune.py``. A cancel lands between
batches (or aborts the batch in flight, which rolls back whole); the next run redoes it.
Started by the agent service only when retention is configured: without it, no task,
no statement.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from agentserver.agents.errors import StoreError
from agentserver.agents.profile.retention import RetentionSettings
from agentserver.agents.store.base import StoreCalls
from agentserver.agents.store.sql import prune, prune_records, stats, tombstones
from agentserver.agents.store.sql.prune import LEASE_S, Pruned

log = logging.getLogger(__name__)

#: Finished tasks per transaction (each is about ten indexed deletes).
TASK_BATCH = 16
#: Rows per transaction of the row-wise passes (edges, replies, step log, boxes).
ROW_BATCH = 500
#: Pages (4 KiB) given back per ``incremental_vacuum`` (a few milliseconds each).
VACUUM_PAGES = 128
#: The pause between two batches: the store's other transactions go first.
PAUSE_S = 0.002


class PruneStore(StoreCalls, Protocol):
    """What the pruner needs of the store (:class:`~agentserver.agents.store.sql_store.SqlAgentStore`):
    its calls, and the backend's page and WAL hooks."""

    async def reclaim_pages(self, max_pages: int) -> int: ...
    async def checkpoint_after_prune(self) -> None: ...


@dataclass(slots=True)
class PruneReport:
    """What one run removed (or, dry, would remove: the same figures, the dry run being
    the prune rolled back): tasks, and rows by kind (``task_rows``: every row a task and
    its Turn had)."""

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
        lease_s: float = LEASE_S,
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
        #: Tasks removed by every run so far.
        self.tasks_pruned = 0

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
        takes no lease and deletes nothing: it runs the pass in one transaction of the
        store, rolled back (``prune.rehearse``), so it counts exactly what a prune run
        now removes (it holds the store's write lock meanwhile)."""
        report = PruneReport()
        owner: str | None = None
        if not dry_run:
            if not await self.store.run(prune.take_lease, self.owner, self.lease_s):
                report.skipped = True
                return report
            owner = self.owner
        try:
            await self._pass(report, owner, dry_run, progress)
        finally:
            if owner is not None:
                with trio.CancelScope(shield=True):
                    await self.store.run(prune.release_lease, owner)
        self.runs += 1
        self.last = report
        if not dry_run:
            self.tasks_pruned += report.tasks
        return report

    async def _batches(
        self,
        report: PruneReport,
        kind: str,
        call: Callable[[int, int], Awaitable[Pruned]],
        limit: int,
        progress: Callable[[PruneReport], None] | None,
    ) -> None:
        """Run ``call(limit, after)`` batch after batch, each starting where the last
        ended, until one says the pass is done."""
        after = 0
        while True:
            got = await call(limit, after)
            report.add(kind, got)
            if progress is not None:
                progress(report)
            if got.done:
                return
            after = got.after
            await trio.sleep(self.pause_s)

    def _passes(
        self,
        agents: Sequence[str],
        scheduled: Collection[str] = (),
        refused: Collection[str] = (),
    ) -> list[_Pass]:
        """Every pass of one run, in order: agent by agent what ``finished-tasks`` and
        ``events`` bound (a Turn's rows first, so the records that wait for their task to
        go find it gone), then the store's own windows."""
        out: list[_Pass] = []
        for a in agents:
            r = self.settings.for_agent(a)
            if (age := r.finished_tasks_s) is not None:
                out += [
                    ("task_rows", prune.prune_tasks, (a, age, r.keep_last), TASK_BATCH, True),
                    ("boxes", prune.prune_orphan_boxes, (a, age), ROW_BATCH, False),
                ]
                if a in scheduled:
                    out.append(
                        (
                            "schedule_runs",
                            prune_records.prune_schedule_runs,
                            (a, age),
                            ROW_BATCH,
                            False,
                        )
                    )
                if a in refused:
                    out.append(
                        (
                            "a2a_tasks",
                            prune_records.prune_refused_a2a_tasks,
                            (a, age),
                            ROW_BATCH,
                            False,
                        )
                    )
            if (events := r.events_s) is not None:
                out.append(("execution_edges", prune.prune_events, (a, events), ROW_BATCH, True))
        g = self.settings
        if (replies := g.acknowledged_replies_s) is not None:
            out.append(("agent_replies", prune.prune_replies, (replies,), ROW_BATCH, False))
        if (stones := g.tombstones_s) is not None:
            out.append(("pruned_turns", tombstones.prune_tombstones, (stones,), ROW_BATCH, False))
        if (steps := g.step_log_s) is not None:
            out.append(("step_log", prune.prune_step_log, (steps,), ROW_BATCH, True))
        if (deliveries := g.deliveries_s) is not None:
            out.append(("outbox", prune_records.prune_deliveries, (deliveries,), ROW_BATCH, True))
        return out

    async def _pass(
        self,
        report: PruneReport,
        owner: str | None,
        dry_run: bool,
        progress: Callable[[PruneReport], None] | None,
    ) -> None:
        agents = sorted(set(self.agents) | set(await self.store.read(stats.agent_ids)))
        scheduled, refused = await self.store.read(stats.record_agents)
        passes = self._passes(agents, scheduled, refused)
        if dry_run:
            # The prune itself in one transaction, rolled back: exactly what it removes.
            rehearsal = [(kind, fn, args, paged) for kind, fn, args, _, paged in passes]
            try:
                await self.store.run(prune.rehearse, rehearsal)
            except prune.Rehearsed as done:
                results = done.results
            else:
                raise StoreError("a prune rehearsal ended without rolling back")
            for kind, got in results:
                report.add(kind, got)
            if progress is not None:
                progress(report)
            return
        for kind, fn, args, batch, paged in passes:
            call = (
                _paged(self.store, fn, owner, args)
                if paged
                else _unpaged(self.store, fn, owner, args)
            )
            await self._batches(report, kind, call, batch, progress)
        while (freed := await self.store.reclaim_pages(VACUUM_PAGES)) > 0:
            report.pages += freed
            if progress is not None:
                progress(report)
            await trio.sleep(self.pause_s)
        # The run's deletions (and the Turns' writes meanwhile) copied back, so the WAL
        # starts over at the next commit instead of growing on (issue 43).
        await self.store.checkpoint_after_prune()


#: A pass's batch function (agents/store/sql/prune.py, prune_records.py, tombstones.py):
#: ``fn(tx, env, owner, *args, limit, dry_run[, after])``.
_Batch = Callable[..., Pruned]
#: One pass: (the report's kind, its batch function, its arguments between the owner and
#: the limit, the batch size, whether a batch resumes after the last one's key).
_Pass = tuple[str, _Batch, tuple[Any, ...], int, bool]


def _paged(
    store: StoreCalls, fn: _Batch, owner: str | None, args: tuple[Any, ...]
) -> Callable[[int, int], Awaitable[Pruned]]:
    """A batch call of a pass that resumes where the last batch ended (``after``)."""
    return lambda limit, after: store.run(fn, owner, *args, limit, False, after)


def _unpaged(
    store: StoreCalls, fn: _Batch, owner: str | None, args: tuple[Any, ...]
) -> Callable[[int, int], Awaitable[Pruned]]:
    """A batch call of a pass that finds its rows afresh each batch."""
    return lambda limit, _after: store.run(fn, owner, *args, limit, False)
