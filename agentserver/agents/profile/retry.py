"""Step retry: what to do when the model call of a step fails (pure, table-driven).

The router already retries one HTTP call (short waits, failover). When it gives up, the
*step* may still be retried later: the worker writes a durable ``resume`` row due at
``now + delay`` and lets go of the Turn (nothing is held in memory, so a restart resumes
the wait and a stop ends the Turn at once). The table below says, per error kind, whether
the step is retried; the delay rule is in :func:`decide_retry`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

#: Error kind (the router's ``ErrorKind`` value, or a port's own kind) → retry the step?
#: Kinds not listed fail the Turn at once (auth, billing, unknown model, blocked content,
#: malformed request, a stream cut mid-answer, a connection refused by a fake port, ...).
RETRY_TABLE: Mapping[str, bool] = {
    "RATE_LIMIT": True,
    "OVERLOADED": True,
    "SERVER_ERROR": True,
    "TIMEOUT": True,
    "UNKNOWN": True,
    # A backend that refuses connections is down, not busy: waiting 2+4+8 s would only
    # delay the failed answer (the router has already failed over to any other backend).
    "UNREACHABLE": False,
    "CONTEXT_OVERFLOW": False,  # handled by compaction, not by waiting
    "AUTH": False,
    "AUTH_PERMANENT": False,
    "BILLING": False,
    "MODEL_NOT_FOUND": False,
    "CONTENT_BLOCKED": False,
    "FORMAT_ERROR": False,
}


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``<agent step-retries step-retry-base max-retry-after>`` (seconds)."""

    step_retries: int = 3
    step_retry_base_s: float = 2.0
    max_retry_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.step_retries < 0 or self.step_retry_base_s < 0 or self.max_retry_after_s < 0:
            raise ValueError("step retry settings must be >= 0")


@dataclass(frozen=True, slots=True)
class RetryStep:
    attempt: int  # 1 for the first retry
    delay_s: float


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


def retryable(kind: str) -> bool:
    return RETRY_TABLE.get(kind.upper(), False)


def decide_retry(
    kind: str, retry_after_s: float | None, retries_done: int, policy: RetryPolicy
) -> RetryStep | GiveUp:
    """Retry ``n = retries_done + 1`` of a failed step, or give up.

    delay = the error's Retry-After capped at ``max_retry_after_s`` if it has one, else
    ``step_retry_base_s * 2**(n-1)``; at most ``step_retries`` retries per step.
    """
    if not retryable(kind):
        return GiveUp(f"{kind} is not retryable")
    if retries_done >= policy.step_retries:
        return GiveUp(f"gave up after {retries_done} step retries")
    n = retries_done + 1
    if retry_after_s is not None and retry_after_s >= 0:
        delay = min(retry_after_s, policy.max_retry_after_s)
    else:
        delay = policy.step_retry_base_s * 2 ** (n - 1)
    return RetryStep(n, delay)


def step_retry_payload(retries_done: int) -> bytes:
    """The payload of a step-retry ``resume`` row: how many retries the step has had."""
    return json.dumps({"step_retries": retries_done}).encode()


def step_retries_done(payload: bytes) -> int:
    """Retries already made for the step a ``resume`` row re-runs (0: a plain resume)."""
    if not payload:
        return 0
    try:
        return max(0, int(json.loads(payload).get("step_retries", 0)))
    except (ValueError, TypeError, AttributeError):
        return 0
