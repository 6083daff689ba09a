"""A conversation's memory by reference (issue 38: cut what is written twice).

A new Turn of a conversation continues from the boxes its last Turn left. It used to copy
their cards into its context box, so every Turn wrote the whole memory again (3/4 of the
store's bytes per Turn). Now its context box *names* those boxes (``memory_of``: the
earlier context box, ``memory_out``: the earlier output box, always of one Turn or one
compaction or fork) and holds only its own cards (the task). What the model is shown is
resolved when read, by one recursive statement (the same text on both engines):

    cards(ctx) = cards(ctx.memory_of) + cards(ctx.memory_out) but its deliverables
                 + ctx's own cards

The chain ends at a box with no memory: a conversation's first Turn, a compaction (its
boxes hold the summary and copies of the kept cards) or a fork (copies).

Retention deletes Turns whole: before a Turn's boxes go, every box still naming one of
them gets its memory *materialized* (:func:`materialize`): the cards it resolved to are
copied, once, into a ``memory`` box of its own Turn, which it names instead. So pruning
never leaves a Turn's record, replay or fork with a partial context, and the copies are
written only for the oldest Turn kept of a chain, off the Turn's hot path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from agentserver.agents.store.base import Card, CardType
from agentserver.agents.store.sql.common import card as card_by_id
from agentserver.agents.store.sql.common import card_row, insert_copies
from agentserver.agents.store.sql.db import StoreEnv, Tx, insert_rows, marks, new_id

#: Schema migration 14: the context box's memory, and the index a prune looks up the
#: boxes naming a Turn's boxes by (partial: only context boxes with a memory pay it).
MIGRATION = """
ALTER TABLE boxes ADD COLUMN memory_of TEXT;
ALTER TABLE boxes ADD COLUMN memory_out TEXT;
CREATE INDEX boxes_memory ON boxes (memory_of) WHERE memory_of IS NOT NULL;
"""

#: A resolved row: the card (``CARD_COLS``), its ``seq``, its place in the chain
#: (``part``: the deepest memory first, ≤ 0 the context, 1 the output box), its Turn and
#: its tokens (for copies).
_COLS = ("card_id", "box_id", "card_type", "content", "metadata", "created_at", "seq")
_OWN = ", ".join(_COLS)
_LINKED = ", ".join(f"c.{c}" for c in _COLS)
SEQ, PART, TURN, TOKENS = 6, 7, 8, 9


def _chain(ctx: str) -> str:
    """The chain of context box ``ctx`` (an SQL expression): one row per memory level,
    (its context box, its output box, depth from 1)."""
    return (
        "WITH RECURSIVE chain(ctx, out, depth) AS ("
        f"SELECT memory_of, memory_out, 1 FROM boxes WHERE box_id = {ctx} "
        "UNION ALL SELECT b.memory_of, b.memory_out, chain.depth + 1 FROM chain "
        "JOIN boxes b ON b.box_id = chain.ctx) "
    )


@functools.cache
def resolve_sql(ctx: str = "?", out: str | None = "?") -> str:
    """The statement of a Turn's cards: context box ``ctx`` resolved, then (unless None)
    output box ``out``; both SQL expressions (fixed fragments of ours: the text is built
    once per shape, every step reads through it). Parameters: :func:`resolve_params`."""
    sql = (
        _chain(ctx) + f"SELECT {_OWN}, 0, agent_turn_id, tokens FROM cards WHERE box_id = {ctx} "
        f"UNION ALL SELECT {_LINKED}, -2 * chain.depth, c.agent_turn_id, c.tokens "
        "FROM chain JOIN cards c ON c.box_id = chain.ctx WHERE c.card_type != ? "
        f"UNION ALL SELECT {_LINKED}, 1 - 2 * chain.depth, c.agent_turn_id, c.tokens "
        "FROM chain JOIN cards c ON c.box_id = chain.out WHERE c.card_type != ?"
    )
    if out is not None:
        sql += f" UNION ALL SELECT {_OWN}, 1, agent_turn_id, tokens FROM cards WHERE box_id = {out}"
    return sql


def resolve_params(ctx: Sequence[Any], out: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """The parameters of :func:`resolve_sql`: those of each expression, in order."""
    deliverable = str(CardType.DELIVERABLE)
    return (*ctx, *ctx, deliverable, deliverable, *(out or ()))


def ordered(rows: list[Any]) -> list[Any]:
    """Resolved rows in the order the model is shown them."""
    return sorted(rows, key=lambda r: (r[PART], r[SEQ]))


def split(rows: list[Any]) -> tuple[tuple[Card, ...], tuple[Card, ...]]:
    """Resolved rows as (context cards, output cards), each in order."""
    rows = ordered(rows)
    return (
        tuple(card_row(r) for r in rows if r[PART] <= 0),
        tuple(card_row(r) for r in rows if r[PART] == 1),
    )


def turn_cards(
    tx: Tx, context_box: str | None, output_box: str | None
) -> tuple[tuple[Card, ...], tuple[Card, ...]]:
    """The cards of a Turn's context box (its memory resolved) and output box (one
    statement)."""
    if not context_box and not output_box:
        return (), ()
    return split(tx.all(resolve_sql(), resolve_params((context_box,), (output_box,))))


def box_rows(tx: Tx, box_id: str) -> list[Any]:
    """The resolved rows of one box (a context box's memory first), in order."""
    return ordered(tx.all(resolve_sql(out=None), resolve_params((box_id,))))


def box_cards(tx: Tx, box_id: str) -> list[Card]:
    return [card_row(r) for r in box_rows(tx, box_id)]


def cards(tx: Tx, env: StoreEnv, box_id: str) -> list[Card]:
    """A box's cards in order; a context box's memory first (it names its conversation's
    cards, not copies)."""
    return box_cards(tx, box_id)


def card(tx: Tx, env: StoreEnv, card_id: str) -> Card | None:
    """One card by its id (None if there is none)."""
    return card_by_id(tx, card_id)


def copy_row(r: Sequence[Any]) -> tuple[Any, ...]:
    """A resolved row as a row of ``common.insert_copies``."""
    return (r[0], r[TURN], r[2], r[3], r[4], r[5], r[TOKENS])


#: A conversation's boxes and the tokens of the cards a new Turn continues from (its
#: memory: both boxes resolved, no deliverable). Parameters: agent, conversation, then
#: ``CardType.DELIVERABLE`` twice.
CONVERSATION_MEMORY = (
    "WITH RECURSIVE conv(ctx, out) AS (SELECT context_box_id, output_box_id FROM "
    "conversations WHERE agent_id = ? AND conversation = ?), "
    "chain(ctx, out) AS (SELECT ctx, out FROM conv UNION ALL "
    "SELECT b.memory_of, b.memory_out FROM chain JOIN boxes b ON b.box_id = chain.ctx) "
    "SELECT conv.ctx, conv.out, "
    "(SELECT coalesce(sum(c.tokens), 0) FROM chain JOIN cards c ON c.box_id = chain.ctx "
    "WHERE c.card_type != ?) + "
    "(SELECT coalesce(sum(c.tokens), 0) FROM chain JOIN cards c ON c.box_id = chain.out "
    "WHERE c.card_type != ?) FROM conv"
)


def conversation_memory(tx: Tx, agent_id: str, conversation: str) -> tuple[str, str, int] | None:
    """(context box, output box, their tokens) a new Turn of ``conversation`` names as its
    memory; None for a new conversation. One statement."""
    deliverable = str(CardType.DELIVERABLE)
    row = tx.one(CONVERSATION_MEMORY, (agent_id, conversation, deliverable, deliverable))
    return (row[0], row[1], int(row[2])) if row else None


def memory_prefix(tx: Tx, box_id: str) -> list[Any]:
    """The resolved rows of the memory box ``box_id`` names (not its own cards)."""
    return [r for r in box_rows(tx, box_id) if r[PART] < 0]


def turn_memory(tx: Tx, turn: str) -> list[Any]:
    """The memory a Turn's context box named at its lease (resolved rows, in order): the
    start of its record, as the copies its context box held before."""
    row = tx.one(
        "SELECT box_id FROM boxes WHERE agent_turn_id = ? AND memory_of IS NOT NULL "
        "ORDER BY created_at LIMIT 1",
        (turn,),
    )
    return memory_prefix(tx, row[0]) if row else []


def materialize(tx: Tx, env: StoreEnv, box_id: str) -> int:
    """Copy the memory box ``box_id`` names into a ``memory`` box of its own Turn and name
    that one instead (before the boxes it named are pruned). Returns the cards copied."""
    found = tx.one("SELECT agent_id, agent_turn_id FROM boxes WHERE box_id = ?", (box_id,))
    if found is None:
        return 0
    rows = memory_prefix(tx, box_id)
    memory = new_id()
    insert_rows(
        tx,
        "INSERT INTO boxes (box_id, agent_id, agent_turn_id, kind, created_at)",
        [(memory, found[0], found[1], "memory", env.clock.now())],
    )
    # The copies keep their cards' Turns: the record of the Turn that names them reads
    # its memory through the chain, not by Turn (no card is counted twice).
    insert_copies(tx, memory, None, [copy_row(r) for r in rows])
    tx.execute(
        "UPDATE boxes SET memory_of = ?, memory_out = NULL WHERE box_id = ?", (memory, box_id)
    )
    return len(rows)


def release(tx: Tx, env: StoreEnv, box_ids: Sequence[str], turn: str | None) -> int:
    """Before ``box_ids`` are deleted: materialize every box of another Turn (not
    ``turn``) naming one of them. Returns the cards copied."""
    if not box_ids:
        return 0
    params: list[Any] = list(box_ids)
    sql = f"SELECT box_id FROM boxes WHERE memory_of IN ({marks(len(box_ids))})"
    if turn is not None:
        sql += " AND agent_turn_id != ?"
        params.append(turn)
    return sum(materialize(tx, env, r[0]) for r in tx.all(sql, params))
