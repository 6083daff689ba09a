"""Runs a compaction (the I/O half of :mod:`agentserver.agents.compaction`): reads the
Turn's cards, asks the model for the rolling summary, and swaps the boxes in the store."""

from __future__ import annotations

import logging

from agentserver.agents.compaction import (
    SUMMARY,
    SUMMARY_SYSTEM,
    plan,
    summary_chunks,
    summary_max_tokens,
    summary_prompt,
)
from agentserver.agents.ports import LLMMessage, LLMPort, LLMRequest
from agentserver.agents.profile import AgentProfile
from agentserver.agents.store import AgentStore, Card, NewCard, TurnToken

log = logging.getLogger(__name__)


async def turn_cards(
    store: AgentStore, context_box: str | None, output_box: str | None
) -> list[Card]:
    cards: list[Card] = []
    if context_box:
        cards += await store.cards(context_box)
    if output_box:
        cards += await store.cards(output_box)
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


async def compact_turn(
    store: AgentStore,
    llm: LLMPort,
    token: TurnToken,
    profile: AgentProfile,
    *,
    keep_nothing: bool = False,
) -> bool:
    """Compact the running Turn of ``token``; False when there was nothing to fold.

    Raises ``LLMUnavailable`` when a summary call fails (the caller's retry rule applies)
    and ``StaleTurn`` when the Turn moved on (nothing was swapped).
    """
    head = await store.head(token.agent_id)
    cards = await turn_cards(store, head.context_box_id, head.output_box_id)
    p = plan(cards, profile.budget, keep_nothing=keep_nothing)
    if not p.older:
        return False
    budget = profile.budget
    summary = await summarise(
        llm,
        token.agent_id,
        profile,
        p.previous_summary,
        summary_chunks(p, budget, summary_max_tokens(budget)),
    )
    keep = ([p.pinned.card_id] if p.pinned else []) + [c.card_id for c in p.recent]
    total = await store.compact(
        token,
        NewCard(SUMMARY, summary, {"folded_cards": len(p.older)}),
        keep,
        edge={"folded_cards": len(p.older), "kept_cards": len(keep), "overflow": keep_nothing},
    )
    log.info(
        "agent %s: compacted %d cards into the summary, kept %d (%d tokens now)",
        token.agent_id,
        len(p.older),
        len(keep),
        total,
    )
    return True
