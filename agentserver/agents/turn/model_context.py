"""What the model is shown of a Turn: the system text, each card as a message (tool
results cut to the budget's cap, with governance's notes), the last-step note, and the
failed answer at the step limit. Pure functions of the profile and the cards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agentserver.agents.governance.governor import result_annotations
from agentserver.agents.ports import LLMMessage
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.budget import shown_text
from agentserver.agents.reading.submit import usage_text
from agentserver.agents.store.base import Card, CardType
from agentserver.core.usage import RESPOND_WARNING

LAST_STEP_NOTE = (
    "This is your last step: answer now with what you have. Tool calls made now will not "
    "be followed by another step."
)


def model_messages(
    profile: AgentProfile, system: str, cards: Sequence[Card], last: bool
) -> list[LLMMessage]:
    """The request's messages: the system text, the cards as the model reads them, and
    on the ``last`` step, the note saying so."""
    messages = [LLMMessage("system", system)]
    cap = profile.budget.tool_result_cap
    notes = result_annotations(cards)
    for card in cards:
        message = card_message(card, notes, cap)
        if message is not None:
            messages.append(message)
    if last:
        messages.append(LLMMessage("user", LAST_STEP_NOTE))
    return messages


def limit_text(output: Sequence[Card], profile: AgentProfile) -> str:
    """The failed answer at the step limit, with the last thing the model said."""
    text = f"step limit reached ({profile.max_steps} steps) without an answer"
    said = [c.content.strip() for c in output if c.card_type == CardType.LLM_MESSAGE]
    said = [t for t in said if t]
    if said:
        text += f". The model's last message: {said[-1]}"
    return text


def system_text(profile: AgentProfile) -> str:
    system = [profile.system_prompt]
    if profile.usage_instructions:
        system.append(profile.usage_instructions)
    system.append(usage_text(profile.result_fields))
    if not profile.usage_instructions:
        # The pump's usage_instructions already end with the respond-prunes warning;
        # an agent run without them still gets it, once.
        system.append(RESPOND_WARNING)
    return "\n\n".join(system)


def card_message(
    card: Card,
    notes: Mapping[str, Mapping[str, object]] | None = None,
    tool_result_cap: int | None = None,
) -> LLMMessage | None:
    """How a card reads in the model's context (None: not shown). ``notes``: what
    governance adds to tool results (:func:`~agentserver.agents.governance.governor.result_annotations`).
    A tool result is cut to ``tool_result_cap`` tokens (the store keeps it whole).
    """
    t = card.card_type
    if t == CardType.TASK_INPUT:
        return LLMMessage("user", card.content)
    if t == CardType.LLM_MESSAGE:
        return LLMMessage("assistant", card.content)
    if t == CardType.TOOL_RESULT:
        to = card.metadata.get("to", "?")
        note = (notes or {}).get(str(card.metadata.get("tool_call_id")), {})
        if note.get("block"):
            return LLMMessage("user", f"Tool call to {to} failed:\nblocked: {note['block']}")
        head = f"Tool call to {to} failed:" if card.metadata.get("failed") else f"Result from {to}:"
        warns = note.get("warn")
        tail = "".join(f"\n{w}" for w in warns) if isinstance(warns, list) else ""
        return LLMMessage("user", f"{head}\n{shown_text(card.content, tool_result_cap)}{tail}")
    if t == CardType.TOOL_REFUSED:
        to = card.metadata.get("to", "?")
        return LLMMessage("user", f"Tool call to {to} failed:\n{card.content}")
    if t == CardType.HUH:
        hint = card.metadata.get("hint")
        tail = f"\nHint: {hint}" if hint else ""
        return LLMMessage("user", f"Your payload was refused:\n{card.content}{tail}")
    if t == CardType.SELF_CALL:
        return LLMMessage("user", f"(self-iteration accepted; continue)\n{card.content}")
    if t == CardType.NOTE:
        return LLMMessage("user", card.content)
    if t == CardType.SUMMARY:
        return LLMMessage("user", f"Summary of the conversation so far:\n{card.content}")
    return None
