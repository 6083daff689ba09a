"""The step log of remote listeners: one row per step event (agentserver.remote.hub).

Events: ``step.dispatched`` (an attempt given to a runner; detail: the runner
connection), ``step.retried`` (a new attempt follows a timed-out or failed one),
``step.succeeded``, ``step.failed``, ``step.timed_out`` (the final outcome when no retry
follows) and ``step.cancelled`` (stopped from outside).

Where the server has an agent store (any agent declared; SQLite or PostgreSQL), rows are
durable in its ``step_log`` table (schema migration 5; ``seq`` is numbered by the
database): :class:`StoreStepLog`. The hub records from synchronous paths, where no store
write can run (on PostgreSQL a write is a thread hop), so :meth:`StoreStepLog.append`
only puts the row in a bounded buffer, and a task (:meth:`StoreStepLog.run`) writes what
it holds in batches, one store transaction per batch. A full buffer (the store has been
failing or slow for :data:`BUFFER_ROWS` rows) drops the new row, counted
(:attr:`StoreStepLog.dropped`, ``agentserver_step_log_dropped_total``) and logged: the
log is a record, and a runner's step must not wait on it. Without an agent store,
:class:`MemoryStepLog` keeps the last :data:`MEMORY_ROWS` rows in memory; they are gone
at restart.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Sequence
from typing import Any

import trio

from agentserver.agents.errors import StoreError
from agentserver.agents.store.base import ViewStore
from agentserver.agents.store.sql.db import StoreEnv, Tx
from agentserver.steps.log import StepRow, limit_rows

log = logging.getLogger(__name__)

MIGRATION = """
CREATE TABLE step_log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    step_id TEXT NOT NULL,
    listener TEXT NOT NULL,
    caller TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    event TEXT NOT NULL,
    detail TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX step_log_step ON step_log (step_id, seq);
CREATE INDEX step_log_listener ON step_log (listener, seq);
"""

#: Rows a :class:`StoreStepLog` holds before they are written (beyond: counted drops).
BUFFER_ROWS = 4096
#: The most rows one write transaction takes.
BATCH_ROWS = 256
#: How long a read waits for the rows recorded before it to be written (then it reads
#: what is there: a failing store must not hold ``GET /v1/steps``).
FLUSH_WAIT_S = 2.0
#: The pause after a failed write, doubling up to :data:`RETRY_MAX_S`.
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
_INSERT_COLS = "step_id, listener, caller, attempt, event, detail, at"
_COLS = "seq, " + _INSERT_COLS


# -- the SQL (plain functions over one transaction, both backends) ------------------------


def record_rows(tx: Tx, env: StoreEnv, rows: Sequence[StepRow]) -> None:
    """Insert ``rows`` in one statement; each gets its ``seq``, numbered by the database.

    Both engines number a multi-row ``VALUES`` in its order, so the sorted returned
    ``seq``s are the rows' in order (whatever order ``RETURNING`` lists them in)."""
    if not rows:
        return
    values = ", ".join(["(?, ?, ?, ?, ?, ?, ?)"] * len(rows))
    params = [
        v for r in rows for v in (r.step, r.listener, r.caller, r.attempt, r.event, r.detail, r.at)
    ]
    got = tx.all(f"INSERT INTO step_log ({_INSERT_COLS}) VALUES {values} RETURNING seq", params)
    if len(got) != len(rows):
        raise StoreError(f"step log: {len(rows)} rows inserted, {len(got)} numbered")
    for row, seq in zip(rows, sorted(int(g[0]) for g in got), strict=True):
        row.seq = seq


def select_rows(
    tx: Tx, env: StoreEnv, step: str | None, listener: str | None, after: int, limit: int
) -> list[StepRow]:
    where: list[str] = ["seq > ?"]
    args: list[Any] = [after]
    if step:
        where.append("step_id = ?")
        args.append(step)
    if listener:
        where.append("listener = ?")
        args.append(listener)
    got = tx.all(
        f"SELECT {_COLS} FROM step_log WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?",
        (*args, limit_rows(limit)),
    )
    return [StepRow(r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[0]) for r in got]


class StoreStepLog:
    """:class:`StepLog` over an agent store (durable rows, any backend): rows wait in a
    bounded buffer until :meth:`run` writes them (see the module docstring) through the
    store's :class:`~agentserver.agents.store.base.ViewStore` role."""

    durable = True

    def __init__(self, store: ViewStore, *, buffer: int = BUFFER_ROWS) -> None:
        self._store = store
        self._send, self._receive = trio.open_memory_channel[StepRow](buffer)
        #: Rows taken from the buffer and not yet written (a failed write keeps them).
        self._batch: list[StepRow] = []
        #: Rows buffered (so far) and rows written: the buffer is first in, first out, so
        #: every row buffered before a moment is written once ``written`` reaches
        #: ``buffered`` of that moment.
        self.buffered = 0
        self.written = 0
        #: Rows lost because the buffer was full.
        self.dropped = 0
        self._progress = trio.Event()
        self._dropping = False
        #: The first pause after a failed write (doubling up to :data:`RETRY_MAX_S`).
        self.retry_s = RETRY_MIN_S

    def append(self, row: StepRow) -> StepRow:
        """Buffer ``row`` (its ``seq`` is set once it is written); a full buffer drops it,
        counted and logged."""
        try:
            self._send.send_nowait(row)
        except trio.WouldBlock:
            self.dropped += 1
            if not self._dropping:  # once per run of drops, not once per row
                self._dropping = True
                log.error(
                    "step log: buffer full (%d rows waiting for the agent store): dropping "
                    "step events until it is written (%d dropped so far)",
                    self.waiting,
                    self.dropped,
                )
        else:
            self.buffered += 1
        return row

    @property
    def waiting(self) -> int:
        """Rows buffered or taken and not yet written."""
        return self._receive.statistics().current_buffer_used + len(self._batch)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write buffered rows in batches until cancelled; a failed write is retried
        (the rows are kept) after a pause doubling from :attr:`retry_s`."""
        task_status.started()
        pause = self.retry_s
        while True:
            if not self._batch:
                self._batch.append(await self._receive.receive())
            self._take_buffered()
            try:
                await self._write()
            except (StoreError, sqlite3.Error) as exc:
                log.warning(
                    "step log: could not write %d row(s) (retrying in %.1fs): %s",
                    len(self._batch),
                    pause,
                    exc,
                )
                await trio.sleep(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            pause = self.retry_s

    async def drain(self) -> None:
        """Write every row still waiting (at shutdown, once the hub has stopped and
        :meth:`run` is cancelled, before the store closes); a failure is logged with
        the count of rows lost."""
        try:
            while self._batch or self._take_buffered():
                await self._write()
        except (StoreError, sqlite3.Error) as exc:
            log.error("step log: %d row(s) not written at shutdown: %s", self.waiting, exc)

    async def flush(self) -> None:
        """Wait until every row buffered before this call is written (unbounded while
        the store fails: callers bound it)."""
        target = self.buffered
        while self.written < target:
            await self._progress.wait()

    async def rows(
        self,
        *,
        step: str | None = None,
        listener: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[StepRow]:
        """The stored rows, after the rows recorded so far are written (read your
        writes; bounded by :data:`FLUSH_WAIT_S`)."""
        with trio.move_on_after(FLUSH_WAIT_S):
            await self.flush()
        return await self._store.read(select_rows, step, listener, after, limit)

    def _take_buffered(self) -> int:
        """Move buffered rows into the batch (up to :data:`BATCH_ROWS`); how many."""
        took = 0
        while len(self._batch) < BATCH_ROWS:
            try:
                self._batch.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                break
            took += 1
        return took

    async def _write(self) -> None:
        batch = self._batch
        await self._store.run(record_rows, batch)
        # No checkpoint between the write and this bookkeeping: a cancel arriving during
        # a PostgreSQL write lands after it (the thread is never abandoned).
        self._batch = []
        self.written += len(batch)
        self._progress.set()
        self._progress = trio.Event()
        if self._dropping:
            self._dropping = False
            log.warning("step log: writing again (%d row(s) dropped in all)", self.dropped)
