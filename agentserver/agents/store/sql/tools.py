"""Tool waits: the suspend with its waiting set, applying reports, timeouts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentserver.agents.errors import StaleTurn
from agentserver.agents.ports import LLMCompletion
from agentserver.agents.store.base import (
    CardType,
    InboxRow,
    NewCard,
    ReportOutcome,
    ToolCallRecord,
    TurnToken,
)
from agentserver.agents.store.governance import StepRecord
from agentserver.agents.store.sql import head
from agentserver.agents.store.sql.budgets import HoldFor, Spend, hold_step, settle_spends
from agentserver.agents.store.sql.common import (
    CONSUMED_PAYLOAD,
    edge,
    inbox_move,
    insert_cards,
    rename_call_card,
    tokens_of,
)
from agentserver.agents.store.sql.db import Row, StoreEnv, Tx, insert_rows, marks, new_id
from agentserver.agents.store.sql.governance import close_screened_step
from agentserver.agents.store.sql.inbox import insert_report, report_tool_result
from agentserver.agents.store.sql.turns import append_cards, close_step, open_step
from agentserver.agents.store.states import (
    AfterExecution,
    AgentStepStatus,
    HeadEvent,
    HeadStatus,
    InboxEvent,
    InboxStatus,
    MessageType,
    WaitingStatus,
)


def suspend(
    tx: Tx,
    env: StoreEnv,
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
    """running → suspended with the waiting set ``calls`` (tool.call cards included),
    the step closed, and its model calls settled in their budgets (``spends``).

    The step's reply may be written in the same compare-and-set (the worker's common
    case: the step completed and suspended in one transaction): ``completion`` and its
    ``step_cards``, and governance's ``screened`` record of the calls (its refusal cards
    after the step's, its decisions in the step's metadata). The cards go in that order:
    ``step_cards``, the refusals, ``cards``, the calls'.

    Reports for these calls that arrived early (deferred) become due immediately; returns
    how many."""
    if not calls:
        raise ValueError("suspend needs at least one tool call")
    now = env.clock.now()
    call_cards = tool_call_cards(calls)
    before = [*step_cards, *(screened.cards if screened else ()), *cards]
    ids, _ = append_cards(
        tx,
        env,
        token,
        [*before, *call_cards],
        HeadEvent.SUSPEND,
        given=suspend_given(calls, resume_deadline),
    )
    call_ids = [c.tool_call_id for c in calls]
    record_waiting(tx, token, step_id, calls, ids[len(before) :], now)
    tx.execute(*early_reports_statement(token, call_ids, now))
    early = tx.rowcount
    close_suspended_step(tx, env, token, step_id, completion, screened, call_ids)
    settle_spends(tx, env, spends)
    return early


def close_suspended_step(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    step_id: str,
    completion: LLMCompletion | None,
    screened: StepRecord | None,
    call_ids: Sequence[str],
) -> None:
    """The step a suspend closes: with its reply's usage (``completion``) and governance's
    decisions when they are written with it."""
    if screened:
        close_screened_step(tx, env, token, step_id, completion, screened, call_ids)
    else:
        close_step(tx, env, step_id, completion, AgentStepStatus.COMPLETED, call_ids)


def suspend_given(calls: Sequence[ToolCallRecord], resume_deadline: float) -> dict[str, Any]:
    """The values a suspend's effects take (:data:`~agentserver.agents.store.states.HEAD_EFFECTS`)."""
    return {"calls": len(calls), "deadline": resume_deadline}


def tool_call_cards(calls: Sequence[ToolCallRecord]) -> list[NewCard]:
    """The tool.call card of each call a suspend waits for."""
    return [
        NewCard(
            CardType.TOOL_CALL,
            call.payload,
            {**call.metadata, "tool_call_id": call.tool_call_id, "to": call.to},
        )
        for call in calls
    ]


def record_waiting(
    tx: Tx,
    token: TurnToken,
    step_id: str,
    calls: Sequence[ToolCallRecord],
    card_ids: Sequence[str],
    now: float,
) -> None:
    """The waiting set of a suspend (``card_ids``: the calls' tool.call cards) and an
    edge per call."""
    insert_rows(
        tx,
        "INSERT INTO turn_waiting_tools (tool_call_id, agent_id, agent_turn_id, "
        "turn_epoch, step_id, to_listener, after_execution, status, created_at, "
        "updated_at)",
        [
            (
                call.tool_call_id,
                token.agent_id,
                token.agent_turn_id,
                token.turn_epoch,
                step_id,
                call.to,
                call.after_execution,
                WaitingStatus.WAITING,
                now,
                now,
            )
            for call in calls
        ],
    )
    insert_rows(
        tx,
        "INSERT INTO execution_edges (agent_id, agent_turn_id, primitive, edge_phase, "
        "correlation_id, inbox_id, created_at, metadata)",
        [
            (
                token.agent_id,
                token.agent_turn_id,
                "tool_call",
                "request",
                call.tool_call_id,
                None,
                now,
                json.dumps({"to": call.to, "card_id": card_id}),
            )
            for call, card_id in zip(calls, card_ids, strict=True)
        ],
    )


def early_reports_statement(
    token: TurnToken, call_ids: Sequence[str], now: float
) -> tuple[str, tuple[Any, ...]]:
    """The ``UPDATE`` that makes the reports of ``call_ids`` that came before their
    suspend (deferred) due now, for the Turn of ``token``; its row count is theirs."""
    return (
        "UPDATE agent_inbox SET next_retry_at = ?, agent_turn_id = ?, turn_epoch = ? "
        f"WHERE correlation_id IN ({marks(len(call_ids))}) AND status = ?",
        (now, token.agent_turn_id, token.turn_epoch, *call_ids, InboxStatus.DEFERRED),
    )


def apply_report(
    tx: Tx,
    env: StoreEnv,
    row: InboxRow,
    then_step: int | None = None,
    hold_for: HoldFor | None = None,
) -> ReportOutcome:
    """Apply one claimed tool_result/timeout row to its waiting set (single winner).

    Duplicates and late results are acknowledged (``skipped``) and change nothing. A
    report with no waiting row yet is deferred with backoff until
    ``settings.max_retries`` is exhausted, then marked ``error``. A resume returns the
    Turn's reply reference and, with ``then_step`` (the step limit) unless a tool ends
    the Turn, opens its next step (:func:`~agentserver.agents.store.sql.turns.open_step`),
    with its first model call's reservation when ``hold_for`` asks for one
    (:func:`~agentserver.agents.store.sql.budgets.hold_step`)."""
    waiting = _waiting(tx, row.agent_id, str(row.correlation_id))
    if waiting is None or waiting[2] != WaitingStatus.WAITING:
        return unapplied(tx, env, row, waiting)
    return _apply(tx, env, row, waiting, then_step, hold_for)


def apply_tool_result(
    tx: Tx,
    env: StoreEnv,
    agent_id: str,
    tool_call_id: str,
    payload: bytes,
    failed: bool,
    then_step: int | None = None,
    hold_for: HoldFor | None = None,
) -> ReportOutcome:
    """A peer's report on the sub-thread ``tool_call_id``, applied in the transaction
    that records it when its Turn waits for it: the result card, the waiting row
    answered, and when it completes the set the Turn resumed (its next step opened with
    ``then_step`` and ``hold_for``, as :func:`apply_report`), all with no inbox row. A
    report its Turn does not wait for is kept in the inbox as before (``queued``: one
    before its suspend is deferred; a duplicate or late one is acknowledged by the
    worker); one for a Turn that moved on is ``stale``, with nothing written."""
    waiting = _waiting(tx, agent_id, tool_call_id)
    if waiting is None or waiting[2] != WaitingStatus.WAITING:
        report_tool_result(tx, env, agent_id, tool_call_id, payload, failed)
        return ReportOutcome("queued")
    report = direct_report(agent_id, tool_call_id, payload, failed)
    return _apply(tx, env, report, waiting, then_step, hold_for)


def direct_report(agent_id: str, tool_call_id: str, payload: bytes, failed: bool) -> InboxRow:
    """A report applied as it is recorded, as the row it would have been (no inbox id:
    no row is written)."""
    return InboxRow(
        "",
        agent_id,
        MessageType.TOOL_RESULT,
        InboxStatus.PROCESSING,
        None,
        None,
        tool_call_id,
        payload,
        None,
        failed,
        0,
        0.0,
        None,
        0.0,
    )


def _waiting(tx: Tx, agent_id: str, tool_call_id: str) -> Row | None:
    """The waiting row of a call: ``agent_turn_id, turn_epoch, status, to_listener,
    after_execution``."""
    return tx.one(
        "SELECT agent_turn_id, turn_epoch, status, to_listener, after_execution "
        "FROM turn_waiting_tools WHERE tool_call_id = ? AND agent_id = ?",
        (tool_call_id, agent_id),
    )


def _apply(
    tx: Tx,
    env: StoreEnv,
    row: InboxRow,
    waiting: Row,
    then_step: int | None,
    hold_for: HoldFor | None = None,
) -> ReportOutcome:
    """Apply report ``row`` to the ``waiting`` row it answers (still waiting); ``row``
    is consumed unless it was never kept (no inbox id)."""
    now = env.clock.now()
    turn_id, epoch, _, to, after = waiting
    token = TurnToken(row.agent_id, turn_id, epoch)
    result = result_card(row, to, after)
    tokens = tokens_of(env, row.agent_id, result)
    try:
        h = head.fence(
            tx,
            env,
            token,
            HeadStatus.SUSPENDED,
            exprs={
                "waiting_tool_count": "waiting_tool_count - 1",
                "context_tokens": "context_tokens + ?",
            },
            expr_params=(tokens,),
            stale="suspended head moved",
        )
    except StaleTurn:
        if row.inbox_id:
            skip_stale(tx, env, row)
        return ReportOutcome("stale")
    (card_id,) = insert_cards(tx, env, str(h.output_box_id), turn_id, [(result, tokens)])
    tx.execute(*received_statement(row, card_id, now))
    if row.inbox_id:
        inbox_move(tx, env, row.inbox_id, InboxEvent.CONSUME, payload=CONSUMED_PAYLOAD)
    if h.waiting_tool_count > 0:
        return ReportOutcome("applied")
    resumed = head.fence(tx, env, token, HeadEvent.RESUME)
    # The terminating result (if any) and the Turn's reply reference, in one statement.
    term, ref = tx.one(
        "SELECT (SELECT result_card_id FROM turn_waiting_tools WHERE agent_turn_id = ? "
        "AND turn_epoch = ? AND status = ? AND after_execution = ? "
        "ORDER BY created_at LIMIT 1), "
        "(SELECT reply_ref FROM agent_inbox WHERE inbox_id = ?)",
        (
            turn_id,
            epoch,
            WaitingStatus.RECEIVED,
            AfterExecution.TERMINATE,
            resumed.turn_inbox_id,
        ),
    ) or (None, None)
    edge(tx, env, row.agent_id, turn_id, "resume", "request")
    now_running = TurnToken(row.agent_id, turn_id, resumed.turn_epoch)
    step = None
    if then_step is not None and term is None:
        step = hold_step(tx, env, ref, open_step(tx, env, now_running, then_step), hold_for)
    return ReportOutcome("applied", now_running, term, ref, step)


def unapplied(tx: Tx, env: StoreEnv, row: InboxRow, waiting: Sequence[Any] | None) -> ReportOutcome:
    """A report whose waiting row (``agent_turn_id, turn_epoch, status, …``) is missing
    (deferred, or exhausted) or no longer waiting (a duplicate): its row moved, and the
    outcome."""
    if waiting is None:
        s = env.settings
        if row.retry_count >= s.max_retries:
            inbox_move(
                tx,
                env,
                row.inbox_id,
                InboxEvent.FAIL,
                defer_reason="retries exhausted: no such tool call",
            )
            return ReportOutcome("exhausted")
        inbox_move(
            tx,
            env,
            row.inbox_id,
            InboxEvent.DEFER,
            retry_count=row.retry_count + 1,
            next_retry_at=env.clock.now() + s.retry_base_s * (2**row.retry_count),
            defer_reason="awaiting suspend",
        )
        return ReportOutcome("deferred")
    inbox_move(
        tx, env, row.inbox_id, InboxEvent.SKIP, defer_reason=f"duplicate or late ({waiting[2]})"
    )
    return ReportOutcome("duplicate")


def skip_stale(tx: Tx, env: StoreEnv, row: InboxRow) -> None:
    """A report for a Turn that moved on (its suspended head is gone): acknowledged."""
    inbox_move(tx, env, row.inbox_id, InboxEvent.SKIP, defer_reason="stale turn")


def result_card(row: InboxRow, to: str, after: str) -> NewCard:
    """The tool.result card of a report ``row`` for a call to ``to``."""
    is_timeout = row.message_type == MessageType.TIMEOUT
    return NewCard(
        CardType.TOOL_RESULT,
        bytes(row.payload).decode("utf-8", "replace"),
        {
            "tool_call_id": row.correlation_id,
            "to": to,
            "failed": row.failed or is_timeout,
            "timeout": is_timeout,
            "after_execution": after,
        },
    )


def received_statement(row: InboxRow, card_id: str, now: float) -> tuple[str, tuple[Any, ...]]:
    """The ``UPDATE`` marking the waiting row of report ``row`` answered by ``card_id``."""
    is_timeout = row.message_type == MessageType.TIMEOUT
    return (
        "UPDATE turn_waiting_tools SET status = ?, result_card_id = ?, updated_at = ? "
        "WHERE tool_call_id = ? AND status = ?",
        (
            WaitingStatus.TIMEOUT if is_timeout else WaitingStatus.RECEIVED,
            card_id,
            now,
            row.correlation_id,
            WaitingStatus.WAITING,
        ),
    )


def inject_timeouts(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    reason: str = "timed out",
    only: Sequence[str] | None = None,
) -> int:
    """One timeout report per still-waiting tool; clears ``resume_deadline`` (once).

    ``only``: just these calls, and the deadline stays (the Turn's other calls still wait:
    a restart re-sent them)."""
    if only is None:
        head.fence(
            tx,
            env,
            token,
            HeadStatus.SUSPENDED,
            sets={"resume_deadline": None},
            where=" AND resume_deadline IS NOT NULL",
            stale="not suspended with a deadline",
        )
    else:
        head.fence(tx, env, token, HeadStatus.SUSPENDED, stale="not suspended")
    waiting = tx.all(
        "SELECT tool_call_id, to_listener FROM turn_waiting_tools WHERE agent_turn_id = ? "
        "AND turn_epoch = ? AND status = ? AND after_execution != ?",
        (token.agent_turn_id, token.turn_epoch, WaitingStatus.WAITING, AfterExecution.APPROVAL),
    )
    if only is not None:
        chosen = set(only)
        waiting = [w for w in waiting if w[0] in chosen]
    for tool_call_id, to in waiting:
        text = f"No result from {to}: the tool call {reason}."
        insert_report(
            tx,
            env,
            new_id(),
            token.agent_id,
            MessageType.TIMEOUT,
            tool_call_id,
            text.encode(),
            True,
        )
    return len(waiting)


def waiting_calls(tx: Tx, env: StoreEnv, token: TurnToken) -> list[ToolCallRecord]:
    """The Turn's tool calls still waiting for a result (approvals excluded), as their
    tool.call cards recorded them (payload, idempotency key)."""
    waiting = {
        r[0]: r
        for r in tx.all(
            "SELECT tool_call_id, to_listener, after_execution FROM turn_waiting_tools "
            "WHERE agent_turn_id = ? AND turn_epoch = ? AND status = ? AND after_execution != ?",
            (
                token.agent_turn_id,
                token.turn_epoch,
                WaitingStatus.WAITING,
                AfterExecution.APPROVAL,
            ),
        )
    }
    if not waiting:
        return []
    out = []
    for content, metadata in tx.all(
        "SELECT content, metadata FROM cards WHERE agent_turn_id = ? AND card_type = ? "
        "ORDER BY seq",
        (token.agent_turn_id, CardType.TOOL_CALL),
    ):
        meta = json.loads(metadata)
        row = waiting.get(meta.get("tool_call_id"))
        if row is not None:
            out.append(ToolCallRecord(row[0], row[1], content, row[2], meta))
    return out


def rebind_call(
    tx: Tx, env: StoreEnv, token: TurnToken, old: str, new: str, resume_deadline: float
) -> None:
    """Waiting call ``old`` of a suspended Turn was sent again (a restart) as sub-thread
    ``new``: its waiting row and tool.call card name ``new`` now, the Turn waits for it
    until ``resume_deadline`` (at least), and a result that beat this transaction (deferred)
    is due now. Raises StaleTurn when the Turn moved on."""
    now = env.clock.now()
    head.fence(
        tx,
        env,
        token,
        HeadStatus.SUSPENDED,
        exprs={
            "resume_deadline": "CASE WHEN resume_deadline IS NULL OR resume_deadline < ? "
            "THEN ? ELSE resume_deadline END"
        },
        expr_params=(resume_deadline, resume_deadline),
        stale="not suspended",
    )
    tx.execute(
        "UPDATE turn_waiting_tools SET tool_call_id = ?, updated_at = ? "
        "WHERE tool_call_id = ? AND status = ?",
        (new, now, old, WaitingStatus.WAITING),
    )
    rename_call_card(tx, token.agent_turn_id, old, new)
    tx.execute(
        "UPDATE agent_inbox SET next_retry_at = ?, agent_turn_id = ?, turn_epoch = ? "
        "WHERE correlation_id = ? AND status = ?",
        (now, token.agent_turn_id, token.turn_epoch, new, InboxStatus.DEFERRED),
    )
