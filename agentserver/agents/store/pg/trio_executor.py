"""Store transactions on PostgreSQL driven from the trio thread: no thread hops. This
module is the pool; the libpq pipeline one transaction runs on is :mod:`.pipe`.

The store's functions are sync code over a :class:`~agentserver.agents.store.sql.db.Tx`
(shared with SQLite). :class:`PgTrioExecutor` runs each one in a greenlet on the trio
thread over a :class:`~.pipe.PgPipeTx`; when the transaction must wait for the socket,
its greenlet switches back here, and the calling task awaits
``trio.lowlevel.wait_readable``/``wait_writable`` and switches in again.

Bounded: at most ``pool_size`` transactions are in flight (a ``trio.Semaphore``; a caller
waits at most ``connect_timeout_s`` for a connection, then :class:`StoreError`); each
statement by the server's ``statement_timeout``/``lock_timeout`` (:class:`~.config.PgConfig`,
the thread executor's too).

Cancel: a store call cancelled while it waits on the server sends the server a cancel
request (a worker thread, shielded, at most :data:`CANCEL_TIMEOUT_S`), discards its
connection (closed: the server ends the backend and rolls back whatever was open on it)
and unwinds the greenlet; the cancel is raised to the caller. A transaction is never left
open, and a connection is never reused in an unknown state. A cancel that lands while
``COMMIT`` is in flight leaves the outcome unknown to this process, like a crash at that
point (the store's epoch fencing and recovery are built for that).

Retries: the one retry loop of :mod:`.retry`, shared with the thread executor (a
serialization failure, a deadlock or a connection lost before ``COMMIT`` runs the
transaction again, bounded, with a short random backoff).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import greenlet
import psycopg
import trio
from psycopg import pq

from agentserver.agents.errors import StoreError
from agentserver.agents.profile.store_url import redact, redact_text
from agentserver.agents.store.pg.config import PgConfig
from agentserver.agents.store.pg.executor import PgTx
from agentserver.agents.store.pg.pipe import READ, Discarded, PgConn, PgPipeTx
from agentserver.agents.store.pg.retry import CommitLost, run_retrying

T = TypeVar("T")

_OK = pq.ConnStatus.OK

#: The longest a cancelled call waits for its cancel request to reach the server (s).
CANCEL_TIMEOUT_S = 2.0


class PgTrioExecutor:
    """A pool of non-blocking connections and the store's transactions over them, on the
    trio thread (see the module). Open with :meth:`open`, close with :meth:`aclose`.

    The same interface as the thread executor (:class:`.executor.PgExecutor`): ``run``,
    ``run_single``, ``run_sync`` (blocking, for start-up and close), ``reruns``;
    ``statements`` and ``round_trips`` count what was sent (figures)."""

    def __init__(self, config: PgConfig) -> None:
        self.config = config
        self.url = config.url
        self.pool_size = config.pool_size
        self.reruns = 0
        #: [statements, round trips] sent, BEGIN/COMMIT included (figures; read by
        #: :attr:`statements` and :attr:`round_trips`).
        self._stats = [0, 0]
        #: Called after each call (each attempt) with the function and its arguments,
        #: and the statements and round trips it sent (a bench's per-call figures).
        self.on_call: Callable[[Callable, tuple, int, int], None] | None = None
        self._slots = trio.Semaphore(config.pool_size)
        self._idle: list[PgConn] = []
        self._closed = False
        self._kwargs = config.connection_kwargs()

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
        """:meth:`open`, blocking the calling thread (start-up paths that are sync);
        ``kwargs`` are :class:`~.config.PgConfig`'s."""
        ex = cls(PgConfig(url, **kwargs))
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
        with trio.move_on_after(self.config.connect_timeout_s):
            await self._slots.acquire()
            try:
                if self._idle:
                    return self._idle.pop()
                return await trio.to_thread.run_sync(self._connect)
            except BaseException:
                self._slots.release()
                raise
        raise StoreError(
            f"no connection to the agent store within {self.config.connect_timeout_s}s"
        )

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
        return await run_retrying(self.config, lambda: self._once(fn, args, atomic), self._rerun)

    def _rerun(self) -> None:
        self.reruns += 1

    async def _once(self, fn: Callable[..., T], args: tuple, atomic: bool) -> T:
        c = await self._acquire()
        tx: PgPipeTx | None = None
        try:
            g = greenlet.greenlet(_body)
            tx = PgPipeTx(c, greenlet.getcurrent())
            what = g.switch(tx, fn, args, atomic)
            while not g.dead:
                try:
                    if what is READ:
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
                            g.throw(Discarded())
                        except Discarded:
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
    except Discarded:
        raise
    except BaseException:
        _roll_back(tx)
        raise
    try:
        tx.commit()
    except (Discarded, CommitLost):
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
