"""Error taxonomy of the router: kinds, the classifier, the decision table.

Pure: no I/O, no clock. The classifier and the decision table are data (``RULES``
and ``DECISIONS``) so that the documentation can be generated from them and a
test can hold the two together.

Precedence. Seed 004 lists the kinds in this order: RATE_LIMIT, OVERLOADED,
SERVER_ERROR, TIMEOUT, CONTEXT_OVERFLOW, UNKNOWN, AUTH, AUTH_PERMANENT, BILLING,
MODEL_NOT_FOUND, CONTENT_BLOCKED, FORMAT_ERROR, and a status code alone is
resolved in that order. A status code is weak evidence, though: a 429 that says
the quota is exhausted is a billing problem, a 400 that says the prompt is too
long is a context overflow, some providers send low credit as a 400. So the
rules are checked top to bottom as follows: transport failures first (there is
no status to read), then what the provider *says* (message, error type and
code), the kinds that must not be retried before the retryable ones, and only
then the bare status code in seed order.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import Final

__all__ = [
    "DECISIONS",
    "RULES",
    "Action",
    "Classification",
    "Decision",
    "ErrorKind",
    "Rule",
    "backoff_delay",
    "classify",
    "decision_table_markdown",
    "parse_retry_after",
    "rules_table_markdown",
]


class ErrorKind(StrEnum):
    """Why a call failed. Declared in seed 004's order."""

    RATE_LIMIT = "RATE_LIMIT"
    OVERLOADED = "OVERLOADED"
    SERVER_ERROR = "SERVER_ERROR"
    TIMEOUT = "TIMEOUT"
    #: No connection could be made (refused, DNS failure, network unreachable): the
    #: backend is down or misconfigured, not slow. Not in seed 004: see DECISIONS.
    UNREACHABLE = "UNREACHABLE"
    CONTEXT_OVERFLOW = "CONTEXT_OVERFLOW"
    UNKNOWN = "UNKNOWN"
    AUTH = "AUTH"
    AUTH_PERMANENT = "AUTH_PERMANENT"
    BILLING = "BILLING"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    CONTENT_BLOCKED = "CONTENT_BLOCKED"
    FORMAT_ERROR = "FORMAT_ERROR"


class Action(StrEnum):
    RETRY = "retry same backend"
    FAILOVER = "fail over"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    #: Whether this failure counts toward the backend's circuit breaker. Only
    #: failures that say "this backend is unhealthy right now" do; a billing or
    #: format error is a healthy server giving a definite answer.
    breaker: bool
    note: str


DECISIONS: Final[dict[ErrorKind, Decision]] = {
    ErrorKind.RATE_LIMIT: Decision(
        Action.RETRY,
        True,
        "wait as long as the provider asks (Retry-After / retry-after-ms), else back off; "
        "fail over instead when that wait exceeds the cap or the deadline",
    ),
    ErrorKind.OVERLOADED: Decision(
        Action.RETRY,
        True,
        "back off (or honour Retry-After), then retry; fail over when the breaker opens",
    ),
    ErrorKind.SERVER_ERROR: Decision(
        Action.RETRY, True, "back off, then retry; fail over when the breaker opens"
    ),
    ErrorKind.TIMEOUT: Decision(
        Action.FAILOVER,
        True,
        "a connection lost or cut mid-answer too; a slow backend is not retried within a request",
    ),
    ErrorKind.UNREACHABLE: Decision(
        Action.FAILOVER,
        True,
        "no connection (refused, DNS failure, network unreachable): fail over at once; "
        "an agent's step is not retried, so a Turn whose only backend is down fails at once",
    ),
    ErrorKind.CONTEXT_OVERFLOW: Decision(
        Action.FAILOVER,
        False,
        "only to a backend with a strictly larger known context window; else stop",
    ),
    ErrorKind.UNKNOWN: Decision(Action.RETRY, True, "back off, then retry"),
    ErrorKind.AUTH: Decision(Action.FAILOVER, False, "another backend has other credentials"),
    ErrorKind.AUTH_PERMANENT: Decision(Action.STOP, False, "the account itself is refused"),
    ErrorKind.BILLING: Decision(
        Action.FAILOVER, False, "never retried: quota or credit will not come back in seconds"
    ),
    ErrorKind.MODEL_NOT_FOUND: Decision(
        Action.FAILOVER, False, "another backend may serve the model"
    ),
    ErrorKind.CONTENT_BLOCKED: Decision(
        Action.STOP, False, "the same content would be blocked again"
    ),
    ErrorKind.FORMAT_ERROR: Decision(Action.STOP, False, "the same request would be refused again"),
}


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the classifier.

    A rule matches a transport failure only if ``transport`` is set. Otherwise
    it matches when the status is in ``statuses`` (``None`` in ``statuses``
    stands for "no status", e.g. an error event in the middle of a stream; an
    empty ``statuses`` means any status) and, if ``patterns`` is not empty, one
    of them occurs in the lower-cased provider message, type or code.
    """

    name: str
    kind: ErrorKind
    statuses: frozenset[int | None] = frozenset()
    patterns: tuple[str, ...] = ()
    transport: bool = False
    #: A transport rule for failures to connect at all (nothing was sent).
    connect: bool = False


def _span(lo: int, hi: int, *extra: int | None) -> frozenset[int | None]:
    return frozenset([*range(lo, hi + 1), *extra])


_4XX_OR_NONE = _span(400, 499, None)

RULES: Final[tuple[Rule, ...]] = (
    Rule("connect", ErrorKind.UNREACHABLE, transport=True, connect=True),
    Rule("transport", ErrorKind.TIMEOUT, transport=True),
    # No bare "billing": OpenAI's ordinary RPM 429 links to the billing page.
    Rule(
        "billing-message",
        ErrorKind.BILLING,
        _4XX_OR_NONE,
        (
            "insufficient_quota",
            "exceeded your current quota",
            "quota exhausted",
            "quota has been exhausted",
            "credit balance",
            "insufficient credit",
            "insufficient funds",
            "out of credits",
            "purchase credits",
            "payment required",
        ),
    ),
    Rule(
        "context-message",
        ErrorKind.CONTEXT_OVERFLOW,
        _4XX_OR_NONE,
        (
            "context_length_exceeded",
            "context length",
            "context window",
            "maximum context",
            "prompt is too long",
            "input is too long",
            "too many tokens",
            "request_too_large",
            "reduce the length",
        ),
    ),
    Rule(
        "content-message",
        ErrorKind.CONTENT_BLOCKED,
        _4XX_OR_NONE,
        ("content_filter", "content_policy", "content policy", "safety system", "flagged"),
    ),
    Rule(
        "account-message",
        ErrorKind.AUTH_PERMANENT,
        frozenset({401, 403, None}),
        ("deactivated", "suspended", "disabled", "banned", "terminated", "revoked"),
    ),
    Rule(
        "model-message",
        ErrorKind.MODEL_NOT_FOUND,
        frozenset({400, 404, None}),
        ("model_not_found", "model not found", "unknown model", "no such model", "invalid model"),
    ),
    Rule(
        "rate-limit-message",
        ErrorKind.RATE_LIMIT,
        frozenset(),
        ("rate limit", "rate_limit", "too many requests"),
    ),
    Rule("overloaded-message", ErrorKind.OVERLOADED, frozenset(), ("overloaded",)),
    Rule("status-429", ErrorKind.RATE_LIMIT, frozenset({429})),
    Rule("status-503-529", ErrorKind.OVERLOADED, frozenset({503, 529})),
    Rule("status-5xx", ErrorKind.SERVER_ERROR, _span(500, 599) - {503, 504, 529}),
    Rule("status-408-504", ErrorKind.TIMEOUT, frozenset({408, 504})),
    Rule("status-413", ErrorKind.CONTEXT_OVERFLOW, frozenset({413})),
    Rule("status-401-403", ErrorKind.AUTH, frozenset({401, 403})),
    Rule("status-402", ErrorKind.BILLING, frozenset({402})),
    Rule("status-404", ErrorKind.MODEL_NOT_FOUND, frozenset({404})),
    Rule("status-400-422", ErrorKind.FORMAT_ERROR, frozenset({400, 422})),
)

_FALLBACK: Final = Rule("otherwise", ErrorKind.UNKNOWN)


@dataclass(frozen=True, slots=True)
class Classification:
    kind: ErrorKind
    rule: str


def classify(
    status: int | None,
    message: str = "",
    *,
    code: str = "",
    transport: bool = False,
    connect: bool = False,
) -> Classification:
    """Classify one failure. Total: never raises, always returns a kind.

    ``status`` is the HTTP status (``None`` for transport failures and for
    error events inside a stream), ``message`` the provider's error text,
    ``code`` its error type/code fields joined, ``transport`` whether the
    failure was a connection, timeout or protocol error rather than an answer, and
    ``connect`` (with ``transport``) that no connection could be made at all.
    """
    if transport:
        rule = RULES[0] if connect else RULES[1]
        return Classification(rule.kind, rule.name)
    text = f"{message} {code}".lower()
    for rule in RULES:
        if rule.transport:
            continue
        if rule.statuses and status not in rule.statuses:
            continue
        if rule.patterns and not any(p in text for p in rule.patterns):
            continue
        return Classification(rule.kind, rule.name)
    return Classification(_FALLBACK.kind, _FALLBACK.name)


def parse_retry_after(
    retry_after: str | None,
    retry_after_ms: str | None = None,
    *,
    now_wall: float | None = None,
) -> float | None:
    """Seconds to wait according to the response headers, or ``None``.

    ``retry-after-ms`` (OpenAI, Anthropic) wins over ``retry-after`` because it
    is more precise. ``retry-after`` may be delta-seconds or an HTTP date; a
    date needs ``now_wall`` (POSIX seconds) and is ignored without it. Garbage
    and negative values yield ``None`` / ``0.0``; never raises.
    """
    if retry_after_ms:
        try:
            ms = float(retry_after_ms.strip())
        except ValueError:
            ms = math.nan
        if math.isfinite(ms):
            return max(0.0, ms / 1000.0)
    if not retry_after:
        return None
    value = retry_after.strip()
    try:
        seconds = float(value)
    except ValueError:
        if now_wall is None:
            return None
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:
            return None
        return max(0.0, when.timestamp() - now_wall)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def backoff_delay(retry_index: int, base: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with "equal jitter": half the step fixed, half random.

    ``retry_index`` counts retries of this request from 0. The result lies in
    ``[d/2, d]`` with ``d = min(cap, base * 2**retry_index)``, so it grows
    geometrically yet concurrent callers do not retry in lockstep.
    """
    step = min(cap, base * (2.0 ** min(retry_index, 62)))
    return step / 2.0 + rng.random() * step / 2.0


def decision_table_markdown() -> str:
    """The decision table as Markdown, as embedded in docs/llm-router.md."""
    lines = [
        "| Kind | Action | Counts toward breaker | Notes |",
        "|---|---|---|---|",
    ]
    for kind, d in DECISIONS.items():
        lines.append(
            f"| {kind.value} | {d.action.value} | {'yes' if d.breaker else 'no'} | {d.note} |"
        )
    return "\n".join(lines) + "\n"


def _statuses_text(rule: Rule) -> str:
    if rule.connect:
        return "(no connection)"
    if rule.transport:
        return "(no response)"
    if not rule.statuses:
        return "any"
    nums = sorted(s for s in rule.statuses if s is not None)
    parts: list[str] = []
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        parts.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    if None in rule.statuses:
        parts.append("none")
    return ", ".join(parts)


def rules_table_markdown() -> str:
    """The classifier rules, first match wins, as Markdown."""
    lines = ["| # | Rule | Status | Message contains | Kind |", "|---|---|---|---|---|"]
    for i, rule in enumerate((*RULES, _FALLBACK), start=1):
        pats = ", ".join(f"`{p}`" for p in rule.patterns) or "-"
        lines.append(f"| {i} | {rule.name} | {_statuses_text(rule)} | {pats} | {rule.kind.value} |")
    return "\n".join(lines) + "\n"
