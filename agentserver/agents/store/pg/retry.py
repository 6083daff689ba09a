"""The PostgreSQL store executors' one retry loop: which failures run a transaction
again, how often, after what pause, and what the caller sees otherwise.

A serialization failure or a deadlock rolled the transaction back, so it runs again; so
does one whose connection was lost before ``COMMIT`` was sent (the server rolled it back;
it runs on a new connection). One lost once ``COMMIT`` was sent may or may not have
committed (:class:`CommitLost`): it is never run again. At most ``retries`` reruns
(:class:`~.config.PgConfig`), each after a short random pause that doubles. Every other
database error is raised as :class:`~agentserver.agents.errors.StoreError` (the URL's
password redacted); errors that are not the database's (the store functions' own:
``StaleTurn``, a one-trip ``Missed``, ...) go through untouched.

The executors differ only in how they wait: :func:`run_retrying` (the trio one's, and the
thread one's calls from trio) pauses with ``trio.sleep``; :func:`run_retrying_sync` (the
thread executor's worker threads and start-up) with ``time.sleep``. Both go through
:meth:`Reruns.failed`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg
import trio
from psycopg import errors as pg_errors

from agentserver.agents.errors import StoreError
from agentserver.agents.profile.store_url import redact_text
from agentserver.agents.store.pg.config import PgConfig

T = TypeVar("T")

#: The errors after which running the same transaction again is correct.
RETRYABLE = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)


class CommitLost(Exception):
    """The connection broke once ``COMMIT`` was sent, before its result came: the
    outcome is unknown."""


#: What an attempt may raise that the loop decides on (anything else goes through).
DECIDED = (psycopg.Error, CommitLost)


def connection_lost(exc: psycopg.OperationalError) -> bool:
    """Whether ``exc`` says the connection is gone (not a timeout or a refusal by the
    server, which are OperationalErrors too)."""
    if isinstance(exc, pg_errors.QueryCanceled | pg_errors.LockNotAvailable):
        return False
    return exc.sqlstate is None or exc.sqlstate.startswith(("08", "57P"))


class Reruns:
    """One call's attempts so far (a new one per call); :meth:`failed` decides."""

    __slots__ = ("attempt", "config")

    def __init__(self, config: PgConfig) -> None:
        self.config = config
        self.attempt = 0

    def failed(self, exc: Exception) -> float:
        """The pause (s) before the next attempt, after ``exc`` (one of :data:`DECIDED`);
        or raises :class:`StoreError` (from ``exc``) when the transaction must not run
        again. Call it in the ``except`` clause that caught ``exc``."""
        attempt = self.attempt
        url = self.config.url
        if isinstance(exc, RETRYABLE):
            if attempt >= self.config.retries:
                raise StoreError(f"transaction failed {attempt + 1} times: {exc}") from exc
        elif isinstance(exc, psycopg.OperationalError):
            # Lost before COMMIT: the server rolled it back. Anything else is real.
            if attempt >= self.config.retries or not connection_lost(exc):
                raise StoreError(redact_text(exc, url)) from exc
        elif isinstance(exc, CommitLost):
            raise StoreError(
                f"the connection to the agent store broke during COMMIT ({exc}); "
                "the transaction may or may not have been committed"
            ) from None
        else:
            raise StoreError(redact_text(exc, url)) from exc
        self.attempt = attempt = attempt + 1
        return random.uniform(0, 0.002 * 2**attempt)


async def run_retrying(
    config: PgConfig, once: Callable[[], Awaitable[T]], on_rerun: Callable[[], None]
) -> T:
    """``await once()`` until it returns, run again as :class:`Reruns` decides (calling
    ``on_rerun`` before each rerun). Cancel: between attempts, the pause is cancelled;
    during one, as ``once`` is."""
    reruns = Reruns(config)
    while True:
        try:
            return await once()
        except DECIDED as exc:
            pause = reruns.failed(exc)
        on_rerun()
        await trio.sleep(pause)


def run_retrying_sync(config: PgConfig, once: Callable[[], T], on_rerun: Callable[[], None]) -> T:
    """:func:`run_retrying` blocking the calling thread (a worker thread, or start-up):
    the same decisions, the pause slept."""
    reruns = Reruns(config)
    while True:
        try:
            return once()
        except DECIDED as exc:
            pause = reruns.failed(exc)
        on_rerun()
        time.sleep(pause)
