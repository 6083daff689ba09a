"""The tiny database adapter every store function runs on, and what it needs besides.

A backend supplies a :class:`Tx` for the span of one transaction (SQLite: the connection
between ``BEGIN IMMEDIATE`` and ``COMMIT``; PostgreSQL: one pooled connection's
transaction). SQL is written with ``?`` placeholders in the subset both engines accept;
the PostgreSQL adapter rewrites them. Where a statement must differ, the function branches
on :attr:`Tx.dialect` in one place (so far only the schema's DDL does).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, Protocol, TypeAlias, TypeVar

from agentserver.agents.clock import Clock
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.served import ServedVersions

SQLITE = "sqlite"
POSTGRESQL = "postgresql"


#: A value bound to a statement's ``?`` (bool is an int; both drivers adapt these).
SqlValue: TypeAlias = str | int | float | bytes | None
#: A row as read: the driver's values, typed by the function that reads it (the edge).
Row: TypeAlias = tuple[Any, ...]


class Tx(Protocol):
    """One open transaction. ``rowcount``: rows changed by the last ``execute``."""

    dialect: str
    rowcount: int

    def execute(self, sql: str, params: Sequence[SqlValue] = ()) -> Any:
        """Run one statement. Its return value is not for use (on PostgreSQL the
        statement may only be queued): read ``rowcount``, which waits for it."""
        ...

    def executemany(self, sql: str, rows: Iterable[Sequence[SqlValue]]) -> None: ...
    def one(self, sql: str, params: Sequence[SqlValue] = ()) -> Row | None:
        """The first row (all rows are fetched, so a ``RETURNING`` statement completes)."""
        ...

    def all(self, sql: str, params: Sequence[SqlValue] = ()) -> list[Row]: ...


@dataclass(slots=True)
class StoreEnv:
    """What the store functions need besides the transaction (no module singletons)."""

    clock: Clock
    settings: StoreSettings
    #: agent id → the most tokens one tool result is shown with (budget.tool_result_cap)
    tool_result_caps: dict[str, int] = field(default_factory=dict)
    #: This process's agents' versions: what its Turns record, which rows it claims.
    served: ServedVersions = field(default_factory=ServedVersions)


P = ParamSpec("P")
R = TypeVar("R")

#: A store function, ``fn(tx, env, *args)``: what a backend's ``_run`` runs in one
#: transaction. Its ``P`` lets the checker match each call's arguments to the function.
StoreFn: TypeAlias = Callable[Concatenate[Tx, StoreEnv, P], R]


def new_id() -> str:
    return uuid.uuid4().hex


def locking(tx: Tx) -> str:
    """`` FOR UPDATE`` on PostgreSQL (read committed: the rows read are locked, and a row
    another transaction changed meanwhile is checked again once it commits), nothing on
    SQLite (one writer at a time: what a write transaction reads stays so until it ends)."""
    return " FOR UPDATE" if tx.dialect == POSTGRESQL else ""


def skip_locked(tx: Tx) -> str:
    """The row-lock clause of a claim's inner SELECT: `` FOR UPDATE SKIP LOCKED`` on
    PostgreSQL (processes sharing the database take disjoint rows), nothing on SQLite (one
    writer at a time)."""
    return " FOR UPDATE SKIP LOCKED" if tx.dialect == POSTGRESQL else ""


def marks(n: int) -> str:
    """``?,?,…`` for an ``IN (…)`` of ``n`` values."""
    return ",".join("?" * n)


#: Rows per statement of :func:`insert_rows` (SQLite allows 32766 parameters, psycopg 65535).
INSERT_CHUNK = 256


def insert_rows(tx: Tx, into: str, rows: Sequence[Sequence[Any]]) -> None:
    """``into`` (``INSERT INTO t (columns)``) with ``rows``, all of one width, as one
    multi-row ``VALUES`` statement per :data:`INSERT_CHUNK` rows: one round trip, where a
    PostgreSQL ``executemany`` pipelines a statement per row."""
    for i in range(0, len(rows), INSERT_CHUNK):
        part = rows[i : i + INSERT_CHUNK]
        tx.execute(_values_sql(into, len(part[0]), len(part)), [v for r in part for v in r])


@functools.lru_cache(maxsize=256)
def _values_sql(into: str, width: int, n: int) -> str:
    one = "(" + ",".join("?" * width) + ")"
    return f"{into} VALUES {','.join([one] * n)}"
