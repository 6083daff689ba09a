"""Retry decisions for steps (attempts on remote listeners). Pure: no clock, no I/O.

The step state machine itself is :data:`agentserver.agents.store.states.STEP_TRANSITIONS`;
:mod:`agentserver.remote.hub` applies it and these decisions, and only moves bytes and time.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentserver.steps.states import StepStatus

#: The first retry waits this long; each further one twice as long ...
BACKOFF_BASE = 1.0
#: ... up to this.
BACKOFF_CAP = 30.0
DEFAULT_RETRIES = 3
#: Where a tool call's card keeps its idempotency key (its metadata).
KEY_FIELD = "idempotency_key"


def idempotency_key(step_id: str, index: int) -> str:
    """The idempotency key of the ``index``-th call (0-based) of a model's message in step
    ``step_id``: fixed once the step's output is recorded, so every attempt of the call
    (retries, a runner's death, a restart) carries it, and two calls of one message (even
    identical ones) differ."""
    return f"{step_id}.{index}"


def backoff(retry: int) -> float:
    """Seconds to wait before retry number ``retry`` (1-based): 1, 2, 4, ... capped at 30."""
    if retry < 1:
        raise ValueError("retries are numbered from 1")
    # min() before the power would overflow for absurd retry counts.
    return min(BACKOFF_CAP, BACKOFF_BASE * 2 ** min(retry - 1, 16))


@dataclass(frozen=True, slots=True)
class StepPolicy:
    """How one remote listener's steps are timed and retried."""

    step_timeout: float
    idempotent: bool = False
    retries: int = DEFAULT_RETRIES

    def budget(self) -> float:
        """The longest a whole step may take: every attempt plus every backoff. The pump's
        own timeout for the listener is set just above it (a backstop, never the rule)."""
        attempts = 1 + self.retries
        return attempts * self.step_timeout + sum(backoff(n) for n in range(1, self.retries + 1))


def should_retry(
    policy: StepPolicy, outcome: StepStatus, *, started: bool, retries_done: int
) -> bool:
    """May an attempt that ended in ``outcome`` be tried again?

    - success and cancellation are final;
    - a job whose runner was lost before it began (it never said ``<started/>`` nor sent
      anything) has had no effect: it goes to another runner whatever the listener;
    - otherwise only an idempotent listener is retried (a non-idempotent one is never
      retried automatically: the job may have had its effect);
    - never more than ``policy.retries`` times.
    """
    if retries_done >= policy.retries:
        return False
    if outcome is StepStatus.FAILED and not started:
        return True
    return policy.idempotent and outcome in (StepStatus.FAILED, StepStatus.TIMED_OUT)
