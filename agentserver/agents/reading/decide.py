"""What a step does with the model's reply (pure: no I/O, no store).

Rules, in order:

1. Any payload that failed to parse or resolve: nothing is sent; the model gets one
   ``<huh>`` per failure and tries again (the step counts toward the step limit).
2. Payloads must be of one kind: one or more tool calls, or exactly one self-iteration,
   or exactly one ``submit_result``, or exactly one answer element. Anything else earns a
   ``<huh>``. (So ``submit_result`` is used at most once per Turn: it ends the Turn.)
3. Tool calls: forward each (the worker suspends on the ones the pump accepted).
4. Self-iteration: the payload continues the same Turn as its next step.
5. ``submit_result``: the fields become the deliverable (validated, degraded if needed).
6. No payload (or an answer element): natural completion. The text is the deliverable,
   unless the profile's ``must_end_with`` demands a tool first: then a note asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentserver.agents.profile.agent import SUBMIT_RESULT, AgentProfile
from agentserver.agents.reading.parsing import FoundPayload, ParseResult, PayloadError, PayloadKind
from agentserver.core.errors import HuhReason

EMPTY_ANSWER = "(the agent produced an empty answer)"


@dataclass(frozen=True, slots=True)
class Feedback:
    """Refused payloads: show the model these errors and take another step."""

    errors: tuple[PayloadError, ...]


@dataclass(frozen=True, slots=True)
class CallTools:
    calls: tuple[FoundPayload, ...]


@dataclass(frozen=True, slots=True)
class SelfIterate:
    payload: FoundPayload


@dataclass(frozen=True, slots=True)
class Submit:
    payload: FoundPayload


@dataclass(frozen=True, slots=True)
class Deliver:
    text: str


@dataclass(frozen=True, slots=True)
class RequireTool:
    """``must_end_with`` refused a natural completion."""

    note: str


Decision = Feedback | CallTools | SelfIterate | Submit | Deliver | RequireTool


def _answer_text(p: FoundPayload) -> str:
    texts = [c for c in p.element if isinstance(c.tag, str) and c.tag.endswith("}text")]
    node = texts[0] if texts else p.element
    return "".join(node.itertext()).strip()


def decide(text: str, parsed: ParseResult, profile: AgentProfile) -> Decision:
    """The action for one model reply; see the module docstring for the rules."""
    if parsed.errors:
        return Feedback(tuple(parsed.errors))
    payloads = parsed.payloads
    kinds = {p.kind for p in payloads}
    if len(kinds) > 1 or (kinds and kinds != {PayloadKind.TOOL} and len(payloads) > 1):
        hint = (
            "write either tool calls, or one self-iteration payload, or one "
            f"<{SUBMIT_RESULT}>, or one answer, per reply"
        )
        return Feedback(
            tuple(PayloadError(HuhReason.INVALID_PAYLOAD, hint, p.raw) for p in payloads)
        )
    if kinds == {PayloadKind.TOOL}:
        return CallTools(tuple(payloads))
    if kinds == {PayloadKind.SELF}:
        return SelfIterate(payloads[0])
    if kinds == {PayloadKind.SUBMIT}:
        return Submit(payloads[0])
    if profile.must_end_with:
        return RequireTool(
            "This task must end with one of these tools: "
            + ", ".join(profile.must_end_with)
            + ". Call one of them now."
        )
    answer = _answer_text(payloads[0]) if payloads else text.strip()
    return Deliver(answer or EMPTY_ANSWER)
