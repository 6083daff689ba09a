"""Guardrails: checks run on every tool call (``before``) and tool result (``after``).

A guardrail is ``module:function`` (sync or async) taking one :class:`GuardCall` and
returning :data:`ALLOW` (or ``None``), :class:`Warn`, :class:`Block` or :class:`Halt`.
Everything it may want to know about the Turn so far is in ``GuardCall.history``, read
from the Turn's stored cards, so a restarted server sees the same history: guardrails
keep no state of their own. A guardrail that raises counts as allow.

Loop detection is the built-in guardrail: :func:`loop_verdict` counts how often the same
target was called with the same canonical payload (C14N) in the Turn.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lxml import etree

from agentserver.core.xmlsafe import SafeParser

log = logging.getLogger(__name__)

BEFORE = "before"
AFTER = "after"


@dataclass(frozen=True, slots=True)
class Allow:
    pass


@dataclass(frozen=True, slots=True)
class Warn:
    """Append ``text`` to the result the model sees."""

    text: str


@dataclass(frozen=True, slots=True)
class Block:
    """Replace the call (or its result) with a synthetic error result saying ``text``."""

    text: str


@dataclass(frozen=True, slots=True)
class Halt:
    """End the Turn with one failed answer saying ``text``."""

    text: str


ALLOW = Allow()
GuardDecision = Allow | Warn | Block | Halt


@dataclass(frozen=True, slots=True)
class PastCall:
    """A tool call made earlier in the Turn (``canonical`` is its C14N payload)."""

    target: str
    canonical: str


@dataclass(frozen=True, slots=True)
class GuardCall:
    """What a guardrail sees. ``result`` and ``failed`` are set for ``after`` only."""

    when: str
    agent: str
    turn_id: str
    step: int
    target: str
    payload: str
    history: tuple[PastCall, ...]
    result: str | None = None
    failed: bool = False


@dataclass(frozen=True, slots=True)
class GuardrailSpec:
    when: str
    handler_ref: str
    handler: Callable[[GuardCall], object]


def canonical(payload: etree._Element | str) -> str:
    """The payload in canonical form (C14N), so equal calls compare equal as strings."""
    if not isinstance(payload, str):
        element = payload
    else:
        try:
            element = SafeParser().parse(payload.encode("utf-8"))
        except Exception:
            return payload
    return etree.tostring(element, method="c14n").decode("utf-8")


def loop_verdict(
    target: str, canon: str, history: Sequence[PastCall], warn_at: int, block_at: int
) -> GuardDecision:
    """The built-in loop detector: this call is occurrence N of (target, payload)."""
    n = 1 + sum(1 for c in history if c.target == target and c.canonical == canon)
    if block_at and n >= block_at:
        return Block(
            f"loop detected: this is call {n} to {target} with the same payload in this "
            "task; it was not sent. Change approach or answer with what you have."
        )
    if warn_at and n >= warn_at:
        return Warn(
            f"Warning: this is call {n} to {target} with the same payload in this task; "
            "repeating it will not change the result."
        )
    return ALLOW


class GuardrailRunner:
    """Calls guardrails; logs a raising guardrail once per (guardrail, error) per process."""

    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()

    async def run(self, specs: Sequence[GuardrailSpec], call: GuardCall) -> list[GuardDecision]:
        out: list[GuardDecision] = []
        for spec in specs:
            if spec.when != call.when:
                continue
            try:
                decision = spec.handler(call)
                if inspect.isawaitable(decision):
                    decision = await decision
            except Exception as exc:
                key = (spec.handler_ref, type(exc).__name__)
                if key not in self._logged:
                    self._logged.add(key)
                    log.error(
                        "guardrail %s raised %s: %s (counted as allow)",
                        spec.handler_ref,
                        type(exc).__name__,
                        exc,
                    )
                continue
            if decision is None:
                continue
            if not isinstance(decision, Allow | Warn | Block | Halt):
                key = (spec.handler_ref, "bad-return")
                if key not in self._logged:
                    self._logged.add(key)
                    log.error(
                        "guardrail %s returned %r, not allow/warn/block/halt (counted as allow)",
                        spec.handler_ref,
                        decision,
                    )
                continue
            out.append(decision)
        return out


def combine(decisions: Sequence[GuardDecision]) -> Halt | Block | tuple[Warn, ...]:
    """The strongest decision (halt > block), else every warning (possibly none)."""
    for d in decisions:
        if isinstance(d, Halt):
            return d
    for d in decisions:
        if isinstance(d, Block):
            return d
    return tuple(d for d in decisions if isinstance(d, Warn))
