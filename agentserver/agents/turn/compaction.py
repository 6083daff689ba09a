"""Compaction: keep a Turn's context under the model's window (pure: no I/O).

Rule (docs/agents.md, "Context budget and compaction"): when a request would exceed
``window - context-reserve - max output``, the older cards are summarised by the model
into one summary card that merges the previous summary (one rolling summary, never a
summary of summaries), the recent cards up to ``keep-recent`` tokens stay verbatim, and
the Turn's boxes are swapped to [summary + recent]. A kept exchange always starts at a
model reply or a task: a tool call (in the model's reply) and its result are never split.
The current task stays verbatim when it fits in ``keep-recent`` by itself: the oldest kept
exchanges are folded first to make room for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentserver.agents.profile.budget import Budget, card_tokens, shown_text
from agentserver.agents.store.base import Card, CardType
from agentserver.llm.tokens import estimate_message_tokens

#: The card type of the rolling summary (first card of the context box after a swap).
SUMMARY = CardType.SUMMARY

#: A kept run of cards must start with one of these (an exchange's first card).
_STARTS = frozenset({CardType.LLM_MESSAGE, CardType.TASK_INPUT})

SUMMARY_SYSTEM = (
    "You keep the running summary of a conversation between a user, an assistant and "
    "its tools. Rewrite the summary so far and the new part of the conversation as ONE "
    "updated summary: keep every fact, name, number, decision, tool result and open "
    "question the assistant still needs; drop chatter. Write plain prose, no XML markup."
)


@dataclass(frozen=True, slots=True)
class Plan:
    previous_summary: str
    older: tuple[Card, ...]  # to fold into the summary
    recent: tuple[Card, ...]  # kept verbatim, in order
    pinned: Card | None  # the current task, kept verbatim before ``recent``


def keep_limit(budget: Budget) -> int:
    """``keep-recent``, but never more than half of what a request may hold."""
    return min(budget.keep_recent, budget.prompt_limit // 2)


def plan(cards: Sequence[Card], budget: Budget, *, keep_nothing: bool = False) -> Plan:
    """Split a Turn's cards (context box then output box) into summary input and kept.

    ``keep_nothing``: after a provider's context overflow, fold everything but the task.
    """
    previous = ""
    body: list[Card] = []
    for card in cards:
        if card.card_type == SUMMARY:
            previous = card.content
        else:
            body.append(card)
    limit = 0 if keep_nothing else keep_limit(budget)
    cost = [_tokens(c, budget) for c in body]
    # Take cards from the end while they fit, then move the cut later until the first
    # kept card starts an exchange (so no tool result is kept without its call).
    start, used = len(body), 0
    while start > 0 and used + cost[start - 1] <= limit:
        start -= 1
        used += cost[start]
    while start < len(body) and body[start].card_type not in _STARTS:
        start += 1
    pinned = None
    tasks = [c for c in body[:start] if c.card_type == CardType.TASK_INPUT]
    current = tasks and not any(c.card_type == CardType.TASK_INPUT for c in body[start:])
    if tasks:
        need = _tokens(tasks[-1], budget)
        keep = keep_limit(budget)
        if current and need <= keep:
            # The current task fits keep-recent by itself: it stays verbatim, and the
            # oldest kept exchanges are folded instead until it fits beside them (else a
            # long exchange of its own tools would fold the task the Turn is for).
            while start < len(body) and used + need > keep:
                used -= cost[start]
                start += 1
                while start < len(body) and body[start].card_type not in _STARTS:
                    used -= cost[start]
                    start += 1
            pinned = tasks[-1]
        elif need <= max(keep - used, 0):
            pinned = tasks[-1]
    older, recent = body[:start], body[start:]
    if pinned is not None:
        older = [c for c in older if c is not pinned]
    return Plan(previous, tuple(older), tuple(recent), pinned)


def _tokens(card: Card, budget: Budget) -> int:
    cap = budget.tool_result_cap if card.card_type == CardType.TOOL_RESULT else None
    return card_tokens(card.content, cap)


def render(card: Card, cap: int) -> str:
    """One card as a line of the transcript the summariser reads."""
    who = {
        CardType.TASK_INPUT: "User task",
        CardType.LLM_MESSAGE: "Assistant",
        CardType.TOOL_RESULT: f"Result from {card.metadata.get('to', 'a tool')}",
        CardType.HUH: "Refused payload",
        CardType.SELF_CALL: "Assistant continued",
        CardType.NOTE: "Note",
    }.get(card.card_type)
    if who is None:
        return ""
    return f"{who}:\n{shown_text(card.content, cap)}"


def summary_chunks(p: Plan, budget: Budget, summary_max: int) -> list[str]:
    """The transcript of ``p.older`` cut into pieces that each fit one summary request
    next to the summary so far (at most ``summary_max`` tokens) and the instructions."""
    # The summary so far is at most ``summary_max`` real tokens; our estimate of it may be
    # a third higher (three characters a token against about four), so allow twice that.
    room = budget.prompt_limit - 2 * summary_max - estimate_message_tokens(SUMMARY_SYSTEM) - 64
    room = max(room, 256)
    chunks: list[str] = []
    current: list[str] = []
    used = 0
    for card in p.older:
        text = render(card, room // 2)
        if not text:
            continue
        cost = estimate_message_tokens(text)
        if current and used + cost > room:
            chunks.append("\n\n".join(current))
            current, used = [], 0
        current.append(text)
        used += cost
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def summary_prompt(previous: str, chunk: str) -> str:
    head = f"Summary so far:\n{previous}" if previous else "Summary so far: (none yet)"
    return f"{head}\n\nNew part of the conversation:\n{chunk}\n\nWrite the updated summary."


def summary_max_tokens(budget: Budget) -> int:
    """The summary's own size: a quarter of a request, between 256 and 2048 tokens."""
    return max(256, min(2048, budget.prompt_limit // 4))
