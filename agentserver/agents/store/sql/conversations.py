"""Memory across tasks (issue 12): where each conversation's last Turn left its cards."""

from __future__ import annotations

from collections.abc import Sequence

from agentserver.agents.store.base import Card, CardType, NewCard
from agentserver.agents.store.sql.common import (
    copy_cards,
    edge,
    insert_cards,
    tokens_of,
)
from agentserver.agents.store.sql.db import StoreEnv, Tx, insert_rows, new_id
from agentserver.agents.store.sql.memory import turn_cards


def boxes(tx: Tx, agent_id: str, conversation: str) -> tuple[str, str] | None:
    row = tx.one(
        "SELECT context_box_id, output_box_id FROM conversations "
        "WHERE agent_id = ? AND conversation = ?",
        (agent_id, conversation),
    )
    return (row[0], row[1]) if row else None


def save(
    tx: Tx,
    agent_id: str,
    conversation: str | None,
    context_box: str | None,
    output_box: str | None,
    now: float,
) -> None:
    """A Turn of ``conversation`` ended: the conversation continues from its boxes."""
    if not conversation or not context_box or not output_box:
        return
    tx.execute(
        "INSERT INTO conversations (agent_id, conversation, context_box_id, output_box_id, "
        "updated_at) VALUES (?,?,?,?,?) ON CONFLICT (agent_id, conversation) DO UPDATE "
        "SET context_box_id = excluded.context_box_id, "
        "output_box_id = excluded.output_box_id, updated_at = excluded.updated_at",
        (agent_id, conversation, context_box, output_box, now),
    )


def conversation_cards(tx: Tx, env: StoreEnv, agent_id: str, conversation: str) -> list[Card]:
    """The cards a new task of ``conversation`` would continue from (read only)."""
    found = boxes(tx, agent_id, conversation)
    if found is None:
        return []
    context, output = turn_cards(tx, *found)
    return [c for c in (*context, *output) if c.card_type != CardType.DELIVERABLE]


def conversation_boxes(
    tx: Tx, env: StoreEnv, agent_id: str, conversation: str
) -> tuple[str, str] | None:
    return boxes(tx, agent_id, conversation)


def replace_conversation(
    tx: Tx,
    env: StoreEnv,
    agent_id: str,
    conversation: str,
    expect_boxes: tuple[str, str],
    summary: NewCard,
    keep: Sequence[str],
) -> bool:
    """Manual compaction of an idle conversation: [summary] + copies of ``keep``, if the
    conversation still points at ``expect_boxes`` (else False, nothing written)."""
    now = env.clock.now()
    turn = f"compaction:{new_id()}"
    context_box, output_box = new_id(), new_id()
    tx.execute(
        "UPDATE conversations SET context_box_id = ?, output_box_id = ?, updated_at = ? "
        "WHERE agent_id = ? AND conversation = ? AND context_box_id = ? AND output_box_id = ?",
        (context_box, output_box, now, agent_id, conversation, *expect_boxes),
    )
    if tx.rowcount != 1:
        return False
    insert_rows(
        tx,
        "INSERT INTO boxes (box_id, agent_id, agent_turn_id, kind, created_at)",
        [
            (context_box, agent_id, turn, "context", now),
            (output_box, agent_id, turn, "output", now),
        ],
    )
    insert_cards(tx, env, context_box, turn, [(summary, tokens_of(env, agent_id, summary))])
    copy_cards(tx, output_box, turn, keep)
    edge(tx, env, agent_id, None, "compact", "response", metadata={"conversation": conversation})
    return True
