"""Forks (docs/agents.md, "Fork"): a new conversation made of a recorded Turn's cards up
to one of its steps, which the next task it is given continues. The original is only
read."""

from __future__ import annotations

import json
from typing import Any

from agentserver.agents.errors import ForkRefused, TurnPruned
from agentserver.agents.store.base import CardType
from agentserver.agents.store.sql.common import insert_copies
from agentserver.agents.store.sql.db import StoreEnv, Tx, insert_rows, new_id
from agentserver.agents.store.sql.memory import box_rows, copy_row
from agentserver.agents.store.sql.record import find_turn
from agentserver.agents.store.sql.tombstones import thread_pruned

_COPY_COLS = "card_id, agent_turn_id, card_type, content, metadata, created_at, tokens"


def fork(tx: Tx, env: StoreEnv, agent: str, thread: str, at_step: int) -> dict[str, Any]:
    """Copy the cards of the latest Turn of ``agent`` on ``thread`` up to step ``at_step``
    (its model output, its tool calls and their results; what its model saw before) into
    a new conversation. Returns the conversation's key, the origin (thread, Turn, step)
    and the original task's payload. Raises :class:`ForkRefused` (no such Turn or step)."""
    found = find_turn(tx, agent, thread)
    if found is None:
        if thread_pruned(tx, agent, thread):
            raise TurnPruned(agent, thread)
        raise ForkRefused(f"no Turn of {agent!r} on thread {thread!r}")
    turn, task = found
    step_no = {
        r[0]: int(r[1])
        for r in tx.all("SELECT step_id, step_no FROM agent_steps WHERE agent_turn_id = ?", (turn,))
    }
    said = [
        (r[0], r[1], step_no.get(json.loads(r[2] or "{}").get("step_id"), 0))
        for r in tx.all(
            "SELECT seq, box_id, metadata FROM cards WHERE agent_turn_id = ? AND card_type = ? "
            "ORDER BY seq",
            (turn, CardType.LLM_MESSAGE),
        )
    ]
    at = [s for s in said if s[2] == at_step]
    if at_step < 1 or not at:
        steps = max((s[2] for s in said), default=0)
        raise ForkRefused(f"the Turn has no step {at_step} (it has {steps} with a model output)")
    _, output_box, _ = at[-1]
    later = [s[0] for s in said if s[1] == output_box and s[2] > at_step]
    cut = min(later) if later else None
    (context_box,) = tx.one(
        "SELECT box_id FROM boxes WHERE agent_turn_id = ? AND kind = ? AND created_at <= "
        "(SELECT created_at FROM boxes WHERE box_id = ?) ORDER BY created_at DESC LIMIT 1",
        (turn, "context", output_box),
    ) or (None,)
    rows: list[tuple[Any, ...]] = []
    if context_box is not None:
        # What its model saw: the context box's memory resolved, then its own cards.
        rows += [copy_row(r) for r in box_rows(tx, context_box) if r[2] != CardType.DELIVERABLE]
    rows += [
        r[:7]
        for r in tx.all(
            f"SELECT {_COPY_COLS}, seq FROM cards WHERE box_id = ? AND card_type != ? ORDER BY seq",
            (output_box, CardType.DELIVERABLE),
        )
        if cut is None or r[7] < cut
    ]
    conversation = f"fork:{new_id()}"
    now = env.clock.now()
    new_context, new_output = new_id(), new_id()
    # The boxes and copies belong to the fork (its key), not to the original Turn, whose
    # record stays as it was; its first Turn copies them again as its own.
    insert_rows(
        tx,
        "INSERT INTO boxes (box_id, agent_id, agent_turn_id, kind, created_at)",
        [
            (new_context, agent, conversation, "context", now),
            (new_output, agent, conversation, "output", now),
        ],
    )
    insert_copies(tx, new_context, conversation, rows)
    tx.execute(
        "INSERT INTO conversations (agent_id, conversation, context_box_id, output_box_id, "
        "updated_at) VALUES (?,?,?,?,?)",
        (agent, conversation, new_context, new_output, now),
    )
    tx.execute(
        "INSERT INTO forks (agent_id, conversation, origin_thread, origin_turn, at_step, "
        "created_at) VALUES (?,?,?,?,?,?)",
        (agent, conversation, thread, turn, at_step, now),
    )
    return {
        "conversation": conversation,
        "origin": {"thread": thread, "turn": turn, "step": at_step},
        "task": task,
        "cards": len(rows),
    }
