"""The end of a Turn on the head: its deliverable and reply written, the head released
to the next Turn (or idle), the inbox row done; a forced end (stop, watchdog) and a task
row failed before its Turn ran. Each function runs inside the caller's transaction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentserver.agents.errors import StaleTurn
from agentserver.agents.ports import LLMCompletion
from agentserver.agents.store.base import (
    CardType,
    Finished,
    InboxRow,
    NewCard,
    PendingReply,
    TaskStatus,
    TurnToken,
)
from agentserver.agents.store.sql import conversations, head
from agentserver.agents.store.sql.budgets import Spend, settle_spends
from agentserver.agents.store.sql.common import (
    edge,
    inbox_move,
    insert_cards,
)
from agentserver.agents.store.sql.db import Row, StoreEnv, Tx
from agentserver.agents.store.sql.replies import mark_replies_sent
from agentserver.agents.store.sql.turns import close_step, with_tokens
from agentserver.agents.store.states import (
    ACTIVE_HEAD,
    AgentStepStatus,
    HeadEvent,
    InboxEvent,
    InboxStatus,
    MessageType,
    ReplyStatus,
    WaitingStatus,
    inbox_transition,
)

ENDING = (
    "SELECT h.status, h.turn_epoch, h.output_box_id, h.context_box_id, h.turn_inbox_id, "
    "i.reply_ref, i.conversation FROM agent_state_head h LEFT JOIN agent_inbox i "
    "ON i.inbox_id = h.turn_inbox_id WHERE h.agent_id = ? AND h.active_agent_turn_id = ?"
)


def end_turn(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    event: HeadEvent,
    status: str,
    text: str,
    metadata: Mapping[str, Any],
    reply_payload: bytes | None,
    ending: Sequence[Any] | None = None,
    before: Sequence[NewCard] = (),
    keep_memory: bool = True,
    next_row: Row | None = None,
) -> Finished:
    """Deliverable card + head to idle + reply outbox + next lease, in one transaction.

    ``ending``: the row of ``ENDING`` if the caller read it already; ``before``: cards
    to add ahead of the deliverable (counted on the head like any others);
    ``keep_memory`` False: the conversation does not continue from this Turn (a
    rollback, docs/runs.md); ``next_row``: the queued row (of ``head.QUEUED_NEXT``) to
    lease next instead of the oldest (the newer task of an interrupt or rollback)."""
    if ending is None:
        ending = tx.one(ENDING, (token.agent_id, token.agent_turn_id))
        if ending is None:
            raise StaleTurn(f"{token}: not the active Turn")
    _, _, output_box, context_box, turn_inbox_id, ref, conversation = ending
    now = env.clock.now()
    priced = with_tokens(env, token.agent_id, before)
    delta = sum(t for _, t in priced)
    head.fence(
        tx,
        env,
        token,
        event,
        exprs={"context_tokens": "context_tokens + ?"} if delta else None,
        expr_params=(delta,) if delta else (),
    )
    deliverable = NewCard(CardType.DELIVERABLE, text, {"status": status, **metadata})
    *_, card_id = insert_cards(
        tx, env, output_box, token.agent_turn_id, [*priced, (deliverable, 0)]
    )
    if event == HeadEvent.FORCE_END:
        # Only an end from outside can leave waiting calls or a retry wait: a FINISH comes
        # from the worker of a running Turn, which resumed when its waiting set was
        # complete and took its retry wait's row.
        tx.execute(
            "UPDATE turn_waiting_tools SET status = ?, updated_at = ? "
            "WHERE agent_turn_id = ? AND status = ?",
            (WaitingStatus.CANCELLED, now, token.agent_turn_id, WaitingStatus.WAITING),
        )
        if turn_inbox_id:
            # A Turn ended before its Enqueue row was used: that row is finished too.
            for ev in (InboxEvent.ABANDON, InboxEvent.FAIL):
                if inbox_move(tx, env, turn_inbox_id, ev, defer_reason=f"turn {status}"):
                    break
        abandon_step_retries(tx, env, token)
    if keep_memory:
        conversations.save(tx, token.agent_id, conversation, context_box, output_box, now)
    reply: PendingReply | None = None
    if ref is not None and reply_payload is not None:
        failed = status != TaskStatus.SUCCEEDED
        tx.execute(
            "INSERT INTO agent_replies (agent_turn_id, agent_id, reply_ref, payload, failed, "
            "status, created_at) VALUES (?,?,?,?,?,?,?)",
            (
                token.agent_turn_id,
                token.agent_id,
                ref,
                reply_payload,
                int(failed),
                ReplyStatus.PENDING,
                now,
            ),
        )
        reply = PendingReply(token.agent_turn_id, token.agent_id, ref, reply_payload, failed, 0)
    edge(
        tx,
        env,
        token.agent_id,
        token.agent_turn_id,
        "deliver",
        "response",
        metadata={"status": status, "deliverable_card_id": card_id},
    )
    if next_row is not None:
        leased = head.lease_row(tx, env, token.agent_id, next_row)
    else:
        leased = head.lease_next(tx, env, token.agent_id)
    return Finished(token.agent_id, token.agent_turn_id, status, output_box, card_id, reply, leased)


def abandon_step_retries(tx: Tx, env: StoreEnv, token: TurnToken) -> None:
    """A Turn that ends (e.g. stopped during a retry wait) drops its retry wait."""
    target = inbox_transition(InboxStatus.PENDING, InboxEvent.ABANDON).target
    tx.execute(
        "UPDATE agent_inbox SET status = ?, updated_at = ?, defer_reason = ? "
        "WHERE agent_id = ? AND agent_turn_id = ? AND message_type = ? AND status = ?",
        (
            target,
            env.clock.now(),
            "turn ended",
            token.agent_id,
            token.agent_turn_id,
            MessageType.RESUME,
            InboxStatus.PENDING,
        ),
    )


def finish(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    status: str,
    text: str,
    metadata: Mapping[str, Any],
    reply_payload: bytes,
    step_id: str | None = None,
    completion: LLMCompletion | None = None,
    cards: Sequence[NewCard] = (),
    sent: Sequence[str] = (),
    spends: Sequence[Spend] = (),
) -> Finished:
    """running → idle with the deliverable card and the pending reply (one transaction).
    With ``step_id``, that step is completed first, as :func:`complete_step` would
    (``completion``, ``cards`` ahead of the deliverable), in the same compare-and-set.
    ``sent``: other Turns whose replies were sent since, marked so in the same
    transaction (:func:`~agentserver.agents.store.sql.replies.mark_replies_sent`).
    ``spends``: the last step's model calls settled in their budgets, with it."""
    if step_id is None and (cards or spends):
        raise ValueError("cards and spends are written with the step they close")
    fin = end_turn(
        tx, env, token, HeadEvent.FINISH, status, text, metadata, reply_payload, before=cards
    )
    if step_id is not None:
        close_step(tx, env, step_id, completion, AgentStepStatus.COMPLETED, ())
    mark_replies_sent(tx, env, sent)
    settle_spends(tx, env, spends)
    return fin


def force_end(
    tx: Tx,
    env: StoreEnv,
    agent_id: str,
    status: str,
    text: str,
    reply_payload: bytes | None,
    *,
    agent_turn_id: str | None = None,
    turn_epoch: int | None = None,
    expect_status: Sequence[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    keep_memory: bool = True,
    next_row: Row | None = None,
) -> Finished | None:
    """End the active Turn (stop, watchdog, double texting): epoch + 1, failed
    deliverable, reply. ``None`` when nothing matched (no active Turn, or it already moved
    on). ``metadata``, ``keep_memory``, ``next_row``: as :func:`end_turn`'s."""
    row = tx.one(
        "SELECT h.active_agent_turn_id, h.status, h.turn_epoch, h.output_box_id, "
        "h.context_box_id, h.turn_inbox_id, i.reply_ref, i.conversation "
        "FROM agent_state_head h LEFT JOIN agent_inbox i ON i.inbox_id = h.turn_inbox_id "
        "WHERE h.agent_id = ?",
        (agent_id,),
    )
    if row is None or row[0] is None or row[1] not in ACTIVE_HEAD:
        return None
    if agent_turn_id is not None and row[0] != agent_turn_id:
        return None
    if turn_epoch is not None and row[2] != turn_epoch:
        return None
    if expect_status is not None and row[1] not in expect_status:
        return None
    token = TurnToken(agent_id, row[0], row[2])
    return end_turn(
        tx,
        env,
        token,
        HeadEvent.FORCE_END,
        status,
        text,
        {"forced": True, **(metadata or {})},
        reply_payload,
        ending=row[1:],
        keep_memory=keep_memory,
        next_row=next_row,
    )


def fail_turn_row(
    tx: Tx, env: StoreEnv, row: InboxRow, reason: str, reply_payload: bytes | None
) -> Finished | None:
    """A malformed Enqueue: the row becomes ``error`` and its Turn ends failed."""
    inbox_move(tx, env, row.inbox_id, InboxEvent.FAIL, defer_reason=reason)
    token = row.token
    if token is None:
        return None
    try:
        return end_turn(
            tx,
            env,
            token,
            HeadEvent.FORCE_END,
            TaskStatus.FAILED,
            reason,
            {"error": reason},
            reply_payload,
        )
    except StaleTurn:
        return None  # the Turn was already ended: keep only the row's error mark
