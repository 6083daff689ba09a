"""Store transactions on PostgreSQL, from trio: one whole transaction per thread hop.

psycopg's async API and psycopg_pool's async pool need asyncio, so the store uses the
sync driver: :meth:`PgExecutor.run` runs a sync function over a :class:`PgTx` inside one
transaction in ``trio.to_thread.run_sync``, with a ``trio.CapacityLimiter`` the size of
the pool (trio's default limiter allows 40 threads; more threads than connections would
only queue inside the pool, out of trio's sight).

A thread cannot be abandoned (``to_thread.run_sync`` waits for it even when cancelled),
so every wait inside one is bounded on the server: ``statement_timeout`` and
``lock_timeout`` on each connection, and the pool's own timeout for a free connection.

Configuration and retries: the trio executor's (:class:`~.config.PgConfig`, and the one
retry loop of :mod:`.retry`: a serialization failure, a deadlock or a connection lost
before ``COMMIT`` runs the transaction again, bounded; a connection lost during
``COMMIT`` is raised as :class:`StoreError`). Here the loop runs in the worker thread.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import psycopg
import trio
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer
from psycopg_pool import ConnectionPool, PoolTimeout

from agentserver.agents.errors import StoreError
from agentserver.agents.profile.store_url import redact, redact_text
from agentserver.agents.store.pg.config import PgConfig
from agentserver.agents.store.pg.retry import CommitLost, run_retrying_sync
from agentserver.agents.store.sql.db import Row, SqlValue

T = TypeVar("T")

#: The name of the worker threads while they run a transaction (trio would otherwise
#: format one from the function and the task, on every call).
THREAD_NAME = "agentserver store transaction"


@functools.lru_cache(maxsize=1024)
def to_pg(sql: str) -> bytes:
    """``?`` placeholders (the store's SQL, shared with SQLite) → PostgreSQL's ``$1``,
    ``$2``, …, encoded.

    The store's SQL never has a ``?`` inside a literal or an identifier."""
    parts = sql.split("?")
    out = [parts[0]]
    for i, part in enumerate(parts[1:], 1):
        out.append(f"${i}")
        out.append(part)
    return "".join(out).encode()


#: Prepared statements kept per connection (their names are ``as0``, ``as1``, …); past
#: this, statements run unprepared (the store has a few dozen).
MAX_PREPARED = 256

_FAILED = (pq.ExecStatus.FATAL_ERROR, pq.ExecStatus.BAD_RESPONSE, pq.ExecStatus.NONFATAL_ERROR)


class Later:
    """A read queued with the statements around it: its rows once the round trip it
    went out in is back (:meth:`PgTx.later`; on the trio executor, the next read,
    :meth:`~.pipe.PgPipeTx.last` or ``COMMIT``)."""

    __slots__ = ("_rows",)

    def __init__(self, rows: list[Row] | None = None) -> None:
        self._rows = rows

    def set(self, rows: list[Row]) -> None:
        self._rows = rows

    @property
    def rows(self) -> list[Row]:
        """Its rows; RuntimeError if its round trip has not been made yet."""
        if self._rows is None:
            raise RuntimeError("the read has not been sent yet")
        return self._rows


class PgTx:
    """One open transaction: the store's tiny SQL interface (``?`` placeholders).

    Statements go straight to libpq through psycopg's ``pgconn`` (the GIL released while
    waiting) with psycopg's own adapters (its ``Transformer``: the same Python types in
    and out as its cursors), prepared once per connection and parameter types. This
    skips the cursor machinery, which cost about half the CPU of a statement, and the
    store runs some 80 statements per Turn, each under the GIL."""

    __slots__ = ("_pg", "_prepared", "_tx", "conn", "rowcount")
    dialect = "postgresql"

    def __init__(self, conn: psycopg.Connection, prepared: dict[tuple, bytes]) -> None:
        self.conn = conn
        self.rowcount = 0
        self._pg = conn.pgconn
        self._tx = Transformer(conn)
        #: (sql, parameter types) → the name prepared on this connection
        self._prepared = prepared

    def _exec(self, sql: str, params: Sequence[Any]) -> pq.abc.PGresult:
        tx = self._tx
        if params:
            args = tx.dump_sequence(params, [PyFormat.AUTO] * len(params))
            types, formats = tx.types, tx.formats
        else:
            args, types, formats = None, (), None
        key = (sql, types)
        name = self._prepared.get(key)
        if name is None:
            if len(self._prepared) >= MAX_PREPARED:
                res = self._pg.exec_params(to_pg(sql), args, types, formats, pq.Format.TEXT)
                return self._check(res)
            name = b"as%d" % len(self._prepared)
            self._check(self._pg.prepare(name, to_pg(sql), types))
            self._prepared[key] = name
        # psycopg's annotation leaves out the None a NULL parameter dumps to, which
        # exec_prepared takes as exec_params does.
        return self._check(
            self._pg.exec_prepared(name, args, formats, pq.Format.TEXT)  # type: ignore[arg-type]
        )

    def _check(self, res: pq.abc.PGresult) -> pq.abc.PGresult:
        if res.status in _FAILED:
            if self._pg.status == pq.ConnStatus.BAD:
                raise psycopg.OperationalError(
                    self._pg.get_error_message() or "the connection was lost"
                )
            raise pg_errors.error_from_result(res, encoding=self.conn.info.encoding)
        self.rowcount = res.command_tuples if res.command_tuples is not None else -1
        return res

    def execute(self, sql: str, params: Sequence[SqlValue] = ()) -> int:
        """Run one statement; returns (and keeps in ``rowcount``) the rows it changed."""
        self._exec(sql, params)
        return self.rowcount

    def executemany(self, sql: str, rows: Iterable[Sequence[SqlValue]]) -> None:
        total = 0
        for row in rows:
            self._exec(sql, row)
            total += max(self.rowcount, 0)
        self.rowcount = total

    def one(self, sql: str, params: Sequence[SqlValue] = ()) -> Row | None:
        """The first row; all are fetched, so a ``RETURNING`` statement completes."""
        rows = self.all(sql, params)
        return rows[0] if rows else None

    def all(self, sql: str, params: Sequence[SqlValue] = ()) -> list[Row]:
        res = self._exec(sql, params)
        if res.status != pq.ExecStatus.TUPLES_OK:
            return []
        tx = self._tx
        tx.set_pgresult(res)
        return tx.load_rows(0, res.ntuples, tuple)

    def later(self, sql: str, params: Sequence[SqlValue] = ()) -> Later:
        """The statement's rows when the store function needs them (here: at once; on
        the trio executor it waits in the pipeline, :class:`Later`)."""
        return Later(self.all(sql, params))

    def last(self, sql: str, params: Sequence[SqlValue] = ()) -> list[Row]:
        """The transaction's last statement and its rows (the trio executor sends
        ``COMMIT`` with it; here the executor commits after the function returns)."""
        return self.all(sql, params)

    def end(self) -> None:
        """The call's statements are all sent (the trio executor commits here; this one
        commits after the function returns)."""

    def command(self, sql: bytes) -> None:
        """A statement without parameters or rows (``BEGIN``, ``COMMIT``, ``ROLLBACK``)."""
        self._check(self._pg.exec_(sql))


#: The interpreter's thread switch interval while a PostgreSQL store is open (s).
SWITCH_INTERVAL_S = 0.0005


def shorten_switch_interval() -> None:
    """Lower the interpreter's thread switch interval to :data:`SWITCH_INTERVAL_S` (never
    raise it).

    Every statement ends with its thread taking the GIL back from the trio thread; with
    the default 5 ms interval, a busy trio thread makes each statement wait up to that
    long before it is asked to let go, and a Turn runs some 80 statements one after the
    other. The setting is the process's; a store on PostgreSQL is the part of it that
    makes threads wait on the GIL, so opening one sets it."""
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)


class PgExecutor:
    """A connection pool and the trio side of it, built from a :class:`~.config.PgConfig`.
    Open with :meth:`open`, close with :meth:`aclose`. Bounded: at most ``pool_size``
    threads run transactions; each waits at most ``connect_timeout_s`` for a connection,
    and every statement is bounded on the server."""

    def __init__(self, config: PgConfig) -> None:
        self.config = config
        self.url = config.url
        self.pool_size = config.pool_size
        self.limiter = trio.CapacityLimiter(config.pool_size)
        #: Each pooled connection's prepared statements (gone with the connection).
        self._statements: weakref.WeakKeyDictionary[psycopg.Connection, dict[tuple, bytes]] = (
            weakref.WeakKeyDictionary()
        )
        self._statements_lock = threading.Lock()
        #: Transactions run again after a serialization failure, deadlock or lost
        #: connection (figures; tests read it).
        self.reruns = 0
        self._pool = ConnectionPool(
            config.url,
            min_size=1,
            max_size=config.pool_size,
            open=False,
            timeout=config.connect_timeout_s,
            kwargs=config.connection_kwargs(),
            name="agentserver-store",
        )

    @classmethod
    async def open(cls, url: str, **kwargs: Any) -> PgExecutor:
        """A started executor: its first connection is made (StoreError if it cannot be)."""
        return await trio.to_thread.run_sync(functools.partial(cls.open_sync, url, **kwargs))

    @classmethod
    def open_sync(cls, url: str, **kwargs: Any) -> PgExecutor:
        """:meth:`open`, blocking the calling thread (start-up paths that are sync);
        ``kwargs`` are :class:`~.config.PgConfig`'s."""
        ex = cls(PgConfig(url, **kwargs))
        shorten_switch_interval()
        try:
            ex._pool.open(wait=True, timeout=ex.config.connect_timeout_s)
        except (PoolTimeout, psycopg.Error) as exc:
            ex._pool.close()
            raise StoreError(
                f"cannot connect to the agent store {redact(url)}: {redact_text(exc, url)}"
            ) from None
        return ex

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self.close)

    def close(self) -> None:
        """Close every connection (blocking). Idempotent."""
        self._pool.close()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(tx, *args)`` in one transaction, in a worker thread; its result, or its
        exception (psycopg's errors as :class:`StoreError`). Nothing of a transaction
        that raised is committed."""
        return await trio.to_thread.run_sync(
            self.run_sync, fn, *args, limiter=self.limiter, thread_name=THREAD_NAME
        )

    async def run_single(self, fn: Callable[..., T], *args: Any) -> T:
        """Like :meth:`run` for a ``fn`` that reads, or runs one statement (atomic by
        itself): in autocommit, without the ``BEGIN``/``COMMIT`` round trips. A read of
        several statements sees a snapshot per statement."""
        return await trio.to_thread.run_sync(
            functools.partial(self.run_sync, fn, *args, atomic=False),
            limiter=self.limiter,
            thread_name=THREAD_NAME,
        )

    def run_sync(self, fn: Callable[..., T], *args: Any, atomic: bool = True) -> T:
        """:meth:`run` (``atomic=False``: :meth:`run_single`) on the calling thread (a
        worker thread, or a start-up path), run again as :mod:`.retry` decides."""
        return run_retrying_sync(
            self.config, functools.partial(self._once, fn, args, atomic), self._rerun
        )

    def _rerun(self) -> None:
        self.reruns += 1

    def _once(self, fn: Callable[..., T], args: tuple[Any, ...], atomic: bool) -> T:
        with self._pool.connection() as conn:
            prepared = self._statements.get(conn)
            if prepared is None:
                with self._statements_lock:  # a new connection: rare
                    prepared = self._statements.setdefault(conn, {})
            tx = PgTx(conn, prepared)
            # The pool's connections are autocommit: BEGIN/COMMIT only where needed.
            if not atomic:
                return fn(tx, *args)
            tx.command(b"BEGIN")
            try:
                result = fn(tx, *args)
            except BaseException:
                if not conn.broken:
                    with contextlib.suppress(psycopg.Error):
                        tx.command(b"ROLLBACK")
                raise
            try:
                tx.command(b"COMMIT")
            except psycopg.OperationalError as exc:
                if conn.broken:
                    raise CommitLost(redact_text(exc, self.url)) from None
                raise
            return result
