"""The embedded SQLite backend of :class:`~agentserver.agents.store.sql_store.SqlAgentStore`.

One file, WAL mode, ``synchronous=NORMAL`` (a commit survives a crash of the process; the
last commits may be lost on power failure). The schema is created and migrated on open
(:mod:`agentserver.agents.store.sql.schema`).

Concurrency: SQLite has one writer. Each method is a single ``BEGIN IMMEDIATE`` transaction
executed inline on the trio thread without any ``await`` inside, so transactions never
interleave within the process, and ``BEGIN IMMEDIATE`` plus ``busy_timeout`` serialise them
against another process opening the same file (e.g. ``sqlite3`` inspecting it). This is the
SQLite stand-in for the seeds' ``FOR UPDATE SKIP LOCKED``. Transactions are short (tens of
microseconds); nothing long runs inside one. One process owns the file (a lock beside it).

Checkpoints: copying the WAL back into the database file fsyncs both, which costs
milliseconds; SQLite's automatic checkpoint does it inside whichever commit crosses the
threshold, i.e. on the trio thread, stalling every task (it cost about 40% of
``bench/turns.py``'s Turns/s). While the runtime runs the store (:meth:`serve`), a
``PASSIVE`` checkpoint runs every :data:`CHECKPOINT_PERIOD` seconds on a worker thread
with its own connection (writers go on meanwhile); the automatic one stays on as a
backstop at :data:`AUTOCHECKPOINT_PAGES` so a store used without :meth:`serve` still
bounds its WAL. Durability is unchanged: a commit is in the WAL either way.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import ParamSpec, TypeVar

import trio

from agentserver.agents.clock import Clock, SystemClock
from agentserver.agents.doorbell import Doorbell
from agentserver.agents.errors import StoreError, StoreInUse
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import LostCalls, PendingReply
from agentserver.agents.store.served import ServedVersions
from agentserver.agents.store.sql import versions
from agentserver.agents.store.sql.db import SQLITE, Row, SqlValue, StoreFn
from agentserver.agents.store.sql.schema import MIGRATIONS, SCHEMA_VERSION, migrate
from agentserver.agents.store.sql_store import SqlAgentStore

__all__ = ["SCHEMA_VERSION", "_MIGRATIONS", "SqliteAgentStore", "SqliteTx"]

#: The migrations (kept under their old name for the tests that build old files).
_MIGRATIONS = MIGRATIONS

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

#: Seconds between the background WAL checkpoints while :meth:`SqliteAgentStore.serve` runs.
CHECKPOINT_PERIOD = 1.0
#: WAL pages (4 KiB) past which a commit checkpoints inline: only a backstop for a store
#: used without :meth:`SqliteAgentStore.serve` (SQLite's default is 1000).
AUTOCHECKPOINT_PAGES = 16384
#: Bytes the WAL file is cut back to when a checkpoint lets it start over: without a
#: limit it keeps the size of its busiest second for good (a 30-minute soak with
#: retention saw the file flat and the WAL grow it 2.2x; docs/operations.md).
WAL_SIZE_LIMIT = 4 * 1024 * 1024


class SqliteTx:
    """The :class:`~agentserver.agents.store.sql.db.Tx` of a sqlite3 connection in autocommit
    mode (the store issues ``BEGIN IMMEDIATE``/``COMMIT`` itself)."""

    dialect = SQLITE

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.rowcount = 0

    def execute(self, sql: str, params: Sequence[SqlValue] = ()) -> sqlite3.Cursor:
        cur = self._conn.execute(sql, params)
        self.rowcount = cur.rowcount
        return cur

    def executemany(self, sql: str, rows: Iterable[Sequence[SqlValue]]) -> None:
        self.rowcount = self._conn.executemany(sql, rows).rowcount

    def one(self, sql: str, params: Sequence[SqlValue] = ()) -> Row | None:
        rows = self._conn.execute(sql, params).fetchall()
        return rows[0] if rows else None

    def all(self, sql: str, params: Sequence[SqlValue] = ()) -> list[Row]:
        return self._conn.execute(sql, params).fetchall()


def _lock(path: Path) -> int:
    """Take the exclusive, non-blocking process lock of the store at ``path``."""
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        finally:
            os.close(fd)
        raise StoreInUse(
            f"agent store {path} is in use by another agentserver process (pid {owner})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


#: ``PRAGMA auto_vacuum`` values.
AUTO_VACUUM_INCREMENTAL = 2


def vacuum_mode(conn: sqlite3.Connection) -> int:
    """The file's ``auto_vacuum`` (0 none, 1 full, 2 incremental)."""
    return int(conn.execute("PRAGMA auto_vacuum").fetchone()[0])


def reclaim(conn: sqlite3.Connection, max_pages: int) -> int:
    """Free pages given back to the file by one bounded ``incremental_vacuum``."""
    if vacuum_mode(conn) != AUTO_VACUUM_INCREMENTAL:
        return 0
    before = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
    if before == 0:
        return 0
    conn.execute(f"PRAGMA incremental_vacuum({int(max_pages):d})").fetchall()
    return before - int(conn.execute("PRAGMA freelist_count").fetchone()[0])


def make_incremental(conn: sqlite3.Connection) -> bool:
    """Switch a file to ``auto_vacuum=INCREMENTAL`` (a ``VACUUM``: the whole file is
    rewritten, needs free disk as large as the file, and must run with no other
    connection writing: ``agentserver store prune`` does it on a stopped server's store).
    False if it already was."""
    if vacuum_mode(conn) == AUTO_VACUUM_INCREMENTAL:
        return False
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    conn.execute("VACUUM")
    return True


class SqliteAgentStore(SqlAgentStore):
    """SQLite-backed agent store. Create with :meth:`open`; close with :meth:`aclose`.

    One process owns the file (its lock), so the capabilities of a shared store
    (:class:`~agentserver.agents.store.base.StoreLifecycle` and the roles' doorbells)
    answer the one-process values: not shared, nobody else alive, no reply kept or
    left by another process, nothing to hand over."""

    shared = False
    others_alive = False
    client_replies: Doorbell | None = None
    replies_here: Doorbell | None = None

    def __init__(
        self,
        conn: sqlite3.Connection,
        clock: Clock,
        settings: StoreSettings,
        *,
        tool_result_caps: Mapping[str, int] | None = None,
        lock_fd: int | None = None,
        path: Path | None = None,
        served: ServedVersions | None = None,
    ) -> None:
        super().__init__(clock, settings, tool_result_caps, served)
        self._db = conn
        self._tx = SqliteTx(conn)
        #: The process lock of the file (see :func:`_lock`), released by :meth:`close`.
        self._lock_fd = lock_fd
        self._path = path
        self._checkpoint_db: sqlite3.Connection | None = None
        self._checkpoint_lock = threading.Lock()
        #: This process's id (the store names no process in its rows: it is the only one).
        self.owner = uuid.uuid4().hex

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        clock: Clock | None = None,
        settings: StoreSettings | None = None,
        tool_result_caps: Mapping[str, int] | None = None,
        served: ServedVersions | None = None,
    ) -> SqliteAgentStore:
        """Open (creating and migrating) the store file. Synchronous: call once at start.
        ``tool_result_caps``: agent id → the most tokens one tool result is shown with;
        ``served``: this process's agents' versions (docs/deploy.md).

        The process holds an exclusive lock on ``PATH.lock`` until :meth:`close`; the OS
        drops it if the process dies. Raises :class:`StoreInUse` if another process holds it.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = _lock(path)
        try:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except BaseException:
            os.close(lock)
            raise
        try:
            conn.execute("PRAGMA busy_timeout = 5000")
            settings = settings or StoreSettings(path=path)
            if settings.retention is not None:
                # Before the first table is made: a new file can give freed pages back
                # (an existing one keeps its mode until `agentserver store prune`).
                conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"cannot enable WAL on {path} (got {mode})")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute(f"PRAGMA wal_autocheckpoint = {AUTOCHECKPOINT_PAGES:d}")
            conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT:d}")
            conn.execute("PRAGMA foreign_keys = ON")
            store = cls(
                conn,
                clock or SystemClock(),
                settings,
                tool_result_caps=tool_result_caps,
                lock_fd=lock,
                path=path,
                served=served,
            )
            store._transact(migrate)
            for changed in store._transact(versions.register):
                log.warning("%s", changed.text())
        except BaseException:
            conn.close()
            os.close(lock)
            raise
        return store

    @classmethod
    def attach(
        cls, path: str | Path, *, clock: Clock | None = None, settings: StoreSettings | None = None
    ) -> SqliteAgentStore:
        """Open the store file of a running server, beside it, for maintenance
        (``agentserver store stats`` and ``prune``): no process lock and no migration
        (the schema must be this code's). Every transaction is ``BEGIN IMMEDIATE`` under
        ``busy_timeout``, so the server's and ours take turns; the server's pruner and
        ours share the prune lease. Raises :class:`StoreError` on another schema."""
        path = Path(path)
        if not path.exists():
            raise StoreError(f"no agent store at {path}")
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA busy_timeout = 5000")
            row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
            if not row or row[0] != SCHEMA_VERSION:
                raise StoreError(
                    f"agent store {path} is at schema {row[0] if row else None}, this code's is "
                    f"{SCHEMA_VERSION}: stop the server (a stopped store is migrated on open)"
                )
        except sqlite3.Error as exc:
            conn.close()
            raise StoreError(f"agent store {path}: {exc}") from None
        except BaseException:
            conn.close()
            raise
        return cls(conn, clock or SystemClock(), settings or StoreSettings(path=path), path=path)

    def vacuum_mode(self) -> int:
        """The file's ``auto_vacuum`` (2: INCREMENTAL, freed pages can go back)."""
        return vacuum_mode(self._db)

    def make_incremental(self) -> bool:
        """:func:`make_incremental` on this store's file; refused beside a running server
        (this store must hold the file's lock)."""
        if self._lock_fd is None:
            raise StoreError("the file is in use by a running server: stop it to convert")
        return make_incremental(self._db)

    def checkpoint_truncate(self) -> None:
        """A ``TRUNCATE`` checkpoint on this connection: the WAL copied back and emptied
        (``agentserver store prune`` on a stopped server's file, after its ``VACUUM``)."""
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def file_bytes(self) -> int:
        """The file's size plus its WAL's, in bytes."""
        if self._path is None:
            return 0
        total = 0
        for p in (self._path, self._path.with_name(self._path.name + "-wal")):
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def _transact(self, fn: StoreFn[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            result = fn(self._tx, self.env, *args, **kwargs)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    async def run(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        # Inline on the trio thread: no await inside, so transactions never interleave.
        return self._transact(fn, *args, **kwargs)

    async def run1(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        # One statement in autocommit is its own transaction (same lock, same busy wait).
        return fn(self._tx, self.env, *args, **kwargs)

    async def read(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        # A single reader statement needs no BEGIN (autocommit reads one snapshot each).
        return fn(self._tx, self.env, *args, **kwargs)

    async def hand_over_reply(self, agent_turn_id: str, process: str) -> bool:
        """No other process holds a caller of this store's: nothing to hand over."""
        return False

    async def pending_replies_here(self, limit: int = 256) -> list[PendingReply]:
        """No other process leaves replies here."""
        return []

    async def serve(
        self,
        doorbell: Doorbell,
        lost_calls: LostCalls | None = None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Checkpoint the WAL every :data:`CHECKPOINT_PERIOD` seconds on a worker thread
        until cancelled (run by :meth:`AgentRuntime.run`; ``doorbell`` and ``lost_calls``
        are unused: one process owns the file, so nobody else rings and no other
        process's Turns are left to take over). A cancel waits for a checkpoint in
        progress to finish (it is bounded by the WAL's size)."""
        task_status.started()
        while True:
            await trio.sleep(CHECKPOINT_PERIOD)
            await trio.to_thread.run_sync(self.checkpoint)

    def checkpoint(self) -> None:
        """One ``PASSIVE`` checkpoint on the checkpointing connection (opened on first use;
        any thread, one at a time). Never blocks the store's writers."""
        with self._checkpoint_lock:
            if self._checkpoint_db is None:
                if self._path is None:
                    return
                db = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
                db.execute("PRAGMA busy_timeout = 5000")
                self._checkpoint_db = db
            self._checkpoint_db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    async def checkpoint_after_prune(self) -> None:
        """A ``PASSIVE`` checkpoint inline, on the store's own connection, after a prune
        run. The background one (:meth:`checkpoint`, on a worker thread) copies what was
        committed when it began while the Turns go on committing, so under a steady load
        it seldom finds the log wholly copied, and the log starts over (and is cut back to
        :data:`WAL_SIZE_LIMIT`) only when it does: a pruner's deletions on top of the
        Turns' writes made the WAL peak 2.5x higher (issue 43). Inline, no commit of this
        process lands during it, so it copies everything (unless another connection reads
        an older snapshot) and the next commit starts the log over. It copies what the
        background one has not yet (at most about a second's writes), once per prune run.
        The background one is waited for first (on a thread): two checkpointers at once
        would leave this one busy."""
        if self._path is None:
            return
        await trio.to_thread.run_sync(self._checkpoint_lock.acquire)
        try:
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        finally:
            self._checkpoint_lock.release()

    async def reclaim_pages(self, max_pages: int) -> int:
        """``PRAGMA incremental_vacuum(max_pages)`` inline (its own short write
        transaction; ``max_pages`` bounds it): the file shrinks by what it frees. Nothing
        on a file whose ``auto_vacuum`` is not INCREMENTAL (see :func:`vacuum_mode`)."""
        return reclaim(self._db, max_pages)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the database and release the process lock. Idempotent."""
        with self._checkpoint_lock:
            if self._checkpoint_db is not None:
                self._checkpoint_db.close()
                self._checkpoint_db = None
        self._db.close()
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock
