"""The AgentTurn state machines, as data (sans-IO, no clocks, no database).

Two machines:

* the agent **head** (``agent_state_head.status``): one row per agent, at most one active Turn;
* an **inbox row** (``agent_inbox.status``): Enqueues (``turn``) and reports
  (``tool_result``, ``timeout``, ``stop``, ``resume``).

Each table maps ``(state, event)`` to a :class:`Transition`. The store computes every
compare-and-set from these tables (the expected statuses of an event are
:func:`head_sources`), and ``docs/agents.md`` embeds :func:`render_markdown`, checked by a
test, so code, store and documentation cannot drift apart. What a head event writes
besides its status and epoch is data too (:data:`HEAD_EFFECTS`, :func:`head_effects`),
applied by the one compare-and-set both the shared SQL (``agents/store/sql/head.py``)
and PostgreSQL's one-trip statements (``agents/store/pg/one_trip*.py``) build.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from agentserver.core.errors import IllegalTransition

# The step machine is shared with remote runners (agentserver.steps); the store writes
# its statuses too, so its names are part of this table of every machine.
from agentserver.steps.states import (
    FINAL_STEP as FINAL_STEP,
)
from agentserver.steps.states import (
    STEP_TRANSITIONS as STEP_TRANSITIONS,
)
from agentserver.steps.states import StepEvent as StepEvent
from agentserver.steps.states import StepStatus as StepStatus
from agentserver.steps.states import Transition as Transition
from agentserver.steps.states import step_transition as step_transition


class HeadStatus(enum.StrEnum):
    IDLE = "idle"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    SUSPENDED = "suspended"


class HeadEvent(enum.StrEnum):
    LEASE = "lease"  # L0 takes the oldest queued Turn for an idle agent
    START = "start"  # the worker enters the Turn
    SUSPEND = "suspend"  # tool calls sent, waiting set recorded
    RESUME = "resume"  # waiting set complete (results and/or timeouts)
    FINISH = "finish"  # deliverable written by the worker (answer, failure, step limit)
    FORCE_END = "force_end"  # stop command or watchdog
    RECOVER = "recover"  # restart: a running Turn's worker is gone; invalidate and re-run


_H = HeadStatus
#: Head statuses with a Turn in progress (the ones a force-end applies to).
ACTIVE_HEAD = (_H.DISPATCHED, _H.RUNNING, _H.SUSPENDED)

HEAD_TRANSITIONS: Mapping[tuple[HeadStatus, HeadEvent], Transition] = {
    (_H.IDLE, HeadEvent.LEASE): Transition(_H.DISPATCHED, True, "new agent_turn_id, epoch + 1"),
    (_H.DISPATCHED, HeadEvent.START): Transition(_H.RUNNING, False, "worker entered the Turn"),
    (_H.RUNNING, HeadEvent.SUSPEND): Transition(_H.SUSPENDED, False, "tool calls in flight"),
    (_H.SUSPENDED, HeadEvent.RESUME): Transition(_H.RUNNING, True, "waiting set complete"),
    (_H.RUNNING, HeadEvent.FINISH): Transition(_H.IDLE, False, "deliverable written"),
    (_H.RUNNING, HeadEvent.RECOVER): Transition(_H.RUNNING, True, "restart: re-run the step"),
    **{
        (s, HeadEvent.FORCE_END): Transition(_H.IDLE, True, "stop or watchdog: failed deliverable")
        for s in ACTIVE_HEAD
    },
}


@dataclass(frozen=True, slots=True)
class Given:
    """A head column's value that the call applying the event supplies (by ``name``)."""

    name: str


#: The moment of the compare-and-set (its clock reading, unless the call gives one).
NOW = Given("now")

#: What a Turn's end leaves on the head (the next lease, if any, sets the rest).
_ENDED: Mapping[str, Any] = {
    "active_agent_turn_id": None,
    "turn_inbox_id": None,
    "waiting_tool_count": 0,
    "resume_deadline": None,
    "dispatched_at": None,
    "running_since": None,
}

#: The columns each head event sets besides ``status``, ``turn_epoch`` (the transition's)
#: and ``updated_at``: a constant, or a :class:`Given` value. Counters a call moves by an
#: expression (``step_count + 1``, ``context_tokens + ?``) are the call's, not the event's.
HEAD_EFFECTS: Mapping[HeadEvent, Mapping[str, Any]] = {
    HeadEvent.LEASE: {
        "active_agent_turn_id": Given("turn"),
        "turn_inbox_id": Given("inbox"),
        "context_box_id": Given("context_box"),
        "output_box_id": Given("output_box"),
        "step_count": 0,
        "waiting_tool_count": 0,
        "resume_deadline": None,
        "expecting_correlation_id": None,
        "dispatched_at": NOW,
        "running_since": None,
        "context_tokens": Given("tokens"),
        "turn_version": None,
        "turn_pin": None,
    },
    HeadEvent.START: {
        "running_since": NOW,
        "turn_version": Given("version"),
        "turn_pin": Given("pin"),
    },
    HeadEvent.SUSPEND: {
        "waiting_tool_count": Given("calls"),
        "resume_deadline": Given("deadline"),
        "expecting_correlation_id": None,
    },
    HeadEvent.RESUME: {"waiting_tool_count": 0, "resume_deadline": None, "running_since": NOW},
    HeadEvent.FINISH: _ENDED,
    HeadEvent.FORCE_END: _ENDED,
    HeadEvent.RECOVER: {"running_since": NOW},
}


def head_effects(event: HeadEvent, given: Mapping[str, Any]) -> dict[str, Any]:
    """The columns ``event`` sets (:data:`HEAD_EFFECTS`), each :class:`Given` replaced by
    its value in ``given``; KeyError names one the call did not give."""
    return {
        column: given[value.name] if isinstance(value, Given) else value
        for column, value in HEAD_EFFECTS[event].items()
    }


class InboxStatus(enum.StrEnum):
    QUEUED = "queued"
    PENDING = "pending"
    PROCESSING = "processing"
    DEFERRED = "deferred"
    CONSUMED = "consumed"
    ERROR = "error"
    SKIPPED = "skipped"


class InboxEvent(enum.StrEnum):
    DISPATCH = "dispatch"  # the Turn of a queued row was leased
    CLAIM = "claim"  # a worker took a due row
    CONSUME = "consume"  # applied
    DEFER = "defer"  # retry later (e.g. result before the suspend committed)
    REQUEUE = "requeue"  # watchdog: stuck in processing
    SKIP = "skip"  # duplicate, late or stale report: acknowledged, no effect
    FAIL = "fail"  # malformed row, or retries exhausted
    ABANDON = "abandon"  # its Turn was force-ended before the row was used
    CANCEL = "cancel"  # an operator cancelled the queued task (agentserver cancel)


class MessageType(enum.StrEnum):
    TURN = "turn"
    TOOL_RESULT = "tool_result"
    TIMEOUT = "timeout"
    RESUME = "resume"
    APPROVAL = "approval"  # a granted tool call to forward (agents/governance/approvals.py)


_I = InboxStatus

INBOX_TRANSITIONS: Mapping[tuple[InboxStatus, InboxEvent], Transition] = {
    (_I.QUEUED, InboxEvent.DISPATCH): Transition(_I.PENDING, False, "Turn leased"),
    (_I.PENDING, InboxEvent.CLAIM): Transition(_I.PROCESSING, False, "due, claimed"),
    (_I.DEFERRED, InboxEvent.CLAIM): Transition(_I.PROCESSING, False, "next_retry_at passed"),
    (_I.PROCESSING, InboxEvent.CONSUME): Transition(_I.CONSUMED, False, "applied"),
    (_I.PROCESSING, InboxEvent.DEFER): Transition(_I.DEFERRED, False, "retry_count + 1"),
    (_I.PROCESSING, InboxEvent.REQUEUE): Transition(_I.PENDING, False, "worker vanished"),
    (_I.PROCESSING, InboxEvent.SKIP): Transition(_I.SKIPPED, False, "duplicate/late/stale"),
    (_I.PROCESSING, InboxEvent.FAIL): Transition(_I.ERROR, False, "malformed or exhausted"),
    (_I.QUEUED, InboxEvent.FAIL): Transition(_I.ERROR, False, "malformed at lease"),
    (_I.PENDING, InboxEvent.ABANDON): Transition(_I.SKIPPED, False, "Turn force-ended"),
    (_I.DEFERRED, InboxEvent.ABANDON): Transition(_I.SKIPPED, False, "Turn force-ended"),
    (_I.QUEUED, InboxEvent.CANCEL): Transition(_I.SKIPPED, False, "cancelled; failed answer"),
}

DUE_INBOX = frozenset({_I.PENDING, _I.DEFERRED})


class WaitingStatus(enum.StrEnum):
    """A tool call of a suspended Turn (``turn_waiting_tools.status``)."""

    WAITING = "waiting"  # sent, no result yet
    RECEIVED = "received"  # its result was applied
    TIMEOUT = "timeout"  # its timeout report was applied
    CANCELLED = "cancelled"  # the Turn ended first


class AfterExecution(enum.StrEnum):
    """What a tool call's result does to its Turn (``turn_waiting_tools.after_execution``)."""

    SUSPEND = "suspend"  # the Turn resumes when the waiting set is complete
    TERMINATE = "terminate"  # the Turn ends with this tool's result
    APPROVAL = (
        "approval"  # waiting for a human decision (agents/governance/approvals.py): no timeout
    )


class AgentStepStatus(enum.StrEnum):
    """One model step of a Turn (``agent_steps.status``)."""

    STARTED = "started"
    COMPLETED = "completed"
    RETRYING = "retrying"  # the model call failed; a durable retry wait follows


class ReplyStatus(enum.StrEnum):
    """A Turn's answer in the reply outbox (``agent_replies.status``)."""

    PENDING = "pending"
    SENT = "sent"
    UNDELIVERABLE = "undeliverable"  # the delivery gave up


class ApprovalStatus(enum.StrEnum):
    """A request for a human decision on one tool call (``approvals.status``)."""

    PENDING = "pending"
    GRANTED = "granted"
    DENIED = "denied"
    TIMED_OUT = "timed_out"
    FORWARDING = "forwarding"  # claimed for sending (committed before the send)
    FORWARDED = "forwarded"
    LOST = "lost"  # a crash between claim and send: reported, never resent
    REFUSED = "refused"  # the pump refused the granted call
    WITHDRAWN = "withdrawn"  # granted after its Turn had ended: never sent


def head_transition(state: HeadStatus | str, event: HeadEvent | str) -> Transition:
    """Return the transition for ``(state, event)`` or raise :class:`IllegalTransition`."""
    try:
        return HEAD_TRANSITIONS[(HeadStatus(state), HeadEvent(event))]
    except (KeyError, ValueError):
        raise IllegalTransition("head", str(state), str(event)) from None


def inbox_transition(state: InboxStatus | str, event: InboxEvent | str) -> Transition:
    """Return the transition for ``(state, event)`` or raise :class:`IllegalTransition`."""
    try:
        return INBOX_TRANSITIONS[(InboxStatus(state), InboxEvent(event))]
    except (KeyError, ValueError):
        raise IllegalTransition("inbox", str(state), str(event)) from None


#: Every status column the store writes besides the head and the inbox rows, and its
#: declared values (the store's SQL uses these constants, never a literal).
STORE_STATUSES: Mapping[str, type[enum.StrEnum]] = {
    "turn_waiting_tools.status": WaitingStatus,
    "turn_waiting_tools.after_execution": AfterExecution,
    "agent_steps.status": AgentStepStatus,
    "agent_replies.status": ReplyStatus,
    "approvals.status": ApprovalStatus,
}


@functools.cache
def head_event(event: HeadEvent) -> Transition:
    """The one transition of ``event`` whatever its source (every head event has one
    target and one epoch rule), so a compare-and-set needs no read before its UPDATE."""
    (t,) = {t for (_, e), t in HEAD_TRANSITIONS.items() if e == event}
    return t


@functools.cache
def head_sources(event: HeadEvent) -> tuple[str, ...]:
    """Statuses from which ``event`` is legal: the expected status set of a head CAS."""
    return tuple(sorted(str(s) for (s, e) in HEAD_TRANSITIONS if e == event))


@functools.cache
def inbox_sources(event: InboxEvent) -> tuple[str, ...]:
    """Statuses from which ``event`` is legal for an inbox row."""
    return tuple(sorted(str(s) for (s, e) in INBOX_TRANSITIONS if e == event))


#: A table's state and event types (each a str enum of its own).
S = TypeVar("S", bound=str)
E = TypeVar("E", bound=str)


def _table(rows: Mapping[tuple[S, E], Transition], epoch_col: bool) -> list[str]:
    head = "| from | event | to |" + (" turn_epoch |" if epoch_col else "") + " meaning |"
    sep = "|---|---|---|" + ("---|" if epoch_col else "") + "---|"
    out = [head, sep]
    for (state, event), t in rows.items():
        epoch = (" +1 |" if t.bumps_epoch else " |") if epoch_col else ""
        out.append(f"| {state} | {event} | {t.target} |{epoch} {t.why} |")
    return out


def render_markdown() -> str:
    """Both transition tables as Markdown (embedded verbatim in ``docs/agents.md``)."""
    lines = ["Head (`agent_state_head.status`):", ""]
    lines += _table(HEAD_TRANSITIONS, epoch_col=True)
    lines += ["", "Inbox row (`agent_inbox.status`):", ""]
    lines += _table(INBOX_TRANSITIONS, epoch_col=False)
    lines += ["", "Step attempt (remote listeners, `agentserver.remote.hub`):", ""]
    lines += _table(STEP_TRANSITIONS, epoch_col=False)
    lines += ["", "The other statuses the store writes:", ""]
    lines += ["| column | values |", "|---|---|"]
    for column, values in STORE_STATUSES.items():
        lines.append(f"| `{column}` | {', '.join(f'`{v}`' for v in values)} |")
    return "\n".join(lines) + "\n"
