"""How the web console words what the store holds, sans I/O: a task's state as a person
reads it (one of :data:`STATES`, mapped here and nowhere else from the inbox row's status,
the deliverable's status and a pending approval), a task's text from its payload, and
costs, durations, tokens and error counts as short phrases.

Costs are shown in US dollars ("$0.0024"): the router prices calls in the unit of the
backends' ``<price>``, which providers quote in dollars (docs/operations.md, "Web
console")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from agentserver.agents.store.rows import TaskStatus
from agentserver.agents.store.states import InboxStatus
from agentserver.core.errors import InputRefused
from agentserver.core.xmlsafe import SafeParser

QUEUED = "queued"
RUNNING = "running"
ASKING = "waiting for approval"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
#: What a figure reads when there is none (an en dash, as the templates write it).
NONE = "\u2013"
#: Every state the console shows a task in.
STATES = (QUEUED, RUNNING, ASKING, SUCCEEDED, FAILED, CANCELLED)
#: The states of a task that will not change again.
FINISHED = frozenset({SUCCEEDED, FAILED, CANCELLED})

#: A Turn's end (its deliverable's ``status``) → the state shown. A Turn stopped (by an
#: operator, or ended by a newer task of its conversation under ``interrupt`` or
#: ``rollback``) was cancelled by someone; one that ran out of time failed.
OUTCOME_STATES: Mapping[str, str] = {
    TaskStatus.SUCCEEDED: SUCCEEDED,
    TaskStatus.FAILED: FAILED,
    TaskStatus.TIMED_OUT: FAILED,
    TaskStatus.STOPPED: CANCELLED,
}

#: A task's inbox row status, before its Turn has an end → the state shown. Its row is
#: ``queued``, then ``pending`` when its Turn is leased, ``processing`` when a worker
#: takes it and ``consumed`` once the Turn started (it stays ``consumed`` whatever the
#: Turn's end: the end is the deliverable's). ``skipped``: cancelled while queued (by an
#: operator, or by double-texting); ``error``: refused at its lease (malformed).
INBOX_STATES: Mapping[InboxStatus, str] = {
    InboxStatus.QUEUED: QUEUED,
    InboxStatus.PENDING: QUEUED,
    InboxStatus.DEFERRED: QUEUED,
    InboxStatus.PROCESSING: RUNNING,
    InboxStatus.CONSUMED: RUNNING,
    InboxStatus.ERROR: FAILED,
    InboxStatus.SKIPPED: CANCELLED,
}


def task_state(inbox_status: str, outcome: str | None, asking: bool) -> str:
    """The state shown for a task whose inbox row is ``inbox_status``, whose Turn ended
    with ``outcome`` (the deliverable's status; None: no end yet) and whose Turn has a
    pending approval (``asking``). An end overrides the row; an end of a status this
    version does not know reads as failed (it is not a success anyone declared)."""
    if outcome is not None:
        return OUTCOME_STATES.get(outcome, FAILED)
    try:
        state = INBOX_STATES[InboxStatus(inbox_status)]
    except ValueError:
        state = RUNNING  # a status newer than this version: the task is not over
    if state == RUNNING and asking:
        return ASKING
    return state


def state_detail(inbox_status: str, outcome: str | None, reason: str | None) -> str:
    """What the store said, when the state shown says less: ``timed out``, ``stopped``,
    a cancelled task's reason (``conversation busy``), a malformed task's error."""
    if outcome is not None:
        return "" if outcome in (SUCCEEDED, FAILED) else outcome.replace("_", " ")
    if inbox_status in (InboxStatus.SKIPPED, InboxStatus.ERROR) and reason:
        return reason
    return ""


def payload_text(payload: str, parser: SafeParser) -> str:
    """A task's payload as a person reads it: the text of its elements, whitespace folded
    (``<task><text>Say hello.</text></task>`` reads "Say hello."); a payload that is not
    XML (a test's bytes, a cut one) reads as it is, folded too."""
    try:
        root = parser.parse(payload.encode("utf-8"))
    except InputRefused:
        return " ".join(payload.split())
    return " ".join("".join(root.itertext()).split())


def shorten(text: str, chars: int = 100) -> str:
    """``text`` of at most ``chars`` characters, cut at a word with "…" when longer."""
    if len(text) <= chars:
        return text
    cut = text[: chars - 1]
    space = cut.rfind(" ")
    if space > chars // 2:
        cut = cut[:space]
    return cut.rstrip() + "…"


def cost(value: float | None) -> str:
    """``$0.0024``: two significant digits under a dollar, cents above; :data:`NONE` if none."""
    if value is None:
        return NONE
    if value == 0:
        return "$0"
    if abs(value) >= 1:
        return f"${value:,.2f}"
    # Two significant digits, at least two decimals, no trailing zero past the cents.
    decimals = max(2, 1 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    if decimals > 2:
        text = text.rstrip("0")
        if len(text.split(".")[1]) < 2:
            text = f"{value:.2f}"
    return f"${text}"


def duration(seconds: float | None) -> str:
    """``40 ms``, ``1.2 s``, ``42 s``, ``3 min 5 s``, ``12 min``, ``2 h 5 min``,
    ``3 d 4 h``; :data:`NONE` if unknown."""
    if seconds is None or seconds < 0 or math.isnan(seconds):
        return NONE
    if seconds < 0.9995:
        return f"{round(seconds * 1000)} ms"
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 10:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def count(n: int | None, noun: str) -> str:
    """``1 token``, ``1,200 tokens``, :data:`NONE` if unknown (``noun`` singular, plural with s)."""
    if n is None:
        return NONE
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def errors(by_kind: Mapping[str, int] | None) -> str:
    """``no errors``, or ``2 timeout, 1 rate limit`` (most first)."""
    items = sorted((by_kind or {}).items(), key=lambda kv: (-kv[1], kv[0]))
    if not items:
        return "no errors"
    return ", ".join(f"{n:,} {kind.replace('_', ' ')}" for kind, n in items)


def backend_calls(counters: Mapping[str, Any] | None) -> str:
    """A backend's counters (:class:`agentserver.llm.accounting.Counters`) in a line:
    ``12 requests, 11 succeeded, 1 failed · 5,400 tokens in, 800 out · $0.0024 ·
    1 timeout``."""
    c = counters or {}
    if not c:
        return NONE
    parts = [
        f"{count(c.get('requests', 0), 'request')}, {c.get('successes', 0):,} succeeded, "
        f"{c.get('failures', 0):,} failed",
        f"{count(c.get('prompt_tokens', 0), 'token')} in, {c.get('completion_tokens', 0):,} out",
        cost(c.get("cost", 0.0)),
        errors(c.get("errors")),
    ]
    return " · ".join(parts)
