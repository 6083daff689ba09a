"""The step log of remote listeners: one row per step event (agentserver.runners).

Events: ``step.dispatched`` (an attempt given to a runner; detail: the runner
connection), ``step.retried`` (a new attempt follows a timed-out or failed one),
``step.succeeded``, ``step.failed``, ``step.timed_out`` (the final outcome when no retry
follows) and ``step.cancelled`` (stopped from outside).

Where the server has an embedded (SQLite) agent store, rows are durable: a mixin of
:class:`agentserver.agents.sqlite_store.SqliteAgentStore` writes them to its
``step_log`` table (schema migration 5, created on PostgreSQL too; ``seq`` is numbered
by the database). Without an agent store (no agents declared), and for now on the
PostgreSQL store (whose writes cannot run on the hub's synchronous path),
:class:`MemoryStepLog` keeps the last :data:`MEMORY_ROWS` rows in memory; they are
gone at restart.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from agentserver.agents.sql.db import Tx

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

#: Rows a :class:`MemoryStepLog` keeps (oldest dropped).
MEMORY_ROWS = 4096
#: The most rows one query returns.
MAX_ROWS = 1000
_INSERT_COLS = "step_id, listener, caller, attempt, event, detail, at"
_COLS = "seq, " + _INSERT_COLS


# Not frozen: the log numbers a row in place (a dataclasses.replace per row cost more
# than the rest of recording it).
@dataclass(slots=True)
class StepRow:
    """One step event. ``attempt`` is 1 for the first try (0 on ``step.dispatched`` and
    ``step.cancelled``, which are not counted per attempt); ``seq`` is set by the log."""

    step: str
    listener: str
    caller: str
    attempt: int
    event: str
    detail: str = ""
    at: float = 0.0
    seq: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "step": self.step,
            "listener": self.listener,
            "caller": self.caller,
            "attempt": self.attempt,
            "event": self.event,
            "detail": self.detail,
            "at": self.at,
        }


class StepLog(Protocol):
    def append(self, row: StepRow) -> StepRow:
        """Record ``row``; returns it with its ``seq``. Never blocks the caller for long:
        called from the hub's synchronous paths."""
        ...

    def rows(
        self,
        *,
        step: str | None = None,
        listener: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[StepRow]:
        """Rows in ``seq`` order after ``after``, optionally of one step or listener."""
        ...

    def __iter__(self) -> Iterator[StepRow]: ...


def _limit(limit: int) -> int:
    return max(1, min(limit, MAX_ROWS))


class MemoryStepLog:
    """The step log of a server without an agent store: the last rows, in memory."""

    durable = False

    def __init__(self, size: int = MEMORY_ROWS) -> None:
        self._rows: collections.deque[StepRow] = collections.deque(maxlen=size)
        self._seq = 0

    def append(self, row: StepRow) -> StepRow:
        self._seq += 1
        row.seq = self._seq
        self._rows.append(row)
        return row

    def rows(
        self,
        *,
        step: str | None = None,
        listener: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[StepRow]:
        out = []
        for row in self._rows:
            if row.seq <= after or (step and row.step != step):
                continue
            if listener and row.listener != listener:
                continue
            out.append(row)
            if len(out) >= _limit(limit):
                break
        return out

    def __iter__(self) -> Iterator[StepRow]:
        return iter(list(self._rows))


def record(tx: Tx, row: StepRow) -> int:
    """Insert ``row`` (one statement); returns its ``seq``, numbered by the database."""
    got = tx.one(
        f"INSERT INTO step_log ({_INSERT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING seq",
        (row.step, row.listener, row.caller, row.attempt, row.event, row.detail, row.at),
    )
    assert got is not None
    return int(got[0])


def select(
    tx: Tx, *, step: str | None, listener: str | None, after: int, limit: int
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
        (*args, _limit(limit)),
    )
    return [StepRow(r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[0]) for r in got]


class StepLogStoreMixin:
    """The embedded (SQLite) store's part of the step log: one autocommitted statement
    on its connection, inline. The hub records from synchronous paths, and a SQLite
    insert is tens of microseconds; no store transaction is ever open across an await,
    so this cannot land inside another one. (A networked store has no synchronous
    path: see :class:`MemoryStepLog` and docs/agents.md.)"""

    _tx: Tx

    def record_step(self, row: StepRow) -> StepRow:
        row.seq = record(self._tx, row)
        return row

    def step_rows(
        self,
        *,
        step: str | None = None,
        listener: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[StepRow]:
        return select(self._tx, step=step, listener=listener, after=after, limit=limit)


class StoreStepLog:
    """:class:`StepLog` over an agent store (durable rows)."""

    durable = True

    def __init__(self, store: StepLogStoreMixin) -> None:
        self._store = store

    def append(self, row: StepRow) -> StepRow:
        return self._store.record_step(row)

    def rows(
        self,
        *,
        step: str | None = None,
        listener: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[StepRow]:
        return self._store.step_rows(step=step, listener=listener, after=after, limit=limit)

    def __iter__(self) -> Iterator[StepRow]:
        after = 0
        while batch := self.rows(after=after, limit=MAX_ROWS):
            yield from batch
            after = batch[-1].seq
