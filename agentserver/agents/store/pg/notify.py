"""The doorbell across processes: PostgreSQL ``LISTEN``/``NOTIFY``, waited on by trio.

A notification only says "something changed on this channel"; it never carries data (the
tables are the truth, and a notification can be lost: across a reconnect, or when the
listening connection is down). So the listener rings its callbacks

- on every notification (after draining all that arrived),
- every ``poll_s`` seconds without one (the backstop for lost notifications),
- after each (re)connection (anything may have changed while it was down).

The listening connection is autocommit and is waited on with
``trio.lowlevel.wait_readable(conn.fileno())`` on the trio thread (no thread is held);
only connecting runs in a worker thread. Senders call :func:`notify` inside their
transaction: PostgreSQL delivers it at COMMIT (never for a rolled-back one) and merges
duplicates of one transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import psycopg
import trio
from psycopg import pq, sql

from agentserver.agents.profile.store_url import redact, redact_text
from agentserver.agents.store.sql.db import Tx

log = logging.getLogger(__name__)

#: Turns of some agent may be due (new inbox rows, a lease released or expired).
WAKE_CHANNEL = "agentserver_wake"
#: A reply was kept for a named client (the process holding its connection offers it).
CLIENT_REPLIES_CHANNEL = "agentserver_client_replies"
#: A reply waits for an anonymous caller connected to some process (pg/callers.py).
REPLIES_CHANNEL = "agentserver_replies"


def notify(tx: Tx, channel: str) -> None:
    """Ring ``channel`` when the transaction of ``tx`` commits (no payload)."""
    tx.execute("SELECT pg_notify(?, '')", (channel,))


def _drain(pgconn: pq.abc.PGconn) -> set[str]:
    """The channels of every notification that arrived on ``pgconn`` (readable), read
    without blocking straight from libpq: psycopg's ``notifies(timeout=0)`` went through
    its generator and wait machinery, about 0.7 ms of the trio thread per wake-up.
    Raises ``psycopg.OperationalError`` when the connection is gone."""
    pgconn.consume_input()  # at end of stream: OperationalError
    if pgconn.status == pq.ConnStatus.BAD:
        raise psycopg.OperationalError("the listening connection closed")
    channels = set()
    while (n := pgconn.notifies()) is not None:
        channels.add(n.relname.decode())
    return channels


class PgListener:
    """``LISTEN`` on each channel of ``callbacks``; call its callback when it rings.

    Run :meth:`run` in a nursery; it returns only when cancelled. Callbacks run on the
    trio thread and must not block (e.g. :meth:`Doorbell.ring`)."""

    def __init__(
        self,
        url: str,
        callbacks: Mapping[str, Callable[[], None]],
        *,
        poll_s: float = 1.0,
        reconnect_s: float = 1.0,
        on_poll: Iterable[Callable[[], None]] | None = None,
    ) -> None:
        if not callbacks:
            raise ValueError("PgListener needs at least one channel")
        self.url = url
        self.callbacks = dict(callbacks)
        self.poll_s = poll_s
        #: What a poll (no notification) calls: ``on_poll``, else every channel's callback.
        self.on_poll = tuple(on_poll) if on_poll is not None else tuple(self.callbacks.values())
        self.reconnect_s = reconnect_s
        #: (re)connections made and notifications received (figures; tests read them)
        self.connections = 0
        self.received = 0
        self._conn: psycopg.Connection | None = None

    def _poll(self) -> None:
        for callback in self.on_poll:
            callback()

    def _ring(self, channels: Iterable[str]) -> None:
        for channel in channels:
            callback = self.callbacks.get(channel)
            if callback is not None:
                callback()

    def _connect(self) -> psycopg.Connection:
        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=10)
        try:
            for channel in self.callbacks:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            conn.close()
            raise
        return conn

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; ``task_status.started()`` once the first LISTEN is in
        place (so nothing committed after that is missed)."""
        started = False
        try:
            while True:
                try:
                    self._conn = await trio.to_thread.run_sync(self._connect)
                except psycopg.Error as exc:
                    log.warning(
                        "store doorbell: cannot listen on %s (%s); retrying in %ss",
                        redact(self.url),
                        redact_text(exc, self.url),
                        self.reconnect_s,
                    )
                    self._poll()  # meanwhile, behave as a poll
                    await trio.sleep(self.reconnect_s)
                    continue
                self.connections += 1
                if not started:
                    started = True
                    task_status.started()
                self._poll()
                try:
                    await self._listen(self._conn)
                except psycopg.Error as exc:
                    log.warning(
                        "store doorbell: connection lost (%s); reconnecting",
                        redact_text(exc, self.url),
                    )
                finally:
                    conn, self._conn = self._conn, None
                    conn.close()
                await trio.sleep(self.reconnect_s / 10)
        finally:
            if self._conn is not None:
                self._conn.close()

    async def _listen(self, conn: psycopg.Connection) -> None:
        while True:
            with trio.move_on_after(self.poll_s) as poll:
                await trio.lowlevel.wait_readable(conn.fileno())
            if poll.cancelled_caught:
                self._poll()
                continue
            channels = _drain(conn.pgconn)
            self.received += len(channels)
            self._ring(channels)

    @property
    def backend_pid(self) -> int | None:
        """The server process of the listening connection (None while down)."""
        return self._conn.info.backend_pid if self._conn is not None else None
