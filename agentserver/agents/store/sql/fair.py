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

from agentserver.agents.store.sql.db import POSTGRESQL, Row, StoreEnv, Tx
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


def next_queued(tx: Tx, env: StoreEnv, agent_id: str) -> Row | None:
    """The queued Turn ``agent_id`` leases next, fairly (a row of ``head.QUEUED_NEXT``'s
    shape), with the tags moved as if it is leased: call inside the lease's transaction
    (a lease that then fails rolls them back with it).

    One statement chooses and locks it: each client's oldest queued row, its start tag
    ``max(V, finish)``, the smallest (ties: the oldest row). On PostgreSQL the row is
    locked (``FOR UPDATE OF``); a double text of another process that took it out of the
    queue meanwhile leaves no row (read committed checks it again), and then the choice
    is made again. The tag writes are sent with the transaction's next round trip."""
    weights = dict(env.settings.fair_weights or ())
    pg = tx.dialect == POSTGRESQL
    sql = (
        "SELECT i.inbox_id, i.payload, i.conversation, p.c, p.start FROM agent_inbox i JOIN ("
        f"SELECT f.s, f.c, {'greatest' if pg else 'max'}(coalesce(v.vfinish, 0), "
        "coalesce(t.vfinish, 0)) AS start FROM ("
        f"SELECT {_client_expr(tx.dialect)} AS c, min(seq) AS s FROM agent_inbox"
        " WHERE agent_id = ? AND status = ? GROUP BY 1) f"
        " LEFT JOIN fair_share t ON t.agent_id = ? AND t.client = f.c"
        " LEFT JOIN fair_share v ON v.agent_id = ? AND v.client = ?"
        " ORDER BY start, f.s LIMIT 1) p ON i.seq = p.s WHERE i.status = ?"
        + (" FOR UPDATE OF i" if pg else "")
    )
    params = (agent_id, InboxStatus.QUEUED, agent_id, agent_id, AGENT_CLOCK, InboxStatus.QUEUED)
    while True:
        found = tx.one(sql, params)
        if found is not None:
            break
        if (
            not pg
            or tx.one(
                "SELECT 1 FROM agent_inbox WHERE agent_id = ? AND status = ? LIMIT 1",
                (agent_id, InboxStatus.QUEUED),
            )
            is None
        ):
            return None  # SQLite: one writer, so nothing queued
    inbox_id, payload, conversation, client, start = found
    client, start = str(client), float(start)
    weight = weights.get(client, 1.0)
    for key, value in ((client, start + 1.0 / weight), (AGENT_CLOCK, start)):
        tx.execute(
            "INSERT INTO fair_share (agent_id, client, vfinish) VALUES (?, ?, ?)"
            " ON CONFLICT (agent_id, client) DO UPDATE SET vfinish = excluded.vfinish",
            (agent_id, key, value),
        )
    return (inbox_id, payload, conversation)
