"""Figures of the agent store for the metrics, read when the registry is scraped.

A separate read-only SQLite connection (the store runs in WAL mode, so a reader never
blocks its writer); each query is one short indexed read, so the worker's path is not
touched at all.
"""

from __future__ import annotations

import pathlib
import sqlite3

from agentserver.agents.clock import Clock
from agentserver.agents.states import InboxStatus, MessageType

#: A Turn row still waiting for the worker: queued behind a running Turn, or leased and
#: not yet taken (a busy worker, or a retry after a failed claim).
_WAITING = (InboxStatus.QUEUED.value, InboxStatus.PENDING.value)


class StoreFigures:
    def __init__(self, path: str | pathlib.Path, clock: Clock) -> None:
        self.clock = clock
        uri = pathlib.Path(path).resolve().as_uri() + "?mode=ro"
        self._db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA busy_timeout = 100")

    def close(self) -> None:
        self._db.close()

    def inbox_lag(self) -> dict[str, float]:
        """Agent → age in seconds of its oldest task not yet started (agents with none
        are absent)."""
        now = self.clock.now()
        rows = self._db.execute(
            "SELECT agent_id, min(created_at) FROM agent_inbox WHERE status IN (?, ?) "
            "AND message_type = ? GROUP BY agent_id",
            (*_WAITING, MessageType.TURN.value),
        ).fetchall()
        return {agent: max(0.0, now - oldest) for agent, oldest in rows}

    def approvals_pending(self) -> dict[str, int]:
        """Agent → approval requests waiting for a decision (agents with none absent)."""
        rows = self._db.execute(
            "SELECT agent_id, count(*) FROM approvals WHERE status = 'pending' GROUP BY agent_id"
        ).fetchall()
        return dict(rows)
