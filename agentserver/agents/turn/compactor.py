"""Runs a compaction (the I/O half of :mod:`agentserver.agents.turn.compaction`): reads the
Turn's cards and asks the model for the rolling summary. The box swap itself waits for
the step: it is committed by the step's ``complete_step``, in the same compare-and-set
transaction as the step's results, so a Turn fenced out meanwhile writes neither."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from agentserver.agents.ports import LLMMessage, LLMPort, LLMRequest
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.budget import card_tokens
from agentserver.agents.store.base import BoxSwap, Card, CardType, NewCard, TurnStore, TurnToken
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.sql import memory
from agentserver.agents.turn.compaction import (
    SUMMARY,
    SUMMARY_SYSTEM,
    plan,
    summary_chunks,
    summary_max_tokens,
    summary_prompt,
)

log = logging.getLogger(__name__)


async def turn_cards(
    store: TurnStore, context_box: str | None, output_box: str | None
) -> list[Card]:
    cards: list[Card] = []
    if context_box:
        cards += await store.read(memory.cards, context_box)
    if output_box:
        cards += await store.read(memory.cards, output_box)
    return cards


async def summarise(
    llm: LLMPort, agent: str, profile: AgentProfile, previous: str, chunks: list[str]
) -> str:
    """Fold each chunk into the summary, one model call each (one rolling summary)."""
    budget = profile.budget
    summary = previous
    for chunk in chunks:
        done = await llm.complete(
            LLMRequest(
                agent=agent,
                model=profile.model,
                messages=[
                    LLMMessage("system", SUMMARY_SYSTEM),
                    LLMMessage("user", summary_prompt(summary, chunk)),
                ],
                max_tokens=summary_max_tokens(budget),
            )
        )
        summary = done.content.strip() or summary
    return summary


@dataclass(frozen=True, slots=True)
class PendingSwap:
    """A compaction ready for its step: the swap to commit with it, what the model is
    shown meanwhile (the summary, then the kept cards) and their estimated tokens."""

    swap: BoxSwap
    cards: list[Card]
    tokens: int


async def compact_turn(
    store: TurnStore,
    llm: LLMPort,
    token: TurnToken,
    profile: AgentProfile,
    *,
    keep_nothing: bool = False,
) -> PendingSwap | None:
    """Plan and summarise a compaction of the running Turn of ``token``; None when there
    was nothing to fold. Nothing is written: the step commits the returned swap.

    Raises ``LLMUnavailable`` when a summary call fails (the caller's retry rule applies).
    """
    head = await store.read(sql_head.read, token.agent_id)
    cards = await turn_cards(store, head.context_box_id, head.output_box_id)
    p = plan(cards, profile.budget, keep_nothing=keep_nothing)
    if not p.older:
        return None
    budget = profile.budget
    summary = await summarise(
        llm,
        token.agent_id,
        profile,
        p.previous_summary,
        summary_chunks(p, budget, summary_max_tokens(budget)),
    )
    kept = ([p.pinned] if p.pinned else []) + list(p.recent)
    folded = {"folded_cards": len(p.older)}
    swap = BoxSwap(
        NewCard(SUMMARY, summary, folded),
        tuple(c.card_id for c in kept),
        {**folded, "kept_cards": len(kept), "overflow": keep_nothing},
    )
    shown = [Card("", "", SUMMARY, summary, folded, 0.0), *kept]
    cap = budget.tool_result_cap
    tokens = sum(
        card_tokens(c.content, cap if c.card_type == CardType.TOOL_RESULT else None) for c in shown
    )
    log.info(
        "agent %s: compacting %d cards into the summary, keeping %d (about %d tokens)",
        token.agent_id,
        len(p.older),
        len(kept),
        tokens,
    )
    return PendingSwap(swap, shown, tokens)
