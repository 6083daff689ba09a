"""A claim and the first step of what it claims, in one transaction (issue 48: a step's
writes in one transaction).

The worker used to claim a row (one autocommit statement) and then take its first step
in a transaction of its own: start a task's Turn and begin its first step, or apply a
tool report and begin the next step. :func:`claim_next` does both in the claim's
transaction. Whatever raises inside it (a Turn that moved on, any failure) rolls the
claim back with it; the caller then claims the plain way and takes the step itself, as
before, so the fallback's outcome is the old path's.
"""

from __future__ import annotations

from collections.abc import Callable

from agentserver.agents.store.rows import Claimed, InboxRow
from agentserver.agents.store.sql import inbox, tools, turns
from agentserver.agents.store.sql.budgets import HoldFor, hold_step
from agentserver.agents.store.sql.db import StoreEnv, Tx
from agentserver.agents.store.states import MessageType

#: Why a claimed task row cannot start its Turn (None: it can). Pure, no I/O: it runs in
#: the claim's transaction.
TaskCheck = Callable[[InboxRow], str | None]


def claim_next(
    tx: Tx,
    env: StoreEnv,
    agent_id: str,
    max_steps: int,
    guardrails: bool,
    check: TaskCheck,
    hold_for: HoldFor | None = None,
) -> Claimed | None:
    """Claim ``agent_id``'s next due row (as :func:`~.inbox.claim_due` with a limit of
    one) and take its first step in the same transaction: a task's Turn started and its
    first step begun (only started with ``guardrails``, which judge the cards before a
    step begins; neither when ``check`` finds a problem); a tool report or timeout
    applied, and the next step begun when it resumes the Turn (not with
    ``guardrails``). The step begun takes its first model call's reservation too when
    ``hold_for`` asks for one (:func:`~.budgets.hold_step`). None when no row is due.
    Raises what the step raises (StaleTurn included), rolling the claim back too."""
    rows = inbox.claim_due(tx, env, agent_id, 1)
    if not rows:
        return None
    row = rows[0]
    if row.message_type == MessageType.TURN:
        problem = check(row)
        if problem is not None:
            return Claimed(row, problem=problem)
        if guardrails:
            turns.start_turn(tx, env, row)
            return Claimed(row, started=True)
        step = turns.start_turn_step(tx, env, row, max_steps)
        return Claimed(row, step=hold_step(tx, env, row.reply_ref_json, step, hold_for))
    if row.message_type in (MessageType.TOOL_RESULT, MessageType.TIMEOUT):
        then_step = None if guardrails else max_steps
        return Claimed(row, report=tools.apply_report(tx, env, row, then_step, hold_for))
    return Claimed(row)
