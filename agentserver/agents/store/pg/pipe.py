"""One PostgreSQL connection driven through libpq's non-blocking pipeline, from a
greenlet on the trio thread: :class:`PgConn` (a pooled connection and its prepared
statements) and :class:`PgPipeTx` (the store's Tx over it: statements queued in the
pipeline, sent together with the next read, ``COMMIT``, or :meth:`PgPipeTx.last`).

psycopg's ``pgconn`` does the protocol (``send_query_prepared``, ``pipeline_sync``,
``flush``, ``consume_input``, ``is_busy``, ``get_result``); to wait for the socket the
transaction's greenlet switches to its task (:data:`READ`, :data:`WRITE`), which awaits
it (:mod:`.trio_executor`, the pool, does) and switches back. No thread, no GIL hand-over
per statement; psycopg's ``Transformer`` adapts the values as the thread executor's
:class:`~.executor.PgTx` does (the same Python types in and out).

Round trips: ``BEGIN`` is not sent alone but in front of the transaction's first
statement, a statement seen for the first time on a connection is prepared in the same
round trip as its first execution, and ``executemany`` sends all its rows at once, so a
transaction of n statements costs n + 1 round trips (its ``COMMIT`` the last) and a read
in autocommit one.

Atomic: what a :class:`PgPipeTx` sends between ``BEGIN`` and ``COMMIT`` commits whole or
not at all (a failed statement makes the pipeline skip the rest). Cancel: the pool marks
the transaction :attr:`PgPipeTx.dead` and throws :class:`Discarded` into its greenlet,
which sends nothing more; a connection lost while ``COMMIT`` is in flight is
:class:`~.retry.CommitLost`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import greenlet
import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer

from agentserver.agents.store.pg.executor import MAX_PREPARED, Later, to_pg
from agentserver.agents.store.pg.retry import CommitLost
from agentserver.agents.store.sql.db import Row, SqlValue

_FAILED = (pq.ExecStatus.FATAL_ERROR, pq.ExecStatus.BAD_RESPONSE, pq.ExecStatus.NONFATAL_ERROR)
_OK = pq.ConnStatus.OK
_IDLE = pq.TransactionStatus.IDLE

#: What a transaction's greenlet asks its task to wait for (by switching to it).
READ = object()
WRITE = object()


class Discarded(BaseException):
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
    greenlet of :meth:`~.trio_executor.PgTrioExecutor.run`: the store's Tx (``?`` placeholders).

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

    def _send(self, sql: str, params: Sequence[SqlValue], group: int | Later) -> None:
        """Queue one statement in the pipeline (prepared first if new on the
        connection; ``BEGIN`` first if due)."""
        if self.dead:
            raise Discarded()
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
            if len(c.prepared) >= MAX_PREPARED:
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
            self._wait(WRITE)

    def _next(self) -> pq.abc.PGresult | None:
        pg = self._c.pg
        while pg.is_busy():
            self._wait(READ)
            pg.consume_input()  # the server closed the connection: OperationalError
        return pg.get_result()

    def _wait(self, what: object) -> None:
        if self.dead:
            raise Discarded()
        self._parent.switch(what)

    # -- the Tx interface ------------------------------------------------------

    def execute(self, sql: str, params: Sequence[SqlValue] = ()) -> None:
        """Queue one statement (see the class); :attr:`rowcount` waits for its count."""
        self._group += 1
        self._rowcount = None
        self._send(sql, params, self._group)

    def executemany(self, sql: str, rows: Iterable[Sequence[SqlValue]]) -> None:
        """Queue the statement once per row; :attr:`rowcount`: all rows changed."""
        self._group += 1
        self._rowcount = None
        for row in rows:
            self._send(sql, row, self._group)

    def one(self, sql: str, params: Sequence[SqlValue] = ()) -> Row | None:
        """The first row; all are fetched, so a ``RETURNING`` statement completes."""
        rows = self.all(sql, params)
        return rows[0] if rows else None

    def all(self, sql: str, params: Sequence[SqlValue] = ()) -> list[Row]:
        """The statement's rows (every deferred write before it goes out with it)."""
        self._group += 1
        self._send(sql, params, self._group)
        res = self._sync()
        if res is None or res.status != pq.ExecStatus.TUPLES_OK:
            return []
        tx = self._c.tx
        tx.set_pgresult(res)
        return tx.load_rows(0, res.ntuples, tuple)

    def later(self, sql: str, params: Sequence[SqlValue] = ()) -> Later:
        """Queue a read like a deferred write: its rows (:attr:`Later.rows`) are there
        once the next round trip is back (a read, :attr:`rowcount`, :meth:`last`,
        ``COMMIT``). Its error, if any, is raised by that round trip."""
        later = Later()
        self._send(sql, params, later)
        return later

    def last(self, sql: str, params: Sequence[SqlValue] = ()) -> list[Row]:
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
