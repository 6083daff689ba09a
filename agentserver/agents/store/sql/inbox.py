"""The inbox: Enqueues, tool reports, claims of due rows, requeues."""

from __future__ import annotations

import json
from collections.abc import Sequence

from agentserver.agents.ports import ReplyRef
from agentserver.agents.store.base import EnqueueResult, InboxRow, caller_key
from agentserver.agents.store.sql import a2a, head
from agentserver.agents.store.sql.common import INBOX_COLS, edge, inbox_row
from agentserver.agents.store.sql.db import StoreEnv, Tx, marks, new_id, skip_locked
from agentserver.agents.store.states import (
    DUE_INBOX,
    HeadStatus,
    InboxEvent,
    InboxStatus,
    MessageType,
    inbox_sources,
    inbox_transition,
)


def ensure_agents(tx: Tx, env: StoreEnv, agent_ids: Sequence[str]) -> None:
    for agent_id in agent_ids:
        head.ensure(tx, env, agent_id)


def enqueue_turn(
    tx: Tx,
    env: StoreEnv,
    agent_id: str,
    payload: bytes,
    reply_ref: ReplyRef,
    conversation: str | None = None,
) -> EnqueueResult:
    """Write the Enqueue as a queued row; lease it at once if the agent is idle.

    Raises ``TypeError``/``ValueError`` (nothing written) if ``reply_ref`` is not JSON.
    An A2A task enqueued before (sent again after a crash, docs/a2a.md) is not queued
    twice: the earlier row's id, nothing written."""
    ref_json = json.dumps(reply_ref)
    earlier = a2a.earlier_send(tx, env, agent_id, reply_ref)
    if earlier is not None:
        return EnqueueResult(earlier, False)
    inbox_id = new_id()
    found = tx.one("SELECT status FROM agent_state_head WHERE agent_id = ?", (agent_id,))
    if found is None:
        head.ensure(tx, env, agent_id)
    queue(tx, env, inbox_id, agent_id, payload, ref_json, conversation)
    idle = found is None or found[0] == HeadStatus.IDLE
    return EnqueueResult(inbox_id, idle and head.lease_next(tx, env, agent_id))


def queue(
    tx: Tx,
    env: StoreEnv,
    inbox_id: str,
    agent_id: str,
    payload: bytes,
    ref_json: str,
    conversation: str | None,
) -> None:
    """The Enqueue's queued row and its edge. Without a conversation (an agent without
    memory) the row names its caller (``caller_key``): retention's ``keep-last`` counts
    such an agent's tasks per caller (agents/store/sql/prune.py)."""
    now = env.clock.now()
    caller = None if conversation else caller_key(json.loads(ref_json))
    tx.execute(
        "INSERT INTO agent_inbox (inbox_id, agent_id, message_type, status, payload, "
        "reply_ref, next_retry_at, created_at, updated_at, conversation, caller, version) "
        "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            inbox_id,
            agent_id,
            MessageType.TURN,
            InboxStatus.QUEUED,
            payload,
            ref_json,
            now,
            now,
            now,
            conversation,
            caller,
            env.served.version(agent_id),
        ),
    )
    edge(tx, env, agent_id, None, "enqueue", "request", inbox_id=inbox_id)


def report_tool_result(
    tx: Tx, env: StoreEnv, agent_id: str, tool_call_id: str, payload: bytes, failed: bool
) -> str:
    inbox_id = new_id()
    insert_report(
        tx, env, inbox_id, agent_id, MessageType.TOOL_RESULT, tool_call_id, payload, failed
    )
    return inbox_id


def insert_report(
    tx: Tx,
    env: StoreEnv,
    inbox_id: str,
    agent_id: str,
    mtype: MessageType,
    tool_call_id: str,
    payload: bytes,
    failed: bool,
) -> None:
    now = env.clock.now()
    waiting = tx.one(
        "SELECT agent_turn_id, turn_epoch FROM turn_waiting_tools WHERE tool_call_id = ?",
        (tool_call_id,),
    )
    # Before the suspend commits there is no waiting row yet: park the report as
    # deferred; the suspend transaction makes it due again.
    status = InboxStatus.PENDING if waiting else InboxStatus.DEFERRED
    tx.execute(
        "INSERT INTO agent_inbox (inbox_id, agent_id, message_type, status, agent_turn_id, "
        "turn_epoch, correlation_id, payload, failed, next_retry_at, defer_reason, "
        "created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            inbox_id,
            agent_id,
            mtype,
            status,
            waiting[0] if waiting else None,
            waiting[1] if waiting else None,
            tool_call_id,
            payload,
            int(failed),
            now + (0 if waiting else env.settings.retry_base_s),
            None if waiting else "awaiting suspend",
            now,
            now,
        ),
    )
    edge(
        tx,
        env,
        agent_id,
        waiting[0] if waiting else None,
        "report",
        "response",
        correlation_id=tool_call_id,
        inbox_id=inbox_id,
        metadata={"message_type": str(mtype)},
    )


def due_agents(tx: Tx, env: StoreEnv, limit: int) -> list[str]:
    """Up to ``limit`` agents with rows due that this process may claim (as
    :func:`claim_due` filters them), the longest due first."""
    cond, cond_params = env.served.heads_filter()
    if not cond:
        rows = tx.all(
            f"SELECT agent_id FROM agent_inbox WHERE status IN ({marks(len(DUE_INBOX))}) "
            "AND next_retry_at <= ? GROUP BY agent_id ORDER BY min(next_retry_at) LIMIT ?",
            (*sorted(DUE_INBOX), env.clock.now(), limit),
        )
        return [r[0] for r in rows]
    rows = tx.all(
        "SELECT i.agent_id FROM agent_inbox i JOIN agent_state_head h ON h.agent_id = i.agent_id "
        f"WHERE i.status IN ({marks(len(DUE_INBOX))}) AND i.next_retry_at <= ? AND {cond} "
        "GROUP BY i.agent_id ORDER BY min(i.next_retry_at) LIMIT ?",
        (*sorted(DUE_INBOX), env.clock.now(), *cond_params, limit),
    )
    return [r[0] for r in rows]


def claim_due(tx: Tx, env: StoreEnv, agent_id: str, limit: int) -> list[InboxRow]:
    """Claim due rows of ``agent_id`` (pending/deferred, ``next_retry_at <= now``), in
    ``next_retry_at, created_at`` order; each moves to ``processing``. One statement
    (PostgreSQL's skips the rows other processes hold: :func:`~.db.skip_locked`)."""
    lock = skip_locked(tx)
    now = env.clock.now()
    sources = inbox_sources(InboxEvent.CLAIM)
    target = inbox_transition(sources[0], InboxEvent.CLAIM).target
    # Only rows this process may run (agents/store/served.py): a pinned Turn's on its
    # version, the rest where this process serves the agent's newest version.
    cond, cond_params = env.served.head_filter(agent_id)
    served = (
        f"AND EXISTS (SELECT 1 FROM agent_state_head h WHERE h.agent_id = ? AND {cond}) "
        if cond
        else ""
    )
    rows = tx.all(
        "UPDATE agent_inbox SET status = ?, updated_at = ?, processing_at = ? "
        "WHERE inbox_id IN (SELECT inbox_id FROM agent_inbox WHERE agent_id = ? "
        f"AND status IN ({marks(len(sources))}) AND next_retry_at <= ? {served}"
        f"ORDER BY next_retry_at, created_at, seq LIMIT ?{lock}) "
        f"AND status IN ({marks(len(sources))}) RETURNING {INBOX_COLS}, seq",
        (
            target,
            now,
            now,
            agent_id,
            *sources,
            now,
            *((agent_id, *cond_params) if cond else ()),
            limit,
            *sources,
        ),
    )
    rows.sort(key=lambda r: (r[11], r[13], r[15]))
    return [inbox_row(r[:15]) for r in rows]


def requeue(tx: Tx, env: StoreEnv, now: float, before: float | None = None) -> int:
    """processing → pending (due now): rows taken before ``before``, or all of them
    (None); how many."""
    sources = inbox_sources(InboxEvent.REQUEUE)
    target = inbox_transition(sources[0], InboxEvent.REQUEUE).target
    cond = "" if before is None else " AND processing_at < ?"
    tx.execute(
        "UPDATE agent_inbox SET status = ?, updated_at = ?, next_retry_at = ?, "
        f"processing_at = NULL WHERE status IN ({marks(len(sources))}){cond}",
        (target, now, now, *sources, *(() if before is None else (before,))),
    )
    return tx.rowcount


def requeue_stuck(tx: Tx, env: StoreEnv, older_than_s: float) -> int:
    now = env.clock.now()
    return requeue(tx, env, now, before=now - older_than_s)
