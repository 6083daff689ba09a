"""The watchdog's queries, and the recovery of running Turns at start-up."""

from __future__ import annotations

from agentserver.agents.profile.retry import step_retries_done
from agentserver.agents.store.base import Head, TurnToken
from agentserver.agents.store.sql import budgets, head
from agentserver.agents.store.sql.common import HEAD_COLS, edge, inbox_move
from agentserver.agents.store.sql.db import StoreEnv, Tx, new_id
from agentserver.agents.store.sql.inbox import requeue
from agentserver.agents.store.states import (
    HeadEvent,
    HeadStatus,
    InboxEvent,
    InboxStatus,
    MessageType,
)


def expired_suspensions(tx: Tx, env: StoreEnv) -> list[TurnToken]:
    rows = tx.all(
        "SELECT agent_id, active_agent_turn_id, turn_epoch FROM agent_state_head "
        "WHERE status = ? AND resume_deadline IS NOT NULL AND resume_deadline < ?",
        (HeadStatus.SUSPENDED, env.clock.now()),
    )
    return [TurnToken(*r) for r in rows]


def suspended_turns(tx: Tx, env: StoreEnv) -> list[TurnToken]:
    """Every Turn suspended on tools, whatever its deadline (used after a restart)."""
    rows = tx.all(
        "SELECT agent_id, active_agent_turn_id, turn_epoch FROM agent_state_head "
        "WHERE status = ? AND resume_deadline IS NOT NULL",
        (HeadStatus.SUSPENDED,),
    )
    return [TurnToken(*r) for r in rows]


def stale_dispatched(tx: Tx, env: StoreEnv, older_than_s: float) -> list[Head]:
    rows = tx.all(
        f"SELECT {HEAD_COLS} FROM agent_state_head WHERE status = ? AND dispatched_at < ?",
        (HeadStatus.DISPATCHED, env.clock.now() - older_than_s),
    )
    return [Head(*r) for r in rows]


def overdue_running(tx: Tx, env: StoreEnv, older_than_s: float) -> list[Head]:
    rows = tx.all(
        f"SELECT {HEAD_COLS} FROM agent_state_head WHERE status = ? AND running_since < ?",
        (HeadStatus.RUNNING, env.clock.now() - older_than_s),
    )
    return [Head(*r) for r in rows]


def _pending_step_retry(tx: Tx, env: StoreEnv, token: TurnToken, now: float) -> tuple[float, bytes]:
    """A restart keeps a Turn's retry wait: the due time and retry count of its
    not-yet-taken retry row (which the recovery's own resume row replaces)."""
    row = tx.one(
        "SELECT inbox_id, next_retry_at, payload FROM agent_inbox WHERE agent_id = ? "
        "AND agent_turn_id = ? AND message_type = ? AND status = ? "
        "ORDER BY next_retry_at DESC LIMIT 1",
        (token.agent_id, token.agent_turn_id, MessageType.RESUME, InboxStatus.PENDING),
    )
    if row is None or step_retries_done(bytes(row[2])) == 0:
        return now, b""
    inbox_move(tx, env, row[0], InboxEvent.ABANDON, defer_reason="replaced at restart")
    return max(now, float(row[1])), bytes(row[2])


def recover_running(tx: Tx, env: StoreEnv) -> list[TurnToken]:
    """At start-up: every ``running`` Turn lost its worker. Fence it (epoch + 1), reset
    its in-flight rows, and queue a ``resume`` row so a worker re-runs its next step.

    Call only when no worker of this store is alive (before starting the worker)."""
    now = env.clock.now()
    out = []
    requeue(tx, env, now)
    rows = tx.all(
        "SELECT agent_id, active_agent_turn_id, turn_epoch FROM agent_state_head WHERE status = ?",
        (HeadStatus.RUNNING,),
    )
    for r in rows:
        out.append(recover_turn(tx, env, TurnToken(*r), now))
    return out


def recover_turn(tx: Tx, env: StoreEnv, token: TurnToken, now: float) -> TurnToken:
    """Fence one ``running`` Turn whose worker is gone (epoch + 1) and queue the
    ``resume`` row that re-runs its next step; returns its new token. (Also used by a
    shared store for the Turns of a process whose lease expired.) The budget holds of the
    fenced run (its model call died with its worker) are released with the fence."""
    due, payload = _pending_step_retry(tx, env, token, now)
    h = head.fence(tx, env, token, HeadEvent.RECOVER, given={"now": now})
    budgets.release_turn(tx, env, token.agent_id, token.agent_turn_id, token.turn_epoch)
    tx.execute(
        "INSERT INTO agent_inbox (inbox_id, agent_id, message_type, status, "
        "agent_turn_id, turn_epoch, payload, next_retry_at, created_at, updated_at) "
        "VALUES (?,?,?,?,?,?,?,?,?,?)",
        (
            new_id(),
            token.agent_id,
            MessageType.RESUME,
            InboxStatus.PENDING,
            token.agent_turn_id,
            h.turn_epoch,
            payload,
            due,
            now,
            now,
        ),
    )
    edge(tx, env, token.agent_id, token.agent_turn_id, "recover", "request")
    return TurnToken(token.agent_id, token.agent_turn_id, h.turn_epoch)
