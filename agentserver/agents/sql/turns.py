"""A Turn's life on the head: start, steps and their cards, compaction, retry, end."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agentserver.agents.errors import StaleTurn
from agentserver.agents.ports import LLMCompletion
from agentserver.agents.retry import step_retry_payload
from agentserver.agents.sql import conversations, head
from agentserver.agents.sql.common import (
    edge,
    inbox_move,
    insert_cards,
    insert_copies,
    tokens_of,
    turn_cards,
)
from agentserver.agents.sql.db import StoreEnv, Tx, insert_rows, marks, new_id
from agentserver.agents.states import (
    ACTIVE_HEAD,
    AgentStepStatus,
    HeadEvent,
    HeadStatus,
    InboxEvent,
    InboxStatus,
    MessageType,
    ReplyStatus,
    WaitingStatus,
    inbox_transition,
)
from agentserver.agents.store import (
    BoxSwap,
    CardType,
    Finished,
    InboxRow,
    NewCard,
    PendingReply,
    StepStart,
    TaskStatus,
    TurnToken,
)


def start_turn(tx: Tx, env: StoreEnv, row: InboxRow) -> TurnToken:
    """dispatched → running for the Turn of ``row``; the Enqueue row is consumed."""
    token = row.token
    if token is None:
        raise StaleTurn(f"inbox {row.inbox_id} carries no Turn")
    head.fence(tx, env, token, HeadEvent.START, sets={"running_since": env.clock.now()})
    if not inbox_move(tx, env, row.inbox_id, InboxEvent.CONSUME):
        raise StaleTurn(f"inbox {row.inbox_id} is no longer processing")
    edge(tx, env, token.agent_id, token.agent_turn_id, "start", "request", inbox_id=row.inbox_id)
    return token


def skip_row(tx: Tx, env: StoreEnv, row: InboxRow, reason: str) -> None:
    inbox_move(tx, env, row.inbox_id, InboxEvent.SKIP, defer_reason=reason)


def begin_step(tx: Tx, env: StoreEnv, token: TurnToken) -> tuple[str, int]:
    """Record a new step (``started``) and count it; returns ``(step_id, step_no)``."""
    h = head.fence(tx, env, token, exprs={"step_count": "step_count + 1"})
    return _insert_step(tx, env, token, h.step_count), h.step_count


def _insert_step(tx: Tx, env: StoreEnv, token: TurnToken, step_no: int) -> str:
    step_id = new_id()
    tx.execute(
        "INSERT INTO agent_steps (step_id, agent_id, agent_turn_id, turn_epoch, step_no, "
        "status, started_at) VALUES (?,?,?,?,?,?,?)",
        (
            step_id,
            token.agent_id,
            token.agent_turn_id,
            token.turn_epoch,
            step_no,
            AgentStepStatus.STARTED,
            env.clock.now(),
        ),
    )
    return step_id


_UNDER_LIMIT = " AND step_count < ?"


def open_step(tx: Tx, env: StoreEnv, token: TurnToken, max_steps: int) -> StepStart:
    """The worker's step: count and record it unless ``max_steps`` are taken (then no
    step, the head as it is), and the Turn's cards for its model call. CAS-fenced."""
    try:
        h = head.fence(
            tx,
            env,
            token,
            exprs={"step_count": "step_count + 1"},
            where=_UNDER_LIMIT,
            where_params=(max_steps,),
        )
    except StaleTurn:
        # Missed: fenced out (raise), or at the step limit (nothing was written).
        h = head.read(tx, env, token.agent_id)
        if h.token != token or h.status != HeadStatus.RUNNING:
            raise
        return StepStart(h, None, h.step_count, *turn_cards(tx, h.context_box_id, h.output_box_id))
    step_id = _insert_step(tx, env, token, h.step_count)
    return StepStart(h, step_id, h.step_count, *turn_cards(tx, h.context_box_id, h.output_box_id))


def start_turn_step(tx: Tx, env: StoreEnv, row: InboxRow, max_steps: int) -> StepStart:
    """:func:`start_turn` and :func:`open_step` in one transaction, with one
    compare-and-set (dispatched → running, the first step counted)."""
    token = row.token
    if token is None:
        raise StaleTurn(f"inbox {row.inbox_id} carries no Turn")
    try:
        h = head.fence(
            tx,
            env,
            token,
            HeadEvent.START,
            sets={"running_since": env.clock.now()},
            exprs={"step_count": "step_count + 1"},
            where=_UNDER_LIMIT,
            where_params=(max_steps,),
        )
    except StaleTurn:
        # Nothing was written: fenced out (start_turn raises) or at the step limit.
        start_turn(tx, env, row)
        return open_step(tx, env, token, max_steps)
    if not inbox_move(tx, env, row.inbox_id, InboxEvent.CONSUME):
        raise StaleTurn(f"inbox {row.inbox_id} is no longer processing")
    edge(tx, env, token.agent_id, token.agent_turn_id, "start", "request", inbox_id=row.inbox_id)
    step_id = _insert_step(tx, env, token, h.step_count)
    return StepStart(h, step_id, h.step_count, *turn_cards(tx, h.context_box_id, h.output_box_id))


def _priced(env: StoreEnv, agent_id: str, cards: Sequence[NewCard]) -> list[tuple[NewCard, int]]:
    return [(c, tokens_of(env, agent_id, c)) for c in cards]


def append_cards(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    cards: Sequence[NewCard],
    how: HeadEvent | HeadStatus = HeadStatus.RUNNING,
    sets: Mapping[str, Any] | None = None,
    **kw: Any,
) -> tuple[list[str], Any]:
    """The compare-and-set ``how`` (a fence on running by default) that also counts the
    cards' tokens, then the cards into the output box. Returns (card ids, head)."""
    priced = _priced(env, token.agent_id, cards)
    delta = sum(t for _, t in priced)
    exprs = dict(kw.pop("exprs", None) or {})
    params = tuple(kw.pop("expr_params", ()))
    if delta:
        exprs["context_tokens"] = "context_tokens + ?"
        params += (delta,)
    h = head.fence(tx, env, token, how, sets=sets, exprs=exprs, expr_params=params, **kw)
    if not h.output_box_id:
        raise StaleTurn(f"{token}: no output box")
    return insert_cards(tx, env, h.output_box_id, token.agent_turn_id, priced), h


def complete_step(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    step_id: str,
    completion: LLMCompletion | None,
    cards: Sequence[NewCard],
    swap: BoxSwap | None = None,
) -> None:
    """Record the model's reply (usage, cost) and the step's cards; CAS-fenced. With
    ``swap``, the step's compaction is committed with it (one compare-and-set)."""
    if swap is None:
        append_cards(tx, env, token, cards)
    else:
        compact(tx, env, swap, token, cards)
    close_step(tx, env, step_id, completion, AgentStepStatus.COMPLETED, ())


def add_cards(tx: Tx, env: StoreEnv, token: TurnToken, cards: Sequence[NewCard]) -> None:
    """Append cards to the Turn's output box (CAS-fenced on ``running``)."""
    append_cards(tx, env, token, cards)


def close_step(
    tx: Tx,
    env: StoreEnv,
    step_id: str,
    completion: LLMCompletion | None,
    status: AgentStepStatus,
    tool_call_ids: Sequence[str],
    policy: Sequence[Mapping[str, str]] = (),
) -> None:
    """Close a step; with a completion, its usage and cost (and governance's ``policy``
    decisions) become its metadata."""
    now = env.clock.now()
    if completion is None:
        tx.execute(
            "UPDATE agent_steps SET status = ?, ended_at = coalesce(ended_at, ?), "
            "tool_call_ids = ? WHERE step_id = ?",
            (status, now, json.dumps(list(tool_call_ids)), step_id),
        )
        return
    u = completion.usage
    meta = {
        "llm_usage": {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
        },
        "llm_response_cost": completion.cost,
    }
    if policy:
        meta["policy"] = list(policy)
    tx.execute(
        "UPDATE agent_steps SET status = ?, ended_at = ?, model = ?, backend = ?, "
        "prompt_tokens = ?, completion_tokens = ?, total_tokens = ?, cost = ?, "
        "tool_call_ids = ?, metadata = ? WHERE step_id = ?",
        (
            status,
            now,
            completion.model,
            completion.backend,
            u.prompt_tokens,
            u.completion_tokens,
            u.total_tokens,
            completion.cost,
            json.dumps(list(tool_call_ids)),
            json.dumps(meta),
            step_id,
        ),
    )


def compact(
    tx: Tx,
    env: StoreEnv,
    swap: BoxSwap,
    token: TurnToken,
    step_cards: Sequence[NewCard] = (),
) -> int:
    """Swap the Turn's boxes to [summary] + [copies of the kept cards, in order] +
    ``step_cards`` in one compare-and-set on running; the old boxes stay in the store.
    Returns the new running token count."""
    now = env.clock.now()
    keep = list(swap.keep)
    found = tx.all(
        "SELECT card_id, agent_turn_id, card_type, content, metadata, created_at, tokens "
        f"FROM cards WHERE card_id IN ({marks(len(keep))})",
        tuple(keep),
    ) if keep else []  # fmt: skip
    by_id = {r[0]: r for r in found}
    kept = [by_id[c] for c in keep if c in by_id]
    summary = (swap.summary, tokens_of(env, token.agent_id, swap.summary))
    priced = _priced(env, token.agent_id, step_cards)
    total = summary[1] + sum(int(r[6]) for r in kept) + sum(t for _, t in priced)
    total += max(swap.correction, 0)
    context_box, output_box = new_id(), new_id()
    head.fence(
        tx,
        env,
        token,
        sets={"context_box_id": context_box, "output_box_id": output_box, "context_tokens": total},
    )
    insert_rows(
        tx,
        "INSERT INTO boxes (box_id, agent_id, agent_turn_id, kind, created_at)",
        [
            (context_box, token.agent_id, token.agent_turn_id, "context", now),
            (output_box, token.agent_id, token.agent_turn_id, "output", now),
        ],
    )
    insert_cards(tx, env, context_box, token.agent_turn_id, [summary])
    insert_copies(tx, output_box, None, kept)
    insert_cards(tx, env, output_box, token.agent_turn_id, priced)
    edge(
        tx,
        env,
        token.agent_id,
        token.agent_turn_id,
        "compact",
        "response",
        metadata={**swap.edge, "context_tokens": total},
    )
    return total


def add_context_tokens(tx: Tx, env: StoreEnv, token: TurnToken, delta: int) -> None:
    """The provider counted more than the estimate: correct the running count up."""
    head.fence(tx, env, token, exprs={"context_tokens": "context_tokens + ?"}, expr_params=(delta,))


def retry_step(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    step_id: str,
    attempt: int,
    kind: str,
    delay_s: float,
    error: str,
) -> float:
    """Close the failed step as ``retrying`` and queue a ``resume`` row due after
    ``delay_s``: the durable retry wait. The failed attempt does not count toward the
    step limit and leaves no card. Returns the due time. CAS-fenced on ``running``."""
    now = env.clock.now()
    due = now + delay_s
    head.fence(
        tx,
        env,
        token,
        exprs={"step_count": "CASE WHEN step_count > 0 THEN step_count - 1 ELSE 0 END"},
    )
    meta = {"attempt": attempt, "kind": kind, "delay_s": delay_s, "error": error}
    tx.execute(
        "UPDATE agent_steps SET status = ?, ended_at = ?, metadata = ? WHERE step_id = ?",
        (AgentStepStatus.RETRYING, now, json.dumps(meta), step_id),
    )
    tx.execute(
        "INSERT INTO agent_inbox (inbox_id, agent_id, message_type, status, "
        "agent_turn_id, turn_epoch, payload, next_retry_at, defer_reason, created_at, "
        "updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (
            new_id(),
            token.agent_id,
            MessageType.RESUME,
            InboxStatus.PENDING,
            token.agent_turn_id,
            token.turn_epoch,
            step_retry_payload(attempt),
            due,
            f"step retry {attempt} after {kind}",
            now,
            now,
        ),
    )
    edge(tx, env, token.agent_id, token.agent_turn_id, "step_retry", "request", metadata=meta)
    return due


def take_resume(tx: Tx, env: StoreEnv, row: InboxRow) -> TurnToken | None:
    """Consume a ``resume`` row if its Turn is still running at the row's epoch."""
    token = row.token
    if token is None:
        skip_row(tx, env, row, "resume without a Turn")
        return None
    try:
        head.fence(tx, env, token)
    except StaleTurn:
        skip_row(tx, env, row, "stale turn")
        return None
    inbox_move(tx, env, row.inbox_id, InboxEvent.CONSUME)
    return token


# -- the end of a Turn ---------------------------------------------------------------------

_ENDING = (
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
) -> Finished:
    """Deliverable card + head to idle + reply outbox + next lease, in one transaction.

    ``ending``: the row of ``_ENDING`` if the caller read it already; ``before``: cards
    to add ahead of the deliverable (counted on the head like any others)."""
    if ending is None:
        ending = tx.one(_ENDING, (token.agent_id, token.agent_turn_id))
        if ending is None:
            raise StaleTurn(f"{token}: not the active Turn")
    _, _, output_box, context_box, turn_inbox_id, ref, conversation = ending
    now = env.clock.now()
    priced = _priced(env, token.agent_id, before)
    delta = sum(t for _, t in priced)
    head.fence(
        tx,
        env,
        token,
        event,
        exprs={"context_tokens": "context_tokens + ?"} if delta else None,
        expr_params=(delta,) if delta else (),
        sets={
            "active_agent_turn_id": None,
            "turn_inbox_id": None,
            "waiting_tool_count": 0,
            "resume_deadline": None,
            "dispatched_at": None,
            "running_since": None,
        },
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
) -> Finished:
    """running → idle with the deliverable card and the pending reply (one transaction).
    With ``step_id``, that step is completed first, as :func:`complete_step` would
    (``completion``, ``cards`` ahead of the deliverable), in the same compare-and-set."""
    fin = end_turn(
        tx, env, token, HeadEvent.FINISH, status, text, metadata, reply_payload, before=cards
    )
    if step_id is not None:
        close_step(tx, env, step_id, completion, AgentStepStatus.COMPLETED, ())
    return fin


def force_end(
    tx: Tx,
    env: StoreEnv,
    agent_id: str,
    status: str,
    text: str,
    reply_payload: bytes | None,
    agent_turn_id: str | None,
    turn_epoch: int | None,
    expect_status: Sequence[str] | None,
) -> Finished | None:
    """End the active Turn (stop, watchdog): epoch + 1, failed deliverable, reply.
    ``None`` when nothing matched (no active Turn, or it already moved on)."""
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
        {"forced": True},
        reply_payload,
        ending=row[1:],
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


def turn_reply_ref(tx: Tx, env: StoreEnv, token: TurnToken) -> str | None:
    row = tx.one(
        "SELECT i.reply_ref FROM agent_state_head h JOIN agent_inbox i "
        "ON i.inbox_id = h.turn_inbox_id WHERE h.agent_id = ? AND h.active_agent_turn_id = ?",
        (token.agent_id, token.agent_turn_id),
    )
    return row[0] if row else None
