"""A Turn's steps and tool waits on PostgreSQL in one round trip each (two for
``apply_report``): the variants of ``agents/store/sql/turns.py``, ``governance.py`` and
``tools.py`` (see :mod:`.one_trip` for how, and what a miss does)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentserver.agents.ports import LLMCompletion
from agentserver.agents.store.base import (
    Head,
    InboxRow,
    NewCard,
    ReportOutcome,
    StepStart,
    ToolCallRecord,
    TurnToken,
)
from agentserver.agents.store.governance import StepRecord
from agentserver.agents.store.pg.executor import Later
from agentserver.agents.store.pg.notify import notify
from agentserver.agents.store.pg.one_trip import (
    Missed,
    PipeTx,
    append_cards,
    bump,
    closing,
    fence,
    head_of,
    move,
    one_trip,
)
from agentserver.agents.store.sql import governance, memory, tools, turns
from agentserver.agents.store.sql.budgets import HoldFor, Spend, settle_spends
from agentserver.agents.store.sql.common import (
    CONSUMED_PAYLOAD,
    HEAD_COLS,
    edge,
    inbox_move_statement,
    insert_cards,
    tokens_of,
)
from agentserver.agents.store.sql.db import Row, StoreEnv, new_id
from agentserver.agents.store.sql.turns import close_step
from agentserver.agents.store.states import (
    AfterExecution,
    AgentStepStatus,
    HeadEvent,
    HeadStatus,
    InboxEvent,
    MessageType,
    WaitingStatus,
)


@one_trip
def start_turn_step(
    tx: PipeTx, env: StoreEnv, channel: str | None, row: InboxRow, max_steps: int
) -> StepStart:
    """:func:`~agentserver.agents.store.sql.turns.start_turn_step` in one round trip."""
    token = row.token
    if token is None:
        raise Missed("no Turn")  # (nothing sent yet) the shared function says why
    h = fence(
        tx,
        env,
        token,
        HeadEvent.START,
        given=env.served.start_given(token.agent_id),
        exprs={"step_count": "step_count + 1"},
        where=turns.UNDER_LIMIT,
        where_params=(max_steps,),
    )
    move(tx, env, row.inbox_id, InboxEvent.CONSUME, **turns.consumed(env, token.agent_id))
    edge(tx, env, token.agent_id, token.agent_turn_id, "start", "request", inbox_id=row.inbox_id)
    step_id = new_id()
    tx.execute(
        "INSERT INTO agent_steps (step_id, agent_id, agent_turn_id, turn_epoch, step_no, "
        f"status, started_at, version) VALUES (?,?,?,?,{head_of('step_count')},?,?,?)",
        (
            step_id,
            token.agent_id,
            token.agent_turn_id,
            token.turn_epoch,
            token.agent_id,
            AgentStepStatus.STARTED,
            env.clock.now(),
            env.served.version(token.agent_id),
        ),
    )
    if channel is not None:
        notify(tx, channel)
    # The Turn's cards, its context's memory resolved (agents/store/sql/memory.py), by
    # the boxes the head names after the statements before it in this trip.
    rows = tx.last(
        memory.resolve_sql(_HEAD_BOX.format("context_box_id"), _HEAD_BOX.format("output_box_id")),
        memory.resolve_params((token.agent_id,), (token.agent_id,)),
    )
    new = Head(*h.rows[0])
    return StepStart(new, step_id, new.step_count, *memory.split(rows))


@one_trip
def complete_step(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    token: TurnToken,
    step_id: str,
    completion: Any,
    cards: Sequence[NewCard],
    swap: Any = None,
    spends: Sequence[Spend] = (),
) -> None:
    """:func:`~agentserver.agents.store.sql.turns.complete_step` in one round trip (its
    ``COMMIT``'s; with ``spends``, two more: a settle reads what it releases and the
    marks it crosses); with a box swap, the shared function."""
    if swap is not None:
        raise Missed("a box swap")  # (nothing sent yet)
    append_cards(tx, env, token, cards)
    close_step(tx, env, step_id, completion, AgentStepStatus.COMPLETED, ())
    settle_spends(tx, env, spends)
    closing(tx, channel, None)


@one_trip
def complete_screened_step(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    token: TurnToken,
    step_id: str,
    completion: Any,
    cards: Sequence[NewCard],
    screened: StepRecord,
    spends: Sequence[Spend] = (),
) -> None:
    """:func:`~agentserver.agents.store.sql.governance.complete_screened_step` in one round
    trip (its ``COMMIT``'s; one more for a step without a completion whose decisions
    go into its metadata, two more with ``spends``)."""
    append_cards(tx, env, token, [*cards, *screened.cards])
    governance.close_screened_step(tx, env, token, step_id, completion, screened)
    settle_spends(tx, env, spends)
    closing(tx, channel, None)


@one_trip
def suspend(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    token: TurnToken,
    step_id: str,
    calls: Sequence[ToolCallRecord],
    cards: Sequence[NewCard],
    resume_deadline: float,
    completion: LLMCompletion | None = None,
    step_cards: Sequence[NewCard] = (),
    screened: StepRecord | None = None,
    spends: Sequence[Spend] = (),
) -> int:
    """:func:`~agentserver.agents.store.sql.tools.suspend` in one round trip (its step
    completed with it included; one more for a step without a completion whose
    decisions go into its metadata, two more with ``spends``)."""
    if not calls:
        raise ValueError("suspend needs at least one tool call")
    now = env.clock.now()
    call_cards = tools.tool_call_cards(calls)
    before = [*step_cards, *(screened.cards if screened else ()), *cards]
    ids = append_cards(
        tx,
        env,
        token,
        [*before, *call_cards],
        HeadEvent.SUSPEND,
        given=tools.suspend_given(calls, resume_deadline),
    )
    call_ids = [c.tool_call_id for c in calls]
    tools.record_waiting(tx, token, step_id, calls, ids[len(before) :], now)
    tools.close_suspended_step(tx, env, token, step_id, completion, screened, call_ids)
    settle_spends(tx, env, spends)
    if channel is not None:
        notify(tx, channel)
    sql, params = tools.early_reports_statement(token, call_ids, now)
    ((early,),) = tx.last(f"WITH u AS ({sql} RETURNING 1) SELECT count(*) FROM u", params)
    return int(early)


_LOCK_HEAD = f"SELECT {HEAD_COLS} FROM agent_state_head WHERE agent_id = ? FOR UPDATE"
#: The report's waiting row, the first terminating result of its Turn so far (and
#: when it came), the Turn's reply reference: read after the head is locked (a statement
#: of its own, so its snapshot is taken after the lock is held).
_WAITING = (
    "SELECT w.agent_turn_id, w.turn_epoch, w.status, w.to_listener, w.after_execution, "
    "w.created_at, t.result_card_id, t.created_at, (SELECT i.reply_ref FROM "
    "agent_state_head h JOIN agent_inbox i ON i.inbox_id = h.turn_inbox_id "
    "WHERE h.agent_id = w.agent_id) FROM turn_waiting_tools w LEFT JOIN LATERAL "
    "(SELECT result_card_id, created_at FROM turn_waiting_tools WHERE agent_turn_id = "
    "w.agent_turn_id AND turn_epoch = w.turn_epoch AND status = ? AND after_execution = ? "
    "ORDER BY created_at LIMIT 1) t ON true WHERE w.tool_call_id = ? AND w.agent_id = ?"
)


@one_trip
def apply_report(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    row: InboxRow,
    then_step: int | None = None,
    hold_for: HoldFor | None = None,
) -> ReportOutcome:
    """:func:`~agentserver.agents.store.sql.tools.apply_report` in two round trips: the head
    locked (``FOR UPDATE``) and the report's waiting row read, then every write with
    ``COMMIT``. With the head locked, what the shared function learns from its
    compare-and-sets (a stale Turn, the count of calls still waiting, the step limit)
    is known from the head read, so the writes that follow need no answer. The step it
    opens takes no reservation (``hold_for``, as :func:`apply_tool_result`)."""
    locked = tx.later(_LOCK_HEAD, (row.agent_id,))
    waiting = tx.one(
        _WAITING,
        (WaitingStatus.RECEIVED, AfterExecution.TERMINATE, row.correlation_id, row.agent_id),
    )
    if waiting is None or waiting[2] != WaitingStatus.WAITING:
        return closing(tx, channel, tools.unapplied(tx, env, row, waiting))
    return _apply(tx, env, channel, row, locked, waiting, then_step)


@one_trip
def apply_tool_result(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    agent_id: str,
    tool_call_id: str,
    payload: bytes,
    failed: bool,
    then_step: int | None = None,
    hold_for: HoldFor | None = None,
) -> ReportOutcome:
    """:func:`~agentserver.agents.store.sql.tools.apply_tool_result` in two round trips,
    as :func:`apply_report` (no inbox row); a report its Turn does not wait for is the
    shared function's (a miss: it is kept in the inbox). The step it opens takes no
    reservation (``hold_for``: it would cost a round trip more, as a call of its own
    does): its first model call reserves by itself."""
    locked = tx.later(_LOCK_HEAD, (agent_id,))
    waiting = tx.one(
        _WAITING, (WaitingStatus.RECEIVED, AfterExecution.TERMINATE, tool_call_id, agent_id)
    )
    if waiting is None or waiting[2] != WaitingStatus.WAITING:
        raise Missed("not waiting for this report")
    row = tools.direct_report(agent_id, tool_call_id, payload, failed)
    return _apply(tx, env, channel, row, locked, waiting, then_step)


def _apply(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    row: InboxRow,
    locked: Later,
    waiting: Row,
    then_step: int | None,
) -> ReportOutcome:
    """Apply report ``row`` to its ``waiting`` row (read with :data:`_WAITING`, still
    waiting) under the head ``locked``; ``row`` is consumed unless it was never kept (no
    inbox id)."""
    now = env.clock.now()
    agent = row.agent_id
    turn_id, epoch, _, to, after, created, term_before, term_at, ref = waiting
    h = Head(*locked.rows[0]) if locked.rows else None
    if (
        h is None
        or h.agent_turn_id != turn_id
        or h.turn_epoch != epoch
        or h.status != HeadStatus.SUSPENDED
    ):
        if row.inbox_id:
            tools.skip_stale(tx, env, row)
        return closing(tx, channel, ReportOutcome("stale"))
    token = TurnToken(agent, turn_id, epoch)
    result = tools.result_card(row, to, after)
    tokens = tokens_of(env, agent, result)
    fence(
        tx,
        env,
        token,
        HeadStatus.SUSPENDED,
        exprs={
            "waiting_tool_count": "waiting_tool_count - 1",
            "context_tokens": "context_tokens + ?",
        },
        expr_params=(tokens,),
    )
    (card_id,) = insert_cards(tx, env, str(h.output_box_id), turn_id, [(result, tokens)])
    tx.execute(*tools.received_statement(row, card_id, now))
    if row.inbox_id:
        tx.execute(
            *inbox_move_statement(env, row.inbox_id, InboxEvent.CONSUME, payload=CONSUMED_PAYLOAD)
        )
    if h.waiting_tool_count - 1 > 0:
        return closing(tx, channel, ReportOutcome("applied"))
    resumed = fence(tx, env, token, HeadEvent.RESUME)
    term = term_before
    if (
        row.message_type != MessageType.TIMEOUT
        and after == AfterExecution.TERMINATE
        and (term_before is None or created < term_at)
    ):
        term = card_id  # this report's own result comes first
    edge(tx, env, agent, turn_id, "resume", "request")
    new_epoch = epoch + bump(HeadEvent.RESUME)
    now_running = TurnToken(agent, turn_id, new_epoch)
    if then_step is None or term is not None:
        closing(tx, channel, None)
        return ReportOutcome("applied", now_running, term, ref, None)
    stepped: Later | None = None
    step_id = None
    if h.step_count < then_step:  # (the step's compare-and-set would hit: under the limit)
        stepped = fence(tx, env, now_running, HeadStatus.RUNNING, **_STEP)
        step_id = new_id()
        tx.execute(
            "INSERT INTO agent_steps (step_id, agent_id, agent_turn_id, turn_epoch, step_no, "
            "status, started_at, version) VALUES (?,?,?,?,?,?,?,?)",
            (
                step_id,
                agent,
                turn_id,
                new_epoch,
                h.step_count + 1,
                AgentStepStatus.STARTED,
                env.clock.now(),
                env.served.version(agent),
            ),
        )
    if channel is not None:
        notify(tx, channel)
    rows = tx.last(
        memory.resolve_sql(), memory.resolve_params((h.context_box_id,), (h.output_box_id,))
    )
    now_head = Head(*(stepped if stepped is not None else resumed).rows[0])
    step = StepStart(
        now_head,
        step_id,
        now_head.step_count,
        *memory.split(rows),
    )
    return ReportOutcome("applied", now_running, term, ref, step)


#: A box the head of an agent (the parameter) names: ``context_box_id`` or ``output_box_id``.
_HEAD_BOX = "(SELECT {} FROM agent_state_head WHERE agent_id = ?)"

#: The compare-and-set keywords of a step begun (as ``open_step``'s, under the limit).
_STEP: dict[str, Any] = {"exprs": {"step_count": "step_count + 1"}}
