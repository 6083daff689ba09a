"""A Turn's life on the head: start, steps and their cards, compaction, retry (its end:
:mod:`~agentserver.agents.store.sql.turn_end`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agentserver.agents.errors import StaleTurn
from agentserver.agents.ports import LLMCompletion
from agentserver.agents.profile.retry import step_retry_payload
from agentserver.agents.store.base import (
    BoxSwap,
    InboxRow,
    NewCard,
    StepStart,
    TurnToken,
)
from agentserver.agents.store.sql import head
from agentserver.agents.store.sql.budgets import Spend, settle_spends
from agentserver.agents.store.sql.common import (
    CONSUMED_PAYLOAD,
    edge,
    inbox_move,
    insert_cards,
    insert_copies,
    tokens_of,
)
from agentserver.agents.store.sql.db import StoreEnv, Tx, insert_rows, marks, new_id
from agentserver.agents.store.sql.memory import turn_cards
from agentserver.agents.store.states import (
    AgentStepStatus,
    HeadEvent,
    HeadStatus,
    InboxEvent,
    InboxStatus,
    MessageType,
)


def start_turn(tx: Tx, env: StoreEnv, row: InboxRow) -> TurnToken:
    """dispatched → running for the Turn of ``row``; the Enqueue row is consumed."""
    token = row.token
    if token is None:
        raise StaleTurn(f"inbox {row.inbox_id} carries no Turn")
    head.fence(tx, env, token, HeadEvent.START, given=env.served.start_given(token.agent_id))
    if not inbox_move(tx, env, row.inbox_id, InboxEvent.CONSUME, **consumed(env, token.agent_id)):
        raise StaleTurn(f"inbox {row.inbox_id} is no longer processing")
    edge(tx, env, token.agent_id, token.agent_turn_id, "start", "request", inbox_id=row.inbox_id)
    return token


def consumed(env: StoreEnv, agent_id: str) -> dict[str, Any]:
    """What a started task's row keeps: no payload (its task card has it), and the version
    that started it."""
    return {"payload": CONSUMED_PAYLOAD, "version": env.served.version(agent_id)}


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
        "status, started_at, version) VALUES (?,?,?,?,?,?,?,?)",
        (
            step_id,
            token.agent_id,
            token.agent_turn_id,
            token.turn_epoch,
            step_no,
            AgentStepStatus.STARTED,
            env.clock.now(),
            env.served.version(token.agent_id),
        ),
    )
    return step_id


UNDER_LIMIT = " AND step_count < ?"


def open_step(tx: Tx, env: StoreEnv, token: TurnToken, max_steps: int) -> StepStart:
    """The worker's step: count and record it unless ``max_steps`` are taken (then no
    step, the head as it is), and the Turn's cards for its model call. CAS-fenced."""
    try:
        h = head.fence(
            tx,
            env,
            token,
            exprs={"step_count": "step_count + 1"},
            where=UNDER_LIMIT,
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
            given=env.served.start_given(token.agent_id),
            exprs={"step_count": "step_count + 1"},
            where=UNDER_LIMIT,
            where_params=(max_steps,),
        )
    except StaleTurn:
        # Nothing was written: fenced out (start_turn raises) or at the step limit.
        start_turn(tx, env, row)
        return open_step(tx, env, token, max_steps)
    if not inbox_move(tx, env, row.inbox_id, InboxEvent.CONSUME, **consumed(env, token.agent_id)):
        raise StaleTurn(f"inbox {row.inbox_id} is no longer processing")
    edge(tx, env, token.agent_id, token.agent_turn_id, "start", "request", inbox_id=row.inbox_id)
    step_id = _insert_step(tx, env, token, h.step_count)
    return StepStart(h, step_id, h.step_count, *turn_cards(tx, h.context_box_id, h.output_box_id))


def with_tokens(
    env: StoreEnv, agent_id: str, cards: Sequence[NewCard]
) -> list[tuple[NewCard, int]]:
    """``cards`` with the context tokens each costs the agent."""
    return [(c, tokens_of(env, agent_id, c)) for c in cards]


def append_cards(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    cards: Sequence[NewCard],
    how: HeadEvent | HeadStatus = HeadStatus.RUNNING,
    given: Mapping[str, Any] | None = None,
    **kw: Any,
) -> tuple[list[str], Any]:
    """The compare-and-set ``how`` (a fence on running by default; an event's effects
    take the values ``given``) that also counts the cards' tokens, then the cards into
    the output box. Returns (card ids, head)."""
    priced = with_tokens(env, token.agent_id, cards)
    delta = sum(t for _, t in priced)
    exprs = dict(kw.pop("exprs", None) or {})
    params = tuple(kw.pop("expr_params", ()))
    if delta:
        exprs["context_tokens"] = "context_tokens + ?"
        params += (delta,)
    h = head.fence(tx, env, token, how, given=given, exprs=exprs, expr_params=params, **kw)
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
    spends: Sequence[Spend] = (),
) -> None:
    """Record the model's reply (usage, cost) and the step's cards; CAS-fenced. With
    ``swap``, the step's compaction is committed with it (one compare-and-set).
    ``spends``: the step's model calls settled in their budgets, in the same transaction."""
    if swap is None:
        append_cards(tx, env, token, cards)
    else:
        compact(tx, env, swap, token, cards)
    close_step(tx, env, step_id, completion, AgentStepStatus.COMPLETED, ())
    settle_spends(tx, env, spends)


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
    priced = with_tokens(env, token.agent_id, step_cards)
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
    *,
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


def turn_reply_ref(tx: Tx, env: StoreEnv, token: TurnToken) -> str | None:
    row = tx.one(
        "SELECT i.reply_ref FROM agent_state_head h JOIN agent_inbox i "
        "ON i.inbox_id = h.turn_inbox_id WHERE h.agent_id = ? AND h.active_agent_turn_id = ?",
        (token.agent_id, token.agent_turn_id),
    )
    return row[0] if row else None
