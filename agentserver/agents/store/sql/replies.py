"""Replies: the Turns' reply outbox and the replies kept for named clients."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from agentserver.agents.store.base import ClientReply, PendingReply
from agentserver.agents.store.sql.db import StoreEnv, Tx, marks
from agentserver.agents.store.states import (
    InboxEvent,
    InboxStatus,
    MessageType,
    ReplyStatus,
    inbox_sources,
    inbox_transition,
)


def pending_replies(
    tx: Tx, env: StoreEnv, limit: int, older_than_s: float = 0.0
) -> list[PendingReply]:
    rows = tx.all(
        "SELECT agent_turn_id, agent_id, reply_ref, payload, failed, attempts "
        "FROM agent_replies WHERE status = ? AND created_at <= ? ORDER BY created_at LIMIT ?",
        (ReplyStatus.PENDING, env.clock.now() - older_than_s, limit),
    )
    return [PendingReply(r[0], r[1], r[2], bytes(r[3]), bool(r[4]), r[5]) for r in rows]


def mark_sent(tx: Tx, env: StoreEnv, agent_turn_id: str) -> int:
    """Mark a Turn's outbox reply sent (once); how many rows changed."""
    tx.execute(
        "UPDATE agent_replies SET status = ?, sent_at = ?, attempts = attempts + 1 "
        "WHERE agent_turn_id = ? AND status != ?",
        (ReplyStatus.SENT, env.clock.now(), agent_turn_id, ReplyStatus.SENT),
    )
    return tx.rowcount


def mark_reply_sent(tx: Tx, env: StoreEnv, agent_turn_id: str) -> None:
    mark_sent(tx, env, agent_turn_id)


def mark_replies_sent(tx: Tx, env: StoreEnv, agent_turn_ids: Sequence[str]) -> None:
    """:func:`mark_sent` for several Turns' replies, in one statement."""
    if not agent_turn_ids:
        return
    tx.execute(
        "UPDATE agent_replies SET status = ?, sent_at = ?, attempts = attempts + 1 "
        f"WHERE agent_turn_id IN ({marks(len(agent_turn_ids))}) AND status != ?",
        (ReplyStatus.SENT, env.clock.now(), *agent_turn_ids, ReplyStatus.SENT),
    )


def mark_reply_attempt(tx: Tx, env: StoreEnv, agent_turn_id: str, give_up: bool) -> None:
    tx.execute(
        "UPDATE agent_replies SET attempts = attempts + 1, status = ? "
        "WHERE agent_turn_id = ? AND status = ?",
        (
            ReplyStatus.UNDELIVERABLE if give_up else ReplyStatus.PENDING,
            agent_turn_id,
            ReplyStatus.PENDING,
        ),
    )


def record_client_reply(
    tx: Tx,
    env: StoreEnv,
    client: str,
    thread_ref: Mapping[str, object],
    payload: bytes,
    *,
    failed: bool,
    agent_turn_id: str | None = None,
) -> int:
    """Keep a reply for a named client that is away; the oldest beyond the bound go.

    With ``agent_turn_id`` the Turn's outbox reply is marked sent in the same
    transaction, so a crash can neither lose the reply nor keep it twice."""
    if agent_turn_id is not None:
        if mark_sent(tx, env, agent_turn_id) == 0 and tx.one(
            "SELECT 1 FROM agent_replies WHERE agent_turn_id = ?", (agent_turn_id,)
        ):
            return 0  # already handed over: keep nothing twice
    row = tx.one(
        "INSERT INTO client_replies (client, thread_ref, payload, failed, created_at) "
        "VALUES (?,?,?,?,?) RETURNING reply_id",
        (client, json.dumps(thread_ref), payload, int(failed), env.clock.now()),
    )
    tx.execute(
        "DELETE FROM client_replies WHERE client = ? AND delivered_at IS NULL AND "
        "reply_id NOT IN (SELECT reply_id FROM client_replies WHERE client = ? AND "
        "delivered_at IS NULL ORDER BY reply_id DESC LIMIT ?)",
        (client, client, env.settings.client_replies_max),
    )
    tx.execute(
        "DELETE FROM client_replies WHERE client = ? AND delivered_at IS NOT NULL", (client,)
    )
    return int(row[0]) if row else 0


def pending_client_replies(
    tx: Tx, env: StoreEnv, client: str, after_id: int = 0, limit: int = 100
) -> list[ClientReply]:
    """The replies kept for ``client`` with an id above ``after_id``, oldest first.
    Reading does not hand them over: they stay until :func:`ack_client_replies`."""
    rows = tx.all(
        "SELECT reply_id, client, thread_ref, payload, failed, created_at "
        "FROM client_replies WHERE client = ? AND delivered_at IS NULL AND reply_id > ? "
        "ORDER BY reply_id LIMIT ?",
        (client, after_id, limit),
    )
    return [ClientReply(r[0], r[1], r[2], bytes(r[3]), bool(r[4]), r[5]) for r in rows]


def take_client_reply(tx: Tx, env: StoreEnv, client: str, reply_id: int) -> ClientReply | None:
    """Take a kept reply of ``client`` out of the store before it is written to a
    connection without acks (there, written is received): the receipt commits first, so
    a process killed before it commits has written nothing, and the reply is still kept
    for her next connection. None when it is no longer kept (received already: another
    process, or another path of this one, took it). What is taken is given back with
    :func:`restore_client_reply` if it cannot be written after all."""
    row = tx.one(
        "DELETE FROM client_replies WHERE client = ? AND reply_id = ? AND delivered_at IS NULL "
        "RETURNING reply_id, client, thread_ref, payload, failed, created_at",
        (client, reply_id),
    )
    if row is None:
        return None
    return ClientReply(row[0], row[1], row[2], bytes(row[3]), bool(row[4]), row[5])


def restore_client_reply(tx: Tx, env: StoreEnv, reply: ClientReply) -> None:
    """Keep again a reply :func:`take_client_reply` took and no connection wrote: with its
    own id, so it keeps its place among her replies."""
    tx.execute(
        "INSERT INTO client_replies (reply_id, client, thread_ref, payload, failed, "
        "created_at) VALUES (?,?,?,?,?,?) ON CONFLICT (reply_id) DO NOTHING",
        (
            reply.reply_id,
            reply.client,
            reply.thread_ref_json,
            reply.payload,
            int(reply.failed),
            reply.created_at,
        ),
    )


def ack_client_replies(tx: Tx, env: StoreEnv, client: str, reply_ids: Sequence[int]) -> int:
    """Forget the replies of ``client`` it has received (ids of other clients are
    ignored); how many were still kept."""
    ids = sorted({int(i) for i in reply_ids})
    if not ids:
        return 0
    tx.execute(
        f"DELETE FROM client_replies WHERE client = ? AND reply_id IN ({marks(len(ids))})",
        (client, *ids),
    )
    return tx.rowcount


# -- stop and cancel from outside (agentserver.console.operator) ------------------------------------


def _caller_thread(ref_json: str | None) -> object:
    """The ``caller_thread`` of a stored reply reference (parsed here, not in SQL, so the
    query is the same on every engine)."""
    try:
        ref = json.loads(ref_json) if ref_json else None
    except ValueError:
        return None
    return ref.get("caller_thread") if isinstance(ref, dict) else None


def turn_of_thread(tx: Tx, env: StoreEnv, agent_id: str, caller_thread: str) -> str | None:
    """The active Turn's id if it is the task sent on the caller's ``caller_thread``."""
    row = tx.one(
        "SELECT h.active_agent_turn_id, i.reply_ref FROM agent_state_head h JOIN agent_inbox i "
        "ON i.inbox_id = h.turn_inbox_id WHERE h.agent_id = ?",
        (agent_id,),
    )
    if row and row[0] and _caller_thread(row[1]) == caller_thread:
        return str(row[0])
    return None


def cancel_queued(
    tx: Tx, env: StoreEnv, agent_id: str, caller_thread: str | None, failed_answer: bytes
) -> list[PendingReply]:
    """Cancel the agent's queued tasks (only the one sent on ``caller_thread``, if given):
    ``queued → skipped`` and, in the same transaction, one failed answer per task in the
    reply outbox (keyed ``cancel:INBOX_ID``; sent like a Turn's and resent after a crash).
    Returns the replies to send now."""
    sources = inbox_sources(InboxEvent.CANCEL)
    target = inbox_transition(InboxStatus.QUEUED, InboxEvent.CANCEL).target
    now = env.clock.now()
    rows = tx.all(
        "SELECT inbox_id, reply_ref FROM agent_inbox WHERE agent_id = ? "
        f"AND message_type = ? AND status IN ({marks(len(sources))}) ORDER BY seq",
        (agent_id, MessageType.TURN, *sources),
    )
    out: list[PendingReply] = []
    for inbox_id, ref in rows:
        if caller_thread is not None and _caller_thread(ref) != caller_thread:
            continue
        tx.execute(
            "UPDATE agent_inbox SET status = ?, updated_at = ? WHERE inbox_id = ? "
            f"AND status IN ({marks(len(sources))})",
            (str(target), now, inbox_id, *sources),
        )
        if not tx.rowcount or ref is None:
            continue
        key = f"cancel:{inbox_id}"
        tx.execute(
            "INSERT INTO agent_replies (agent_turn_id, agent_id, reply_ref, payload, "
            "failed, status, created_at) VALUES (?,?,?,?,1,?,?)",
            (key, agent_id, ref, failed_answer, ReplyStatus.PENDING, now),
        )
        out.append(PendingReply(key, agent_id, ref, failed_answer, True, 0))
    return out
