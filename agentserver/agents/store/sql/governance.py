"""Governance rows (issue 14): the policy decisions of each step (the rate windows are
counted from them) and the approval requests of tool calls waiting for a human."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence

from agentserver.agents.errors import StaleTurn
from agentserver.agents.ports import LLMCompletion
from agentserver.agents.store import outbox
from agentserver.agents.store.base import InboxRow, NewCard, TurnToken
from agentserver.agents.store.governance import (
    APPROVAL_PREFIX,
    DecisionRecord,
    PendingApproval,
    StepRecord,
)
from agentserver.agents.store.sql import head
from agentserver.agents.store.sql.budgets import Spend, settle_spends
from agentserver.agents.store.sql.common import inbox_move, rename_call_card
from agentserver.agents.store.sql.db import StoreEnv, Tx, insert_rows, marks, new_id
from agentserver.agents.store.sql.inbox import insert_report
from agentserver.agents.store.sql.turns import append_cards, close_step
from agentserver.agents.store.states import (
    AgentStepStatus,
    ApprovalStatus,
    HeadStatus,
    InboxEvent,
    InboxStatus,
    MessageType,
    WaitingStatus,
)

_APPROVAL_COLS = (
    "a.request_id, a.agent_id, a.agent_turn_id, a.target, a.payload, a.rule, a.approver, "
    "a.deadline, a.thread"
)


def rate_window(tx: Tx, env: StoreEnv, rate_key: str, since: float) -> list[float]:
    rows = tx.all(
        "SELECT at FROM policy_decisions WHERE rate_key = ? AND at > ? ORDER BY at",
        (rate_key, since),
    )
    return [r[0] for r in rows]


def record_decisions(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    step_id: str,
    decisions: Sequence[DecisionRecord],
    cards: Sequence[NewCard],
    approvals: Sequence[PendingApproval] = (),
) -> None:
    """Log the step's decisions and add ``cards`` (refusals), CAS-fenced on running."""
    append_cards(tx, env, token, cards)
    _insert_decisions(tx, env, token, step_id, decisions, approvals)
    _add_policy_meta(tx, step_id, decisions)


def complete_screened_step(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    step_id: str,
    completion: LLMCompletion | None,
    cards: Sequence[NewCard],
    screened: StepRecord,
    spends: Sequence[Spend] = (),
) -> None:
    """``complete_step`` and ``record_decisions`` of the same step in one compare-and-set:
    the step's cards, then the refusals; the decisions in the step's metadata; the
    step's model calls settled (``spends``)."""
    append_cards(tx, env, token, [*cards, *screened.cards])
    close_screened_step(tx, env, token, step_id, completion, screened)
    settle_spends(tx, env, spends)


def close_screened_step(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    step_id: str,
    completion: LLMCompletion | None,
    screened: StepRecord,
    tool_call_ids: Sequence[str] = (),
) -> None:
    """What :func:`complete_screened_step` writes after its compare-and-set and cards:
    the step closed (naming ``tool_call_ids``, the calls a suspend waits for), governance's
    decisions recorded."""
    policy = _policy(screened.decisions)
    close_step(tx, env, step_id, completion, AgentStepStatus.COMPLETED, tool_call_ids, policy)
    if completion is None:
        _add_policy_meta(tx, step_id, screened.decisions)
    _insert_decisions(tx, env, token, step_id, screened.decisions, screened.approvals)


def _policy(decisions: Sequence[DecisionRecord]) -> list[dict[str, str]]:
    """The step log's account of governance's decisions (the step's metadata)."""
    return [{"target": d.target, "decision": d.decision, "rule": d.rule} for d in decisions]


def _add_policy_meta(tx: Tx, step_id: str, decisions: Sequence[DecisionRecord]) -> None:
    if not decisions:
        return
    # The step log names what governance decided for this step's calls.
    row = tx.one("SELECT metadata FROM agent_steps WHERE step_id = ?", (step_id,))
    meta = json.loads(row[0]) if row and row[0] else {}
    meta.setdefault("policy", []).extend(_policy(decisions))
    tx.execute("UPDATE agent_steps SET metadata = ? WHERE step_id = ?", (json.dumps(meta), step_id))


def _insert_decisions(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    step_id: str,
    decisions: Sequence[DecisionRecord],
    approvals: Sequence[PendingApproval],
) -> None:
    now = env.clock.now()
    if approvals:
        # Not sent before its waiting row exists (the suspend that follows).
        insert_rows(
            tx,
            "INSERT INTO approvals (request_id, agent_id, agent_turn_id, step_id, "
            "target, payload, rule, approver, thread, status, deadline, created_at)",
            [
                (
                    a.request_id,
                    a.agent_id,
                    a.agent_turn_id,
                    step_id,
                    a.target,
                    a.payload,
                    a.rule,
                    a.approver,
                    a.thread,
                    ApprovalStatus.PENDING,
                    a.deadline,
                    now,
                )
                for a in approvals
            ],
        )
    if not decisions:
        return
    insert_rows(
        tx,
        "INSERT INTO policy_decisions (agent_id, agent_turn_id, step_id, target, "
        "payload_tag, decision, rule, reason, rate_key, at)",
        [
            (
                token.agent_id,
                token.agent_turn_id,
                step_id,
                d.target,
                d.payload_tag,
                d.decision,
                d.rule,
                d.reason,
                d.rate_key,
                now,
            )
            for d in decisions
        ],
    )


def turn_decisions(tx: Tx, env: StoreEnv, agent_turn_id: str) -> list[DecisionRecord]:
    rows = tx.all(
        "SELECT target, payload_tag, decision, rule, reason, rate_key, step_id, at "
        "FROM policy_decisions WHERE agent_turn_id = ? ORDER BY seq",
        (agent_turn_id,),
    )
    return [DecisionRecord(*r) for r in rows]


def unsent_approvals(tx: Tx, env: StoreEnv) -> list[PendingApproval]:
    """Pending requests not sent yet whose call is suspended waiting for them."""
    rows = tx.all(
        f"SELECT {_APPROVAL_COLS}, w.tool_call_id FROM approvals a JOIN turn_waiting_tools w "
        "ON w.agent_turn_id = a.agent_turn_id WHERE a.status = ? AND a.sent_at IS NULL "
        "AND w.status = ? ORDER BY a.created_at",
        (ApprovalStatus.PENDING, WaitingStatus.WAITING),
    )
    # The waiting row of a request is keyed APPROVAL_PREFIX + request id (matched here
    # rather than by concatenating in SQL, which the engines type differently).
    return [PendingApproval(*r[:9]) for r in rows if r[9] == APPROVAL_PREFIX + r[0]]


def pending_approvals(tx: Tx, env: StoreEnv, approver: str | None = None) -> list[PendingApproval]:
    if approver is None:
        rows = tx.all(
            f"SELECT {_APPROVAL_COLS} FROM approvals a WHERE a.status = ? ORDER BY a.created_at",
            (ApprovalStatus.PENDING,),
        )
    else:
        rows = tx.all(
            f"SELECT {_APPROVAL_COLS} FROM approvals a WHERE a.status = ? AND a.approver = ? "
            "ORDER BY a.created_at",
            (ApprovalStatus.PENDING, approver),
        )
    return [PendingApproval(*r) for r in rows]


def approval_status(tx: Tx, env: StoreEnv, request_id: str) -> str | None:
    row = tx.one("SELECT status FROM approvals WHERE request_id = ?", (request_id,))
    return row[0] if row else None


def mark_approval_sent(
    tx: Tx, env: StoreEnv, request_id: str, events: Sequence[outbox.OutboxItem] = ()
) -> None:
    """The request was sent; ``events``: its ``approval.requested`` outbox rows, written
    with the mark (the request is sent again until marked, so the event is neither lost
    nor doubled by a crash between the two)."""
    tx.execute(
        "UPDATE approvals SET sent_at = ? WHERE request_id = ?", (env.clock.now(), request_id)
    )
    if events:
        outbox.enqueue(tx, env, events)


def unsend_approvals(tx: Tx, env: StoreEnv, approvers: Sequence[str]) -> None:
    """Pending requests to these approvers are to be sent again (listener approvers after
    a restart: the pump's threads did not survive it)."""
    if not approvers:
        return
    tx.execute(
        "UPDATE approvals SET sent_at = NULL WHERE status = ? "
        f"AND approver IN ({marks(len(approvers))})",
        (ApprovalStatus.PENDING, *approvers),
    )


def _settle(
    tx: Tx,
    env: StoreEnv,
    request_id: str,
    agent_id: str,
    status: ApprovalStatus,
    failed_text: str | None,
) -> None:
    """Mark the request ``status`` and queue what its call becomes: the ``approval`` row
    that forwards it, or (``failed_text``) a failed result of the call."""
    tx.execute(
        "UPDATE approvals SET status = ?, decided_at = ? WHERE request_id = ?",
        (status, env.clock.now(), request_id),
    )
    mtype = MessageType.APPROVAL if failed_text is None else MessageType.TOOL_RESULT
    insert_report(
        tx,
        env,
        new_id(),
        agent_id,
        mtype,
        APPROVAL_PREFIX + request_id,
        (failed_text or "").encode(),
        failed_text is not None,
    )


def decide_approval(
    tx: Tx, env: StoreEnv, request_id: str, grant: bool, reason: str, by: str | None
) -> str:
    """The first decision wins: ``applied``; else ``duplicate``, ``unknown`` or
    ``not-yours`` (``by`` is not the approver), and nothing changes."""
    row = tx.one(
        "SELECT status, approver, agent_id, target FROM approvals WHERE request_id = ?",
        (request_id,),
    )
    if row is None:
        return "unknown"
    status, approver, agent_id, target = row
    if by is not None and by != approver:
        return "not-yours"
    if status != ApprovalStatus.PENDING:
        return "duplicate"
    tx.execute(
        "UPDATE approvals SET reason = ?, decided_by = ? WHERE request_id = ?",
        (reason, by, request_id),
    )
    if grant:
        _settle(tx, env, request_id, agent_id, ApprovalStatus.GRANTED, None)
    else:
        why = f": {reason}" if reason else ""
        who = by or "the operator"
        text = f"the call to {target} was denied by {who}{why}; it was not sent"
        _settle(tx, env, request_id, agent_id, ApprovalStatus.DENIED, text)
    return "applied"


def expire_approvals(tx: Tx, env: StoreEnv, now: float) -> int:
    rows = tx.all(
        "SELECT request_id, agent_id, target, approver, deadline - created_at "
        "FROM approvals WHERE status = ? AND deadline <= ?",
        (ApprovalStatus.PENDING, now),
    )
    for request_id, agent_id, target, approver, waited in rows:
        text = (
            f"the call to {target} got no decision from {approver} within "
            f"{round(waited, 1):g} s; it was not sent"
        )
        _settle(tx, env, request_id, agent_id, ApprovalStatus.TIMED_OUT, text)
    return len(rows)


def begin_forward(tx: Tx, env: StoreEnv, row: InboxRow) -> tuple[str, TurnToken, str, str] | None:
    """Claim a granted request for forwarding (committed before the call is sent, so a
    crash can never send it twice). None: nothing to send (the row is settled)."""
    request_id = (row.correlation_id or "")[len(APPROVAL_PREFIX) :]
    found = tx.one(
        "SELECT a.status, a.target, a.payload, w.agent_turn_id, w.turn_epoch, w.status "
        "FROM approvals a LEFT JOIN turn_waiting_tools w ON w.tool_call_id = ? "
        "WHERE a.request_id = ?",
        (row.correlation_id, request_id),
    )
    live = (ApprovalStatus.GRANTED, ApprovalStatus.FORWARDING)
    if found is None or found[0] not in live or found[5] != WaitingStatus.WAITING:
        if found is not None and found[0] in live:
            # Its Turn ended first (stopped, interrupted, timed out): nothing waits for
            # the call, so it is never sent, and the request says so (a request left
            # ``granted`` would look open for ever and keep its Turn from retention).
            ended = (
                ApprovalStatus.WITHDRAWN
                if found[0] == ApprovalStatus.GRANTED
                else ApprovalStatus.LOST
            )
            tx.execute("UPDATE approvals SET status = ? WHERE request_id = ?", (ended, request_id))
        inbox_move(tx, env, row.inbox_id, InboxEvent.SKIP, defer_reason="approval settled")
        return None
    status, target, payload, turn_id, epoch, _ = found
    if status == ApprovalStatus.FORWARDING:
        # A crash between claiming and recording the forward: whether it left is
        # unknown, so it is reported lost rather than risked twice.
        tx.execute(
            "UPDATE approvals SET status = ? WHERE request_id = ?",
            (ApprovalStatus.LOST, request_id),
        )
        inbox_move(tx, env, row.inbox_id, InboxEvent.CONSUME)
        insert_report(
            tx,
            env,
            new_id(),
            row.agent_id,
            MessageType.TOOL_RESULT,
            row.correlation_id or "",
            f"the approved call to {target} was interrupted by a restart; "
            "it may or may not have been sent".encode(),
            True,
        )
        return None
    tx.execute(
        "UPDATE approvals SET status = ? WHERE request_id = ?",
        (ApprovalStatus.FORWARDING, request_id),
    )
    return request_id, TurnToken(row.agent_id, turn_id, epoch), target, payload


def finish_forward(
    tx: Tx,
    env: StoreEnv,
    request_id: str,
    row: InboxRow,
    sub_thread: str,
    after: str,
    deadline: float,
) -> None:
    """The granted call was sent as ``sub_thread``: its waiting row now waits for that
    sub-thread's result like any tool call."""
    now = env.clock.now()
    tx.execute(
        "UPDATE approvals SET status = ?, tool_call_id = ? WHERE request_id = ?",
        (ApprovalStatus.FORWARDED, sub_thread, request_id),
    )
    waiting = tx.one(
        "SELECT agent_turn_id, turn_epoch FROM turn_waiting_tools WHERE tool_call_id = ? "
        "AND status = ?",
        (row.correlation_id, WaitingStatus.WAITING),
    )
    inbox_move(tx, env, row.inbox_id, InboxEvent.CONSUME)
    if waiting is None:
        return
    tx.execute(
        "UPDATE turn_waiting_tools SET tool_call_id = ?, after_execution = ?, "
        "updated_at = ? WHERE tool_call_id = ? AND status = ?",
        (sub_thread, after, now, row.correlation_id, WaitingStatus.WAITING),
    )
    with contextlib.suppress(StaleTurn):  # a Turn that moved on needs no deadline
        head.cas(
            tx,
            env,
            row.agent_id,
            waiting[0],
            waiting[1],
            HeadStatus.SUSPENDED,
            exprs={
                "resume_deadline": "CASE WHEN resume_deadline IS NULL OR resume_deadline < ? "
                "THEN ? ELSE resume_deadline END"
            },
            expr_params=(deadline, deadline),
        )
    # The call's card now names its sub-thread, so what governance noted for the call
    # (warnings) reaches its result.
    rename_call_card(tx, waiting[0], row.correlation_id or "", sub_thread)
    # A result that beat this transaction waits deferred: due now.
    tx.execute(
        "UPDATE agent_inbox SET next_retry_at = ?, agent_turn_id = ?, turn_epoch = ? "
        "WHERE correlation_id = ? AND status = ?",
        (now, waiting[0], waiting[1], sub_thread, InboxStatus.DEFERRED),
    )


def fail_forward(tx: Tx, env: StoreEnv, request_id: str, row: InboxRow, text: str) -> None:
    tx.execute(
        "UPDATE approvals SET status = ? WHERE request_id = ?",
        (ApprovalStatus.REFUSED, request_id),
    )
    inbox_move(tx, env, row.inbox_id, InboxEvent.CONSUME)
    insert_report(
        tx,
        env,
        new_id(),
        row.agent_id,
        MessageType.TOOL_RESULT,
        row.correlation_id or "",
        text.encode(),
        True,
    )
