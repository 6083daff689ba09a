"""What a bench run writes to its store: commits, rows, and index entries.

SQLite (:class:`SqliteWrites`): a statement trace on the store's connection. A commit is
a ``COMMIT`` or a write statement run outside a transaction (autocommit: its own
transaction). Rows are the connection's ``total_changes`` (inserted, updated or deleted),
given to the statement that made them. Index entries: a row inserted or deleted writes
one entry in each index of its table; a row updated, one in each index that holds a
column its ``SET`` assigns (the primary key's own b-tree, the row itself, is not an index
entry; a ``WITHOUT ROWID`` table has none of these).

PostgreSQL (:func:`pg_table_writes`, :func:`pg_writes_between`): the server's own
counters (``pg_stat_user_tables``), read before and after. A row inserted, or updated
other than HOT (heap-only tuple), writes an entry in every index of its table; a HOT
update writes none, and a delete none (vacuum removes entries later). The server flushes
a backend's counters when it exits, so read the second snapshot once the processes that
wrote have ended; a backend's counters from up to a second before the first snapshot may
land after it (start-up writes, a handful of rows).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field

_WRITE = re.compile(
    r"\b(?:(INSERT|REPLACE)(?:\s+OR\s+\w+)?\s+INTO|(UPDATE)(?:\s+OR\s+\w+)?|(DELETE)\s+FROM)"
    r"\s+\"?(\w+)\"?",
    re.IGNORECASE,
)
_SET = re.compile(r"\bSET\b(.*?)(?:\bWHERE\b|\bFROM\b|\bRETURNING\b|$)", re.I | re.S)
_ASSIGNED = re.compile(r"(?:^|,)\s*\"?(\w+)\"?\s*=", re.S)


@dataclass
class Writes:
    """Totals over a run (divide by its Turns)."""

    commits: int = 0
    rows: int = 0
    index_entries: int = 0
    #: "VERB table" -> [rows, index entries]
    by_table: dict[str, list[int]] = field(default_factory=dict)

    def add(self, verb: str, table: str, rows: int, entries: int) -> None:
        self.rows += rows
        self.index_entries += entries
        got = self.by_table.setdefault(f"{verb} {table}", [0, 0])
        got[0] += rows
        got[1] += entries

    def per_turn(self, turns: int) -> dict[str, float]:
        done = max(turns, 1)
        return {
            "commits_per_turn": round(self.commits / done, 2),
            "rows_written_per_turn": round(self.rows / done, 1),
            "index_entries_written_per_turn": round(self.index_entries / done, 1),
            "writes_per_turn_by_table": {
                k: [round(r / done, 2), round(e / done, 2)]
                for k, (r, e) in sorted(self.by_table.items(), key=lambda kv: -kv[1][0])
            },
        }


def _indexes(path: str) -> dict[str, list[frozenset[str]]]:
    """Each table's indexes, as the column sets they hold (another connection, so that
    the traced one runs nothing of ours)."""
    conn = sqlite3.connect(path)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        out: dict[str, list[frozenset[str]]] = {}
        for table in tables:
            cols = []
            for index in conn.execute(f"PRAGMA index_list('{table}')").fetchall():
                held = conn.execute(f"PRAGMA index_info('{index[1]}')").fetchall()
                cols.append(frozenset(r[2].lower() for r in held if r[2]))
            out[table.lower()] = cols
        return out
    finally:
        conn.close()


class SqliteWrites:
    """Counts a sqlite3 connection's commits, rows and index entries between
    :meth:`start` and :meth:`stop` (its trace callback: set nothing else on it)."""

    def __init__(self, conn: sqlite3.Connection, path: str) -> None:
        self.conn = conn
        self.path = path
        self.writes = Writes()
        self.statements = 0
        self._indexes: dict[str, list[frozenset[str]]] = {}
        self._last: tuple[str, str, frozenset[str]] | None = None
        self._changes = 0

    def start(self) -> None:
        self._indexes = _indexes(self.path)
        self._changes = self.conn.total_changes
        self._last = None
        self.conn.set_trace_callback(self._trace)

    def stop(self) -> Writes:
        self.conn.set_trace_callback(None)
        self._settle()
        return self.writes

    def _settle(self) -> None:
        """Give the rows changed since the last statement began to it."""
        now = self.conn.total_changes
        rows, self._changes = now - self._changes, now
        if not rows or self._last is None:
            return
        verb, table, assigned = self._last
        indexes = self._indexes.get(table, [])
        if verb == "UPDATE":
            touched = sum(1 for cols in indexes if cols & assigned)
        else:
            touched = len(indexes)
        self.writes.add(verb, table, rows, rows * touched)

    def _trace(self, sql: str) -> None:
        self._settle()
        self.statements += 1
        head = sql.lstrip()[:8].upper()
        if head.startswith("COMMIT") or head.startswith("END"):
            self.writes.commits += 1
            self._last = None
            return
        match = _WRITE.search(sql)
        if match is None:
            self._last = None
            return
        verb = (match.group(1) or match.group(2) or match.group(3)).upper()
        if verb == "REPLACE":
            verb = "INSERT"
        assigned: frozenset[str] = frozenset()
        if verb == "UPDATE":
            got = _SET.search(sql, match.end())
            if got is not None:
                assigned = frozenset(c.lower() for c in _ASSIGNED.findall(got.group(1)))
        self._last = (verb, match.group(4).lower(), assigned)
        if not self.conn.in_transaction:
            self.writes.commits += 1  # autocommit: the statement is its own transaction


_PG_TABLES = """
SELECT s.relname, s.n_tup_ins, s.n_tup_upd, s.n_tup_hot_upd, s.n_tup_del,
       (SELECT count(*) FROM pg_index i WHERE i.indrelid = s.relid)
FROM pg_stat_user_tables s
"""


def pg_table_writes(url: str) -> dict[str, tuple[int, int, int, int, int]]:
    """The server's write counters by table: inserted, updated, HOT-updated, deleted,
    and the table's index count."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return {r[0]: tuple(int(v) for v in r[1:]) for r in conn.execute(_PG_TABLES)}


def pg_writes_between(
    before: Mapping[str, tuple[int, ...]], after: Mapping[str, tuple[int, ...]]
) -> Writes:
    """Rows and index entries written between two :func:`pg_table_writes` snapshots
    (commits are not counted here: the executor counts statements)."""
    out = Writes()
    for table, (ins, upd, hot, dele, indexes) in after.items():
        b_ins, b_upd, b_hot, b_del = before.get(table, (0, 0, 0, 0, 0))[:4]
        ins, upd, hot, dele = ins - b_ins, upd - b_upd, hot - b_hot, dele - b_del
        for verb, rows, entries in (
            ("INSERT", ins, ins * indexes),
            ("UPDATE", upd, (upd - hot) * indexes),
            ("DELETE", dele, 0),
        ):
            if rows:
                out.add(verb, table, rows, entries)
    return out
