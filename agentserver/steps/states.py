"""The step state machine, as data: one attempt of a tool invocation (sans-IO).

Shared by :mod:`agentserver.remote.hub` (remote runners), :mod:`agentserver.steps.local`
(in-process listeners) and the agent store, which embeds this table with its own
machines (:mod:`agentserver.agents.store.states`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from agentserver.core.errors import IllegalTransition


@dataclass(frozen=True, slots=True)
class Transition:
    target: str
    bumps_epoch: bool = False
    why: str = ""


class StepStatus(enum.StrEnum):
    """One attempt of a tool invocation on a remote listener (:mod:`agentserver.remote.hub`)."""

    PENDING = "pending"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


class StepEvent(enum.StrEnum):
    DISPATCH = "dispatch"  # the job was written to a runner
    START = "start"  # the runner said <started/>, or its first output arrived
    SUCCEED = "succeed"  # the runner answered or ended the job
    FAIL = "fail"  # the runner's connection was lost
    TIME_OUT = "time_out"  # step-timeout reached
    CANCEL = "cancel"  # stopped from outside, or the pump gave up on the call


_S = StepStatus
#: States an attempt ends in.
FINAL_STEP = frozenset({_S.SUCCEEDED, _S.FAILED, _S.TIMED_OUT, _S.CANCELLED})

STEP_TRANSITIONS: Mapping[tuple[StepStatus, StepEvent], Transition] = {
    (_S.PENDING, StepEvent.DISPATCH): Transition(_S.DISPATCHED, False, "sent to a runner"),
    (_S.PENDING, StepEvent.TIME_OUT): Transition(_S.TIMED_OUT, False, "no runner in time"),
    (_S.PENDING, StepEvent.CANCEL): Transition(_S.CANCELLED, False, "stopped"),
    (_S.DISPATCHED, StepEvent.START): Transition(_S.RUNNING, False, "runner began"),
    (_S.DISPATCHED, StepEvent.FAIL): Transition(_S.FAILED, False, "runner lost, not started"),
    (_S.DISPATCHED, StepEvent.TIME_OUT): Transition(_S.TIMED_OUT, False, "deadline"),
    (_S.DISPATCHED, StepEvent.CANCEL): Transition(_S.CANCELLED, False, "stopped; <cancel> sent"),
    (_S.RUNNING, StepEvent.SUCCEED): Transition(_S.SUCCEEDED, False, "answered or ended"),
    (_S.RUNNING, StepEvent.FAIL): Transition(_S.FAILED, False, "runner lost mid-job"),
    (_S.RUNNING, StepEvent.TIME_OUT): Transition(_S.TIMED_OUT, False, "deadline"),
    (_S.RUNNING, StepEvent.CANCEL): Transition(_S.CANCELLED, False, "stopped; <cancel> sent"),
}


def step_transition(state: StepStatus | str, event: StepEvent | str) -> Transition:
    """Return the transition for ``(state, event)`` or raise :class:`IllegalTransition`."""
    try:
        return STEP_TRANSITIONS[(StepStatus(state), StepEvent(event))]
    except (KeyError, ValueError):
        raise IllegalTransition("step", str(state), str(event)) from None
