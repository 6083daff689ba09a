"""Row shapes and the small writes every concern shares: inbox moves, edges, cards."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agentserver.agents.profile.budget import card_tokens
from agentserver.agents.store.base import Card, CardType, InboxRow, NewCard
from agentserver.agents.store.sql.db import StoreEnv, Tx, insert_rows, marks, new_id
from agentserver.agents.store.states import InboxEvent, inbox_sources, inbox_transition

HEAD_COLS = (
    "agent_id, status, active_agent_turn_id, turn_epoch, turn_inbox_id, context_box_id, "
    "output_box_id, step_count, waiting_tool_count, resume_deadline, "
    "dispatched_at, running_since, updated_at, context_tokens, turn_version, turn_pin"
)
INBOX_COLS = (
    "inbox_id, agent_id, message_type, status, agent_turn_id, turn_epoch, correlation_id, "
    "payload, reply_ref, failed, retry_count, next_retry_at, defer_reason, created_at, version"
)
CARD_COLS = "card_id, box_id, card_type, content, metadata, created_at"
#: A consumed inbox row's payload (issue 38: what is written twice is kept once): a Turn's
#: task is its ``task.input`` card from its lease on, a tool report is its ``tool.result``
#: card (named by the waiting row), each written before or with the consume; no one reads
#: a consumed row's payload (a Turn's record falls back to its task card, sql/record.py).
CONSUMED_PAYLOAD = b""

#: Card types the worker never shows the model (``model_context.card_message`` returns None):
#: they cost no context tokens.
UNSHOWN = frozenset({CardType.DELIVERABLE, CardType.TOOL_CALL, CardType.GUARD})


def inbox_row(row: Sequence[Any]) -> InboxRow:
    r = list(row)
    r[7] = bytes(r[7])
    r[9] = bool(r[9])
    return InboxRow(*r)


def card_row(r: Sequence[Any]) -> Card:
    return Card(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5])


class Moved:
    """Whether an :func:`inbox_move` moved its row, read only when asked (``bool()``): a
    caller that does not ask lets the statement wait in PostgreSQL's pipeline for the
    next round trip instead of making one (agents/store/pg/trio_executor.py)."""

    __slots__ = ("_tx",)

    def __init__(self, tx: Tx) -> None:
        self._tx = tx

    def __bool__(self) -> bool:
        return self._tx.rowcount == 1


def inbox_move(tx: Tx, env: StoreEnv, inbox_id: str, event: InboxEvent, **sets: Any) -> Moved:
    """Move one inbox row by ``event`` if it is in one of the event's source statuses;
    whether it moved (truthy: ask before the next statement of ``tx``)."""
    tx.execute(*inbox_move_statement(env, inbox_id, event, **sets))
    return Moved(tx)


def inbox_move_statement(
    env: StoreEnv, inbox_id: str, event: InboxEvent, **sets: Any
) -> tuple[str, tuple[Any, ...]]:
    """The ``UPDATE`` of :func:`inbox_move` and its parameters (not run)."""
    sources = inbox_sources(event)
    target = inbox_transition(sources[0], event).target
    cols = {"status": str(target), "updated_at": env.clock.now(), **sets}
    assignments = ", ".join(f"{c} = ?" for c in cols)
    return (
        f"UPDATE agent_inbox SET {assignments} WHERE inbox_id = ? "
        f"AND status IN ({marks(len(sources))})",
        (*cols.values(), inbox_id, *sources),
    )


def edge(
    tx: Tx,
    env: StoreEnv,
    agent_id: str,
    turn_id: str | None,
    primitive: str,
    phase: str,
    *,
    correlation_id: str | None = None,
    inbox_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> None:
    tx.execute(
        "INSERT INTO execution_edges (agent_id, agent_turn_id, primitive, edge_phase, "
        "correlation_id, inbox_id, created_at, metadata) VALUES (?,?,?,?,?,?,?,?)",
        (
            agent_id,
            turn_id,
            primitive,
            phase,
            correlation_id,
            inbox_id,
            env.clock.now(),
            json.dumps(metadata or {}),
        ),
    )


def tokens_of(env: StoreEnv, agent_id: str, card: NewCard) -> int:
    """A card's estimated cost as the model is shown it (pure: no database)."""
    if card.card_type in UNSHOWN:
        return 0
    cap = env.tool_result_caps.get(agent_id) if card.card_type == CardType.TOOL_RESULT else None
    return card_tokens(card.content, cap)


def insert_cards(
    tx: Tx,
    env: StoreEnv,
    box_id: str,
    turn_id: str,
    cards: Sequence[tuple[NewCard, int]],
) -> list[str]:
    """Insert ``(card, tokens)`` pairs into ``box_id`` in one statement; their ids.

    The head's running token count is the caller's to move (in its compare-and-set)."""
    if not cards:
        return []
    now = env.clock.now()
    ids = [new_id() for _ in cards]
    insert_rows(
        tx,
        "INSERT INTO cards (card_id, box_id, agent_turn_id, card_type, content, metadata, "
        "created_at, tokens)",
        [
            (
                card_id,
                box_id,
                turn_id,
                card.card_type,
                card.content,
                json.dumps(dict(card.metadata)),
                now,
                tokens,
            )
            for card_id, (card, tokens) in zip(ids, cards, strict=True)
        ],
    )
    return ids


def copy_cards(
    tx: Tx, box_id: str, turn_id: str | None, card_ids: Sequence[str]
) -> tuple[int, int]:
    """Copy cards (new ids, same content, in the order given) into ``box_id``; with
    ``turn_id`` None a copy keeps its card's Turn. Returns (count, their tokens)."""
    if not card_ids:
        return 0, 0
    rows = tx.all(
        "SELECT card_id, agent_turn_id, card_type, content, metadata, created_at, tokens "
        f"FROM cards WHERE card_id IN ({marks(len(card_ids))})",
        tuple(card_ids),
    )
    by_id = {r[0]: r for r in rows}
    found = [by_id[c] for c in card_ids if c in by_id]
    return insert_copies(tx, box_id, turn_id, found)


def insert_copies(
    tx: Tx, box_id: str, turn_id: str | None, rows: Sequence[Sequence[Any]]
) -> tuple[int, int]:
    if not rows:
        return 0, 0
    insert_rows(
        tx,
        "INSERT INTO cards (card_id, box_id, agent_turn_id, card_type, content, metadata, "
        "created_at, tokens)",
        [(new_id(), box_id, turn_id or r[1], r[2], r[3], r[4], r[5], r[6]) for r in rows],
    )
    return len(rows), sum(int(r[6]) for r in rows)


def cards(tx: Tx, box_id: str) -> list[Card]:
    rows = tx.all(f"SELECT {CARD_COLS} FROM cards WHERE box_id = ? ORDER BY seq", (box_id,))
    return [card_row(r) for r in rows]


def card(tx: Tx, card_id: str) -> Card | None:
    r = tx.one(f"SELECT {CARD_COLS} FROM cards WHERE card_id = ?", (card_id,))
    return card_row(r) if r else None


def rename_call_card(tx: Tx, turn_id: str, old: str, new: str) -> None:
    """The tool.call card of Turn ``turn_id`` that names call ``old`` names ``new`` now."""
    rows = tx.all(
        "SELECT card_id, metadata FROM cards WHERE agent_turn_id = ? AND card_type = ?",
        (turn_id, CardType.TOOL_CALL),
    )
    for card_id, metadata in rows:
        meta: dict[str, Any] = json.loads(metadata)
        if meta.get("tool_call_id") == old:
            meta["tool_call_id"] = new
            tx.execute(
                "UPDATE cards SET metadata = ? WHERE card_id = ?", (json.dumps(meta), card_id)
            )
