"""Fair share between clients in front of an agent (``<store fair-share="true">``;
docs/budgets.md, "Fair share"): which queued Turn an idle agent leases next.

Start-time fair queueing by client, kept in the store (``fair_share``): each client has a
virtual finish tag, the agent a virtual time ``V`` (the start tag of the Turn it leased
last). The next Turn is the oldest queued one of the client whose start tag
``max(V, finish)`` is smallest (ties: the oldest row); leasing it sets ``V`` to that start
and the client's finish to ``start + 1/weight``. So a client that has just been served
starts one share later than one that has not: a client flooding the agent with 1,000
tasks delays another client's next task by at most the Turn running when it arrives
(one Turn per worker: an agent runs one Turn at a time). Within one client, the oldest
first (FIFO, as without fair share). Bounded: one row per (agent, client) that ever
queued a task, plus one per agent. Anonymous callers share one client (``""``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentserver.agents.store.sql.db import POSTGRESQL, StoreEnv, Tx, locking
from agentserver.agents.store.states import InboxStatus

MIGRATION = """
CREATE TABLE fair_share (
    agent_id TEXT NOT NULL,
    client TEXT NOT NULL,
    vfinish REAL NOT NULL,
    PRIMARY KEY (agent_id, client)
);
"""

#: The agent's own row in ``fair_share``: its virtual time.
AGENT_CLOCK = "#v"


def _client_expr(dialect: str) -> str:
    if dialect == POSTGRESQL:
        return "coalesce(CAST(reply_ref AS jsonb) ->> 'client', '')"
    return "coalesce(json_extract(reply_ref, '$.client'), '')"


def next_queued(tx: Tx, env: StoreEnv, agent_id: str) -> Sequence[Any] | None:
    """The queued Turn ``agent_id`` leases next, fairly (a row of ``head.QUEUED_NEXT``'s
    shape), with the tags moved as if it is leased: call inside the lease's transaction
    (a lease that then fails rolls them back with it)."""
    weights = dict(env.settings.fair_weights or ())
    while True:
        firsts = tx.all(
            f"SELECT {_client_expr(tx.dialect)} AS c, min(seq) FROM agent_inbox"
            " WHERE agent_id = ? AND status = ? GROUP BY c",
            (agent_id, InboxStatus.QUEUED),
        )
        if not firsts:
            return None
        tags = {
            str(c): float(v)
            for c, v in tx.all(
                "SELECT client, vfinish FROM fair_share WHERE agent_id = ?", (agent_id,)
            )
        }
        now_v = tags.get(AGENT_CLOCK, 0.0)
        start, seq, client = min(
            (max(now_v, tags.get(str(c), 0.0)), int(s), str(c)) for c, s in firsts
        )
        # Locked and read again (PostgreSQL): a double text of another process may have
        # taken it out of the queue since (docs/runs.md); then choose again.
        row = tx.one(
            "SELECT inbox_id, payload, conversation FROM agent_inbox WHERE seq = ? "
            f"AND status = ?{locking(tx)}",
            (seq, InboxStatus.QUEUED),
        )
        if row is not None:
            break
    weight = weights.get(client, 1.0)
    for key, value in ((client, start + 1.0 / weight), (AGENT_CLOCK, start)):
        tx.execute(
            "INSERT INTO fair_share (agent_id, client, vfinish) VALUES (?, ?, ?)"
            " ON CONFLICT (agent_id, client) DO UPDATE SET vfinish = excluded.vfinish",
            (agent_id, key, value),
        )
    return row
