"""What webhooks keep in the store besides the outbox (agents/store/outbox.py): the
webhooks made at run time (the ``webhooks`` table of migration 7, their specs as JSON),
and what their events' payloads read: a Turn's thread and conversation, the Turns ended
lately (the start-up sweep). Every function is one store transaction's work."""

from __future__ import annotations

import json

from agentserver.agents.store.outbox import cancel_channel
from agentserver.agents.store.rows import CardType
from agentserver.agents.store.sql.db import StoreEnv, Tx
from agentserver.agents.store.sql.views import json_text
from agentserver.agents.store.states import MessageType

# -- webhooks made at run time (their specs as JSON) ---------------------------------------


def put_webhook(tx: Tx, env: StoreEnv, name: str, spec: str, secret: str) -> bool:
    """Store a webhook made at run time; False if the name is taken."""
    if tx.one("SELECT 1 FROM webhooks WHERE name = ?", (name,)):
        return False
    tx.execute(
        "INSERT INTO webhooks (name, spec, secret, created_at) VALUES (?, ?, ?, ?)",
        (name, spec, secret, env.clock.now()),
    )
    return True


def get_webhooks(tx: Tx, env: StoreEnv) -> list[tuple[str, str, str]]:
    """(name, spec JSON, secret) of every webhook made at run time. Read only."""
    return [(r[0], r[1], r[2]) for r in tx.all("SELECT name, spec, secret FROM webhooks")]


def delete_webhook(tx: Tx, env: StoreEnv, name: str, channel: str) -> bool:
    """Delete a webhook made at run time and withdraw its undelivered rows; False if
    there is none of that name. Atomic."""
    tx.execute("DELETE FROM webhooks WHERE name = ?", (name,))
    if tx.rowcount == 0:
        return False
    cancel_channel(tx, env, channel)
    return True


def turn_conversation(tx: Tx, env: StoreEnv, turn: str) -> tuple[str | None, str | None]:
    """(caller thread, conversation) of the task Turn ``turn`` runs. Read only."""
    caller = json_text(tx, "reply_ref", "caller_thread")
    row = tx.one(
        f"SELECT {caller}, conversation FROM agent_inbox WHERE agent_turn_id = ? "
        "AND message_type = ? LIMIT 1",
        (turn, MessageType.TURN.value),
    )
    return (row[0], row[1]) if row else (None, None)


#: The most recent cards a start-up sweep looks through (a primary-key range: bounded).
SWEEP_CARDS = 50000


def recent_task_ends(
    tx: Tx, env: StoreEnv, since: float
) -> list[tuple[str, str, str, str, str, float]]:
    """(agent, Turn, status, output box, deliverable card, ended at) of the Turns that
    ended since ``since``, among the last :data:`SWEEP_CARDS` cards. Read only."""
    top = tx.one("SELECT MAX(seq) FROM cards")
    if top is None or top[0] is None:
        return []
    rows = tx.all(
        "SELECT b.agent_id, c.agent_turn_id, c.metadata, c.box_id, c.card_id, c.created_at "
        "FROM cards c JOIN boxes b ON b.box_id = c.box_id "
        "WHERE c.seq > ? AND c.card_type = ? AND c.created_at >= ? ORDER BY c.seq",
        (int(top[0]) - SWEEP_CARDS, str(CardType.DELIVERABLE), since),
    )
    out = []
    for agent, turn, metadata, box, card, at in rows:
        status = json.loads(metadata or "{}").get("status", "")
        if status:
            out.append((agent, turn, str(status), box, card, float(at)))
    return out
