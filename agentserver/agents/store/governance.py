"""The store's part of governance, as the governor sees it: the policy decisions of each
step (the rate windows are counted from them), the refusal cards written with them and
the approvals' rows; written and read by :mod:`agentserver.agents.store.sql.governance`
(tables of schema migration 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentserver.agents.store.rows import NewCard

#: The approvals' rows (agents/governance/approvals.py applies them).
APPROVAL_PREFIX = "approval:"
#: turn_waiting_tools.after_execution of a call waiting for its approval.
WAITING_KIND = "approval"


@dataclass(frozen=True, slots=True)
class PendingApproval:
    request_id: str
    agent_id: str
    agent_turn_id: str
    target: str
    payload: str
    rule: str
    approver: str
    deadline: float
    thread: str


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One tool call's governance decision, as the step log keeps it.

    ``decision``: allow, deny, require-approval, or blocked/halted by a guardrail (the
    loop detector is ``loop-block``). ``rate_key`` is set on an allowed call that counts
    against a rate window.
    """

    target: str
    payload_tag: str
    decision: str
    rule: str
    reason: str
    rate_key: str | None = None
    step_id: str = ""
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What governance decided for one step's calls, written with the step itself
    (``complete_step(..., screened=...)``): the decisions, the refusal cards (after the
    step's own) and the approval requests."""

    decisions: tuple[DecisionRecord, ...] = ()
    cards: tuple[NewCard, ...] = ()
    approvals: tuple[PendingApproval, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.decisions or self.cards)
