"""Store transactions on PostgreSQL driven from the trio thread: no thread hops.

The store's functions are sync code over a :class:`~agentserver.agents.sql.db.Tx` (shared
with SQLite). :class:`PgTrioExecutor` runs each one in a greenlet on the trio thread; its
:class:`PgPipeTx` sends every statement through libpq's non-blocking API in pipeline mode
(psycopg's ``pgconn``: ``send_query_prepared``, ``pipeline_sync``, ``flush``,
``consume_input``, ``is_busy``, ``get_result``) and, to wait for the socket, switches back
to the calling task, which awaits ``trio.lowlevel.wait_readable``/``wait_writable`` and
switches in again. No thread, no GIL hand-over per statement; psycopg's ``Transformer``
adapts the values as before (the same Python types in and out as the thread executor).

Round trips: ``BEGIN`` is not sent alone but in front of the transaction's first
statement, a statement seen for the first time on a connection is prepared in the same
round trip as its first execution, and ``executemany`` sends all its rows at once, so a
transaction of n statements costs n + 1 round trips (its ``COMMIT`` the last) and a read
in autocommit one.

Bounded: at most ``pool_size`` transactions are in flight (a ``trio.Semaphore``; a caller
waits at most ``connect_timeout_s`` for a connection, then :class:`StoreError`); each
statement by the server's ``statement_timeout``/``lock_timeout``.

Cancel: a store call cancelled while it waits on the server sends the server a cancel
request (a worker thread, shielded, at most :data:`CANCEL_TIMEOUT_S`), discards its
connection (closed: the server ends the backend and rolls back whatever was open on it)
and unwinds the greenlet; the cancel is raised to the caller. A transaction is never left open, and a connection
is never reused in an unknown state. A cancel that lands while ``COMMIT`` is in flight
leaves the outcome unknown to this process, like a crash at that point (the store's
epoch fencing and recovery are built for that).

Retries: as in :mod:`.executor` (a serialization failure, a deadlock or a connection lost
before ``COMMIT`` runs the transaction again, bounded, with a short random backoff).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import greenlet
import psycopg
import trio
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer

from agentserver.agents.errors import StoreError
from agentserver.agents.pg import executor as thread_executor
from agentserver.agents.pg.executor import (
    RETRYABLE,
    PgExecutor,
    PgTx,
    connection_lost,
    to_pg,
)
from agentserver.agents.pg.url import redact, redact_text

T = TypeVar("T")

_FAILED = (pq.ExecStatus.FATAL_ERROR, pq.ExecStatus.BAD_RESPONSE, pq.ExecStatus.NONFATAL_ERROR)
_OK = pq.ConnStatus.OK
_IDLE = pq.TransactionStatus.IDLE

#: The longest a cancelled call waits for its cancel request to reach the server (s).
CANCEL_TIMEOUT_S = 2.0

#: What a transaction's greenlet asks its task to wait for (by switching to it).
_READ = object()
_WRITE = object()


class _Discarded(BaseException):
    """Thrown into a transaction's greenlet whose connection was discarded (the call
    was cancelled): it unwinds the store function without running another statement."""


class PgConn:
    """One pooled connection: psycopg's, non-blocking, and its prepared statements."""

    __slots__ = ("blocking_prepared", "conn", "fd", "names", "pg", "prepared", "tx")

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        self.pg = conn.pgconn
        self.pg.nonblocking = 1
        self.fd = self.pg.socket
        #: (sql, parameter types) → the name prepared on this connection
        self.prepared: dict[tuple, bytes] = {}
        #: prepared statement names given out (a failed prepare's name is not reused);
        #: the names are ``at0``, ``at1``, …: never those of the blocking path's
        #: :class:`~.executor.PgTx` (``as0``, …), which keeps its own
        self.names = 0
        self.blocking_prepared: dict[tuple, bytes] = {}
        self.tx = Transformer(conn)

    @property
    def clean(self) -> bool:
        """Connected, outside any transaction and pipeline: fit to be reused."""
        pg = self.pg
        return (
            pg.status == _OK
            and pg.transaction_status == _IDLE
            and pg.pipeline_status == pq.PipelineStatus.OFF
        )

    def close(self) -> None:
        self.conn.close()


class PgPipeTx:
    """One transaction (or autocommit statements) on a :class:`PgConn`, from inside the
    greenlet of :meth:`PgTrioExecutor.run`: the store's Tx (``?`` placeholders).

    Each statement is one pipeline batch ended by a sync: results are read up to the
    sync, so an error leaves the connection ready for ``ROLLBACK``."""

    __slots__ = ("_begin", "_c", "_parent", "_stats", "dead", "rowcount")
    dialect = "postgresql"

    def __init__(self, c: PgConn, parent: greenlet.greenlet, stats: list[int]) -> None:
        self._c = c
        self._parent = parent
        #: [statements, round trips] (the executor's figures)
        self._stats = stats
        self._begin = False
        self.rowcount = 0
        #: Set once the connection is discarded: no statement may be sent any more.
        self.dead = False

    @property
    def conn(self) -> psycopg.Connection:
        return self._c.conn

    def begin(self) -> None:
        """Open the transaction with the next statement (no round trip of its own)."""
        self._begin = True

    # -- sending -----------------------------------------------------------------

    def _send(self, sql: str, params: Sequence[Any]) -> tuple | None:
        """Send one statement (prepared first if new: the key it was prepared under)."""
        c = self._c
        pg = c.pg
        tx = c.tx
        if params:
            args = tx.dump_sequence(params, [PyFormat.AUTO] * len(params))
            types, formats = tx.types, tx.formats
        else:
            args, types, formats = None, (), None
        key = (sql, types)
        name = c.prepared.get(key)
        if name is None:
            if len(c.prepared) >= thread_executor.MAX_PREPARED:
                pg.send_query_params(to_pg(sql), args, types, formats, pq.Format.TEXT)
                return None
            name = b"at%d" % c.names
            c.names += 1
            pg.send_prepare(name, to_pg(sql), types)
            c.prepared[key] = name
            pg.send_query_prepared(name, args, formats, pq.Format.TEXT)
            return key
        pg.send_query_prepared(name, args, formats, pq.Format.TEXT)
        return None

    def _batch(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> list[pq.abc.PGresult]:
        """Send ``statements`` (``BEGIN`` first if due) as one pipeline batch, wait, and
        return the last result of each statement (a prepare's result is dropped)."""
        if self.dead:
            raise _Discarded()
        c = self._c
        pg = c.pg
        pg.enter_pipeline_mode()
        # per result expected before the sync: None for a statement's, or the key of
        # a prepare (forgotten if the prepare did not succeed)
        kinds: list[tuple | None] = []
        if self._begin:
            pg.send_query_params(b"BEGIN", None)
            kinds.append(())
            self._begin = False
            self._stats[0] += 1
        for sql, params in statements:
            key = self._send(sql, params)
            if key is not None:
                kinds.append(key)
            kinds.append(None)
            self._stats[0] += 1
        pg.pipeline_sync()
        self._stats[1] += 1
        self._flush()
        results: list[pq.abc.PGresult] = []
        error: pq.abc.PGresult | None = None
        for kind in kinds:
            res = self._next()
            if self._next() is not None:  # each query's results end with None
                raise psycopg.OperationalError("unexpected results in the pipeline")
            if res.status in _FAILED and error is None:
                error = res
            if kind is None:
                results.append(res)
            elif kind and res.status != pq.ExecStatus.COMMAND_OK:
                c.prepared.pop(kind, None)
        sync = self._next()
        if sync is None or sync.status != pq.ExecStatus.PIPELINE_SYNC:
            raise psycopg.OperationalError("the pipeline lost its sync")
        pg.exit_pipeline_mode()
        if error is not None:
            if pg.status != _OK:
                raise psycopg.OperationalError(pg.get_error_message() or "the connection was lost")
            raise pg_errors.error_from_result(error, encoding=self.conn.info.encoding)
        return results

    # -- waiting (switches to the task) ---------------------------------------

    def _flush(self) -> None:
        pg = self._c.pg
        while pg.flush():
            self._wait(_WRITE)

    def _next(self) -> pq.abc.PGresult | None:
        pg = self._c.pg
        while pg.is_busy():
            self._wait(_READ)
            pg.consume_input()  # the server closed the connection: OperationalError
        return pg.get_result()

    def _wait(self, what: object) -> None:
        if self.dead:
            raise _Discarded()
        self._parent.switch(what)

    # -- the Tx interface ------------------------------------------------------

    def _one_result(self, sql: str, params: Sequence[Any]) -> pq.abc.PGresult:
        (res,) = self._batch(((sql, params),))
        self.rowcount = res.command_tuples if res.command_tuples is not None else -1
        return res

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; returns (and keeps in ``rowcount``) the rows it changed."""
        self._one_result(sql, params)
        return self.rowcount

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Every row's statement in one round trip; ``rowcount``: all rows changed."""
        results = self._batch((sql, row) for row in rows)
        self.rowcount = sum(max(r.command_tuples or 0, 0) for r in results)

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        """The first row; all are fetched, so a ``RETURNING`` statement completes."""
        rows = self.all(sql, params)
        return rows[0] if rows else None

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        res = self._one_result(sql, params)
        if res.status != pq.ExecStatus.TUPLES_OK:
            return []
        tx = self._c.tx
        tx.set_pgresult(res)
        return tx.load_rows(0, res.ntuples, tuple)

    def command(self, sql: bytes) -> None:
        """A statement without parameters or rows (``COMMIT``, ``ROLLBACK``)."""
        if self._begin and sql in (b"COMMIT", b"ROLLBACK"):
            self._begin = False  # nothing was sent: nothing to end
            return
        self._batch(((sql.decode(), ()),))


class _CommitLost(Exception):
    """The connection broke while COMMIT was in flight: the outcome is unknown."""


class PgTrioExecutor:
    """A pool of non-blocking connections and the store's transactions over them, on the
    trio thread (see the module). Open with :meth:`open`, close with :meth:`aclose`.

    The same interface as the thread executor (:class:`.executor.PgExecutor`): ``run``,
    ``run_single``, ``run_sync`` (blocking, for start-up and close), ``reruns``;
    ``statements`` and ``round_trips`` count what was sent (figures)."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 8,
        statement_timeout_s: float = 30.0,
        lock_timeout_s: float = 10.0,
        connect_timeout_s: float = 10.0,
        retries: int = 5,
        application_name: str = "agentserver",
        options: Mapping[str, str] | None = None,
    ) -> None:
        if pool_size < 1 or retries < 0:
            raise ValueError("pool_size must be >= 1 and retries >= 0")
        self.url = url
        self.pool_size = pool_size
        self.retries = retries
        self.connect_timeout_s = connect_timeout_s
        self.reruns = 0
        #: [statements, round trips] sent, BEGIN/COMMIT included (figures; read by
        #: :attr:`statements` and :attr:`round_trips`).
        self._stats = [0, 0]
        self._slots = trio.Semaphore(pool_size)
        self._idle: list[PgConn] = []
        self._closed = False
        self._kwargs = PgExecutor.connection_kwargs(
            statement_timeout_s, lock_timeout_s, connect_timeout_s, application_name, options
        )

    @property
    def statements(self) -> int:
        return self._stats[0]

    @property
    def round_trips(self) -> int:
        return self._stats[1]

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    @classmethod
    async def open(cls, url: str, **kwargs: Any) -> PgTrioExecutor:
        """A started executor: its first connection is made (StoreError if it cannot be)."""
        return await trio.to_thread.run_sync(lambda: cls.open_sync(url, **kwargs))

    @classmethod
    def open_sync(cls, url: str, **kwargs: Any) -> PgTrioExecutor:
        """:meth:`open`, blocking the calling thread (start-up paths that are sync)."""
        ex = cls(url, **kwargs)
        try:
            ex._idle.append(ex._connect())
        except psycopg.Error as exc:
            raise StoreError(
                f"cannot connect to the agent store {redact(url)}: {redact_text(exc, url)}"
            ) from None
        return ex

    def _connect(self) -> PgConn:
        """A new connection (blocking: in a worker thread, or at start)."""
        return PgConn(psycopg.connect(self.url, **self._kwargs))

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close every idle connection; those in use are closed when their call ends.
        Idempotent."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    # -- the pool --------------------------------------------------------------

    async def _acquire(self) -> PgConn:
        with trio.move_on_after(self.connect_timeout_s):
            await self._slots.acquire()
            try:
                if self._idle:
                    return self._idle.pop()
                return await trio.to_thread.run_sync(self._connect)
            except BaseException:
                self._slots.release()
                raise
        raise StoreError(f"no connection to the agent store within {self.connect_timeout_s}s")

    def _release(self, c: PgConn) -> None:
        if c.clean and not self._closed:
            self._idle.append(c)
        else:
            c.close()
        self._slots.release()

    # -- transactions ----------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(tx, *args)`` in one transaction; its result, or its exception (psycopg's
        errors as :class:`StoreError`). Nothing of a transaction that raised, or was
        cancelled, is committed."""
        return await self._retrying(fn, args, True)

    async def run_single(self, fn: Callable[..., T], *args: Any) -> T:
        """Like :meth:`run` for a ``fn`` that reads, or runs one statement (atomic by
        itself): in autocommit, without ``BEGIN``/``COMMIT``."""
        return await self._retrying(fn, args, False)

    async def _retrying(self, fn: Callable[..., T], args: tuple, atomic: bool) -> T:
        attempt = 0
        while True:
            try:
                return await self._once(fn, args, atomic)
            except RETRYABLE as exc:
                if attempt >= self.retries:
                    raise StoreError(f"transaction failed {attempt + 1} times: {exc}") from exc
            except psycopg.OperationalError as exc:
                if attempt >= self.retries or not connection_lost(exc):
                    raise StoreError(redact_text(exc, self.url)) from exc
            except _CommitLost as exc:
                raise StoreError(
                    f"the connection to the agent store broke during COMMIT ({exc}); "
                    "the transaction may or may not have been committed"
                ) from None
            except psycopg.Error as exc:
                raise StoreError(redact_text(exc, self.url)) from exc
            attempt += 1
            self.reruns += 1
            await trio.sleep(random.uniform(0, 0.002 * 2**attempt))

    async def _once(self, fn: Callable[..., T], args: tuple, atomic: bool) -> T:
        c = await self._acquire()
        try:
            g = greenlet.greenlet(_body)
            tx = PgPipeTx(c, greenlet.getcurrent(), self._stats)
            what = g.switch(tx, fn, args, atomic)
            while not g.dead:
                try:
                    if what is _READ:
                        await trio.lowlevel.wait_readable(c.fd)
                    else:
                        await trio.lowlevel.wait_writable(c.fd)
                except BaseException:
                    # Cancelled (or interrupted) mid-call: the connection's state is
                    # unknown, so it goes (the server rolls back what was open on it),
                    # and the store function unwinds without another statement.
                    tx.dead = True
                    await self._discard(c)
                    if not g.dead:
                        try:
                            g.throw(_Discarded())
                        except _Discarded:
                            pass
                    raise
                what = g.switch()
            return what
        finally:
            self._release(c)

    async def _discard(self, c: PgConn) -> None:
        """Close a connection whose call was cancelled mid-statement: first ask the
        server to cancel what it runs (a backend busy in a statement or waiting for a
        lock would not notice the closed socket until it is done, and would hold its
        transaction open until then), then close. Bounded by ``CANCEL_TIMEOUT_S``."""
        cancel = c.pg.get_cancel() if c.pg.status == _OK else None
        if cancel is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(CANCEL_TIMEOUT_S):
                await trio.to_thread.run_sync(cancel.cancel, abandon_on_cancel=True)
        c.close()

    def run_sync(self, fn: Callable[..., T], *args: Any, atomic: bool = True) -> T:
        """:meth:`run` blocking the calling thread (start-up and close, when no trio
        task uses the executor): psycopg's blocking calls on an idle connection."""
        c = self._idle.pop() if self._idle else self._connect()
        ok = False
        try:
            tx = PgTx(c.conn, c.blocking_prepared)
            if not atomic:
                result = fn(tx, *args)
            else:
                tx.command(b"BEGIN")
                try:
                    result = fn(tx, *args)
                except BaseException:
                    if not c.conn.broken:
                        tx.command(b"ROLLBACK")
                    raise
                tx.command(b"COMMIT")
            ok = True
            return result
        except psycopg.Error as exc:
            raise StoreError(redact_text(exc, self.url)) from exc
        finally:
            if ok and c.clean and not self._closed:
                self._idle.append(c)
            else:
                c.close()


def _body(tx: PgPipeTx, fn: Callable[..., T], args: tuple, atomic: bool) -> T:
    """A transaction's greenlet: ``fn(tx, *args)`` between ``BEGIN`` and ``COMMIT``."""
    if not atomic:
        return fn(tx, *args)
    tx.begin()
    try:
        result = fn(tx, *args)
    except _Discarded:
        raise
    except BaseException:
        if not tx.dead and tx.conn.pgconn.status == _OK:
            try:
                tx.command(b"ROLLBACK")
            except psycopg.Error:
                tx.dead = True
        raise
    try:
        tx.command(b"COMMIT")
    except psycopg.OperationalError as exc:
        if tx.conn.pgconn.status != _OK:
            raise _CommitLost(str(exc)) from None
        raise
    return result
