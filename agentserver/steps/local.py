"""In-process listeners' steps: ``step-timeout``, ``retries`` and ``idempotent`` as remote
listeners have them (agentserver/remote/hub.py), around the handler itself.

Each delivery is a step; each call of the handler an attempt, bounded by
``policy.step_timeout`` (its own cancel scope). A timed-out or failed (raised) attempt is
retried by :func:`agentserver.steps.retry.should_retry` (idempotent listeners only) after
:func:`~agentserver.steps.retry.backoff`, with the same
:class:`~agentserver.core.listener.HandlerMetadata`, so every attempt sees the same
``idempotency_key``. A :class:`~agentserver.core.errors.Refusal` the handler raises is its
answer, never retried. The last outcome reaches the caller as the hub's does: a timeout as
``<SystemError>`` ``timeout``, a failure as the handler's exception. Cancelled from outside
(a stop, the pump's backstop timeout, shutdown): the attempt is cancelled, nothing retried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from agentserver.core.errors import DeliveryRefused, Refusal, SystemErrorCode
from agentserver.core.listener import Handler, HandlerMetadata, HandlerResult
from agentserver.core.threads import new_thread_id
from agentserver.steps.log import StepRow
from agentserver.steps.retry import StepPolicy, backoff, should_retry
from agentserver.steps.states import StepStatus

log = logging.getLogger("agentserver.steps")


def retrying_handler(
    name: str,
    handler: Handler,
    policy: StepPolicy,
    on_step: Callable[[StepRow], None] | None = None,
) -> Handler:
    """``handler`` run as steps under ``policy``; ``on_step`` records each step event
    (``step.retried``, ``step.succeeded``, ``step.timed_out``, ``step.failed``)."""

    def note(row: StepRow) -> None:
        row.at = time.time()
        if row.event == "step.retried":
            log.warning(
                "step.retried step=%s listener=%s caller=%s attempt=%d reason=%s",
                row.step,
                name,
                row.caller,
                row.attempt,
                row.detail,
            )
        if on_step is not None:
            on_step(row)

    async def step_handler(payload: object, meta: HandlerMetadata) -> HandlerResult:
        step = new_thread_id()
        retries = 0
        while True:
            attempt = retries + 1
            failure: Exception | None = None
            with trio.move_on_after(policy.step_timeout) as scope:
                try:
                    result = await handler(payload, meta)
                except Refusal:
                    raise
                except Exception as exc:
                    failure = exc
                else:
                    note(StepRow(step, name, meta.from_id, attempt, "step.succeeded"))
                    return result
            outcome = StepStatus.TIMED_OUT if scope.cancelled_caught else StepStatus.FAILED
            detail = "step-timeout" if failure is None else f"raised {type(failure).__name__}"
            if not should_retry(policy, outcome, started=True, retries_done=retries):
                note(StepRow(step, name, meta.from_id, attempt, f"step.{outcome}", detail))
                if failure is not None:
                    raise failure
                raise DeliveryRefused(SystemErrorCode.TIMEOUT, retry_allowed=True)
            retries += 1
            note(StepRow(step, name, meta.from_id, attempt + 1, "step.retried", detail))
            await trio.sleep(backoff(retries))

    step_handler.__qualname__ = f"steps:{name}"
    return step_handler
