"""Store transactions on PostgreSQL driven from the trio thread: no thread hops.

The store's functions are sync code over a :class:`~agentserver.agents.store.sql.db.Tx` (shared
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
from agentserver.agents.profile.store_url import redact, redact_text
from agentserver.agents.store.pg import executor as thread_executor
from agentserver.agents.store.pg.executor import (
    RETRYABLE,
    Later,
    PgExecutor,
    PgTx,
    connection_lost,
    to_pg,
)

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


class CommitLost(Exception):
    """The connection broke once ``COMMIT`` was sent, before its result came: the
    outcome is unknown."""


class PgPipeTx:
    """One transaction (or autocommit statements) on a :class:`PgConn`, from inside the
    greenlet of :meth:`PgTrioExecutor.run`: the store's Tx (``?`` placeholders).

    Writes are deferred: :meth:`execute` and :meth:`executemany` put their statements in
    the connection's pipeline and return at once; they go out with the next statement
    whose result is needed (:meth:`one`, :meth:`all`, reading :attr:`rowcount`) or with
    ``COMMIT``, all in one round trip ended by a sync. So a transaction costs a round trip
    per read (or rowcount checked) plus one, and an error of a deferred write is raised
    by the next round trip (the whole call fails and rolls back all the same: the store
    functions never catch a database error to carry on).

    Reads can wait too: :meth:`later` queues one whose rows the function reads once a
    later round trip is back, and :meth:`last` sends the transaction's last statement
    with its ``COMMIT``; a store call written with them alone (agents/store/pg/one_trip.py)
    costs one round trip."""

    __slots__ = (
        "_begin",
        "_c",
        "_ended",
        "_group",
        "_in_tx",
        "_parent",
        "_pending",
        "_rowcount",
        "_stats",
        "dead",
    )

    @property
    def sent(self) -> tuple[int, int]:
        """The statements (``BEGIN``/``COMMIT`` included) and round trips so far."""
        return self._stats[0], self._stats[1]

    dialect = "postgresql"

    def __init__(self, c: PgConn, parent: greenlet.greenlet) -> None:
        self._c = c
        self._parent = parent
        #: [statements, round trips] this call sent (the executor adds them up)
        self._stats = [0, 0]
        self._begin = False
        #: BEGIN was asked for (sent or not): :meth:`last` ends the transaction
        self._in_tx = False
        #: :meth:`last` committed: no statement may follow, ``commit`` has nothing to do
        self._ended = False
        #: per result due before the next sync: the key of a prepare (forgotten if it
        #: fails), () for BEGIN, the group number of a statement, or the :class:`Later`
        #: that wants its rows
        self._pending: list[tuple | int | Later] = []
        #: the group of the last execute/executemany (its rows make ``rowcount``)
        self._group = 0
        self._rowcount: int | None = 0
        #: Set once the connection is discarded: no statement may be sent any more.
        self.dead = False

    @property
    def conn(self) -> psycopg.Connection:
        return self._c.conn

    def begin(self) -> None:
        """Open the transaction with the next statement (no round trip of its own)."""
        self._begin = True
        self._in_tx = True

    @property
    def rowcount(self) -> int:
        """The rows changed by the last :meth:`execute` (all rows of the last
        :meth:`executemany`): waits for them."""
        if self._rowcount is None:
            self._sync()
        return self._rowcount if self._rowcount is not None else -1

    # -- sending -----------------------------------------------------------------

    def _send(self, sql: str, params: Sequence[Any], group: int | Later) -> None:
        """Queue one statement in the pipeline (prepared first if new on the
        connection; ``BEGIN`` first if due)."""
        if self.dead:
            raise _Discarded()
        if self._ended:
            raise RuntimeError("a statement after the transaction's last one")
        c = self._c
        pg = c.pg
        if pg.pipeline_status == pq.PipelineStatus.OFF:
            pg.enter_pipeline_mode()
        if self._begin:
            pg.send_query_params(b"BEGIN", None)
            self._pending.append(())
            self._begin = False
            self._stats[0] += 1
        self._stats[0] += 1
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
                self._pending.append(group)
                return
            name = b"at%d" % c.names
            c.names += 1
            pg.send_prepare(name, to_pg(sql), types)
            c.prepared[key] = name
            self._pending.append(key)
        pg.send_query_prepared(name, args, formats, pq.Format.TEXT)
        self._pending.append(group)

    def _sync(self, commit: bool = False) -> pq.abc.PGresult | None:
        """Send a sync and wait for every result due: the last one's (None if none was
        due). Raises the first error among them (psycopg's, typed), once the pipeline
        is past the sync; with ``commit`` (the last result is ``COMMIT``'s),
        :class:`CommitLost` if the connection broke with ``COMMIT`` maybe done."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        c = self._c
        pg = c.pg
        pg.pipeline_sync()
        self._stats[1] += 1
        group = self._group
        rows = 0
        error: pq.abc.PGresult | None = None
        last: pq.abc.PGresult | None = None
        try:
            self._flush()
            for kind in pending:
                res = self._next()
                if self._next() is not None:  # each query's results end with None
                    raise psycopg.OperationalError("unexpected results in the pipeline")
                if res is None:
                    raise psycopg.OperationalError("a result is missing in the pipeline")
                status = res.status
                if status in _FAILED and error is None:
                    error = res
                if type(kind) is tuple:
                    if kind and status != pq.ExecStatus.COMMAND_OK:
                        c.prepared.pop(kind, None)
                elif type(kind) is Later:
                    if status == pq.ExecStatus.TUPLES_OK:
                        c.tx.set_pgresult(res)
                        kind.set(c.tx.load_rows(0, res.ntuples, tuple))
                elif kind == group and status != pq.ExecStatus.PIPELINE_ABORTED:
                    rows += max(res.command_tuples or 0, 0)
                last = res
            sync = self._next()
            if sync is None or sync.status != pq.ExecStatus.PIPELINE_SYNC:
                raise psycopg.OperationalError("the pipeline lost its sync")
        except psycopg.OperationalError:
            if commit and error is None:
                # No earlier statement failed: the server may have run COMMIT.
                raise CommitLost(pg.get_error_message() or "the connection was lost") from None
            if error is not None:
                self._raise(error)
            raise
        pg.exit_pipeline_mode()
        self._rowcount = rows
        if error is not None:  # (after the sync: the connection is ready for ROLLBACK)
            self._raise(error)
        return last

    def _raise(self, error: pq.abc.PGresult) -> None:
        if self._c.pg.status != _OK:
            raise psycopg.OperationalError(
                error.error_message.decode(errors="replace") or "the connection was lost"
            )
        raise pg_errors.error_from_result(error, encoding=self.conn.info.encoding)

    # -- waiting (switches to the task) ---------------------------------------

    def _flush(self) -> None:
        pg = self._c.pg
        while pg.flush():
            # The server may be stuck writing results we have not read while we wait to
            # write (a long batch): read what came before each wait (libpq's advice).
            pg.consume_input()
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

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Queue one statement (see the class); :attr:`rowcount` waits for its count."""
        self._group += 1
        self._rowcount = None
        self._send(sql, params, self._group)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Queue the statement once per row; :attr:`rowcount`: all rows changed."""
        self._group += 1
        self._rowcount = None
        for row in rows:
            self._send(sql, row, self._group)

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        """The first row; all are fetched, so a ``RETURNING`` statement completes."""
        rows = self.all(sql, params)
        return rows[0] if rows else None

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The statement's rows (every deferred write before it goes out with it)."""
        self._group += 1
        self._send(sql, params, self._group)
        res = self._sync()
        if res is None or res.status != pq.ExecStatus.TUPLES_OK:
            return []
        tx = self._c.tx
        tx.set_pgresult(res)
        return tx.load_rows(0, res.ntuples, tuple)

    def later(self, sql: str, params: Sequence[Any] = ()) -> Later:
        """Queue a read like a deferred write: its rows (:attr:`Later.rows`) are there
        once the next round trip is back (a read, :attr:`rowcount`, :meth:`last`,
        ``COMMIT``). Its error, if any, is raised by that round trip."""
        later = Later()
        self._send(sql, params, later)
        return later

    def last(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The call's last statement: in a transaction, sent with ``COMMIT`` (and every
        deferred statement) in one round trip; its rows. Nothing may be sent after it;
        if any statement fails, nothing is committed (the pipeline skips ``COMMIT``)."""
        later = Later()
        self._send(sql, params, later)
        if not self._in_tx:
            self._sync()
            return later.rows
        self._group += 1
        self._send("COMMIT", (), self._group)
        self._sync(commit=True)
        self._ended = True
        return later.rows

    def end(self) -> None:
        """Commit now, with every deferred statement, in one round trip (autocommit: wait
        for them), so their errors are raised here, inside the store function; nothing
        may be sent after."""
        if not self._in_tx:
            self._sync()
            return
        if self._begin:  # nothing was sent
            self._begin = False
            return
        if self._ended:
            return
        self._group += 1
        self._send("COMMIT", (), self._group)
        self._sync(commit=True)
        self._ended = True

    def finish(self) -> None:
        """Wait for every deferred statement (the end of an autocommit call)."""
        self._sync()

    def commit(self) -> None:
        """``COMMIT``, with every deferred statement before it, in one round trip."""
        if self._begin:  # nothing was sent: nothing to end
            self._begin = False
            return
        if self._ended:  # committed with its last statement
            return
        self._group += 1
        self._send("COMMIT", (), self._group)
        self._sync(commit=True)

    def rollback(self) -> None:
        """``ROLLBACK`` (deferred statements not yet sent are dropped with it); nothing
        once :meth:`last` committed."""
        if self._ended:
            return
        if self._begin:
            self._begin = False
            return
        self._group += 1
        self._send("ROLLBACK", (), self._group)
        try:
            self._sync()
        except psycopg.DatabaseError:  # an earlier deferred statement's error
            pass
        if self._c.pg.transaction_status == pq.TransactionStatus.INERROR:
            # The error aborted the pipeline's ROLLBACK too: again, on its own.
            self._send("ROLLBACK", (), self._group)
            self._sync()


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
        #: Called after each call (each attempt) with the function and its arguments,
        #: and the statements and round trips it sent (a bench's per-call figures).
        self.on_call: Callable[[Callable, tuple, int, int], None] | None = None
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
        """Close every idle connection; those in use are closed when their call ends,
        and later calls raise :class:`StoreError`. Idempotent."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    # -- the pool --------------------------------------------------------------

    async def _acquire(self) -> PgConn:
        if self._closed:
            raise StoreError("the agent store is closed")
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
            except CommitLost as exc:
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
        tx: PgPipeTx | None = None
        try:
            g = greenlet.greenlet(_body)
            tx = PgPipeTx(c, greenlet.getcurrent())
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
            if tx is not None:
                statements, trips = tx.sent
                self._stats[0] += statements
                self._stats[1] += trips
                if self.on_call is not None:
                    self.on_call(fn, args, statements, trips)

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
        if self._closed:
            raise StoreError("the agent store is closed")
        try:
            c = self._idle.pop() if self._idle else self._connect()
        except psycopg.Error as exc:
            raise StoreError(redact_text(exc, self.url)) from exc
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
    """A transaction's greenlet: ``fn(tx, *args)`` between ``BEGIN`` and ``COMMIT`` (or,
    not ``atomic``, then every deferred statement waited for)."""
    if not atomic:
        result = fn(tx, *args)
        tx.finish()
        return result
    tx.begin()
    try:
        result = fn(tx, *args)
    except _Discarded:
        raise
    except BaseException:
        _roll_back(tx)
        raise
    try:
        tx.commit()
    except (_Discarded, CommitLost):
        raise
    except BaseException:
        # A deferred statement failed: the transaction is aborted, not ended.
        _roll_back(tx)
        raise
    return result


def _roll_back(tx: PgPipeTx) -> None:
    if tx.dead or tx.conn.pgconn.status != _OK:
        return
    try:
        tx.rollback()
    except psycopg.Error:
        tx.dead = True  # the connection is not clean: _release closes it
