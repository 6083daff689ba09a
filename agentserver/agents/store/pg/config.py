"""The PostgreSQL store executors' one configuration (:class:`PgConfig`): where the
database is, the pool's size, the server-side bounds every connection is opened with,
and how often a transaction may run again. Both executors (:mod:`.trio_executor`, the
default, and :mod:`.executor`, the threads' fallback) are built from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class PgConfig:
    """An executor's settings, fixed for its life.

    ``pool_size`` bounds the transactions in flight (and the connections);
    ``statement_timeout_s`` any one statement, on the server; ``lock_timeout_s`` any wait
    for a row lock (a claim uses ``SKIP LOCKED`` and never waits); ``connect_timeout_s``
    the wait for a free connection or a new one; ``retries`` the reruns of one
    transaction (:mod:`.retry`). ``options`` are more server settings (``-c name=value``;
    names and values are the store's own, without spaces)."""

    url: str
    pool_size: int = 8
    statement_timeout_s: float = 30.0
    lock_timeout_s: float = 10.0
    connect_timeout_s: float = 10.0
    retries: int = 5
    application_name: str = "agentserver"
    options: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pool_size < 1 or self.retries < 0:
            raise ValueError("pool_size must be >= 1 and retries >= 0")

    def connection_kwargs(self) -> dict[str, Any]:
        """``psycopg.connect``'s keywords for a store connection: autocommit (``BEGIN``
        and ``COMMIT`` are sent where needed), the server-side timeouts."""
        settings = (
            f"-c statement_timeout={round(self.statement_timeout_s * 1000)} "
            f"-c lock_timeout={round(self.lock_timeout_s * 1000)} "
            # A process that dies mid-transaction must not hold its locks for long.
            f"-c idle_in_transaction_session_timeout={round(self.statement_timeout_s * 2000)}"
        )
        for name, value in self.options.items():
            settings += f" -c {name}={value}"
        return {
            "autocommit": True,
            "options": settings,
            "application_name": self.application_name,
            "connect_timeout": max(1, round(self.connect_timeout_s)),
        }
