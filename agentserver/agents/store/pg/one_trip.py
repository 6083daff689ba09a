"""The hot store calls on PostgreSQL in one round trip: their statements rewritten so no
statement needs an earlier one's answer in Python (the one place the PostgreSQL store's
SQL differs from the shared ``agents/sql``, which SQLite runs unchanged).

Each function here does what its namesake in ``agents/sql`` does, with the same
statements where it can, and these changes:

- A compare-and-set on the head (:func:`~agentserver.agents.store.sql.head.cas`) or a checked
  inbox move is wrapped in ``agentserver_expect`` (a function the store's migration
  creates, ``agents/store/pg/schema.py``): a miss raises an error in the server, which aborts
  the transaction there, so the statements queued after it never run and ``COMMIT``
  does not happen. The store then runs the shared function in a new transaction
  (:class:`Missed`), which meets the miss as before (raises ``StaleTurn``, takes the
  step-limit path, …): what a miss does is the shared code's, by construction.
- A value the shared function passes from the compare-and-set's ``RETURNING`` to a later
  statement (the output box, the step number) is read by that statement from the head it
  just updated (a scalar subquery: the row is locked by this transaction, and a later
  statement sees its writes).
- What the function returns from those reads comes back with the last round trip
  (:meth:`~.pipe.PgPipeTx.later`), and its last statement carries ``COMMIT``
  (:meth:`~.pipe.PgPipeTx.last`).

Atomic: each call is one transaction, as its namesake's; a miss rolls all of it back
before the shared function runs. Cancel: as any store call (the executor's). Bounded:
the statements of one call, in one round trip (``finish`` two: the next queued Turn's
task must be read before its lease is written, and a lease three).

The calls are in :mod:`.one_trip_turn` (a Turn's steps and tool waits) and
:mod:`.one_trip_ends` (a Turn's enqueue, its tool reports, its finish); this module
holds what they share. Each takes the store's ``NOTIFY`` channel (None: none) after
``env``, since the notification must go out before ``COMMIT``, and is named as its
namesake (the benches count per function name). ``PostgresAgentStore`` maps the shared
functions to them (``agents/store/pg/store.py``, ``ONE_TRIP``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import psycopg

from agentserver.agents.store.base import (
    NewCard,
    TurnToken,
)
from agentserver.agents.store.pg.executor import Later
from agentserver.agents.store.pg.notify import notify
from agentserver.agents.store.pg.schema import EXPECT_FAILED
from agentserver.agents.store.sql import head
from agentserver.agents.store.sql.common import (
    inbox_move_statement,
)
from agentserver.agents.store.sql.db import INSERT_CHUNK, Row, SqlValue, StoreEnv, new_id
from agentserver.agents.store.sql.turns import with_tokens
from agentserver.agents.store.states import (
    HeadEvent,
    HeadStatus,
    InboxEvent,
    head_event,
)

T = TypeVar("T")


class PipeTx(Protocol):
    """What these functions need of a transaction: the store's Tx, plus reads that wait
    in the pipeline (:class:`~.pipe.PgPipeTx`; the thread executor's
    :class:`~.executor.PgTx` runs them at once)."""

    dialect: str
    rowcount: int

    def execute(self, sql: str, params: Sequence[SqlValue] = ()) -> Any: ...
    def executemany(self, sql: str, rows: Iterable[Sequence[SqlValue]]) -> None: ...
    def one(self, sql: str, params: Sequence[SqlValue] = ()) -> Row | None: ...
    def all(self, sql: str, params: Sequence[SqlValue] = ()) -> list[Row]: ...
    def later(self, sql: str, params: Sequence[SqlValue] = ()) -> Later: ...
    def last(self, sql: str, params: Sequence[SqlValue] = ()) -> list[Row]: ...
    def end(self) -> None: ...


class Missed(Exception):
    """An ``agentserver_expect`` failed: the call's transaction was rolled back, and the
    store runs the shared function instead."""


def one_trip(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn``, committed before it returns (so an expectation's error, raised by the
    round trip that carries ``COMMIT``, is raised inside it), with that error raised as
    :class:`Missed`."""

    @functools.wraps(fn)
    def run(tx: PipeTx, *args: Any) -> T:
        try:
            result = fn(tx, *args)
            tx.end()  # (the COMMIT, if no last statement carried it: its errors here)
            return result
        except psycopg.Error as exc:
            if exc.sqlstate == EXPECT_FAILED:
                raise Missed(str(exc)) from None
            raise

    return run


# -- the checks -----------------------------------------------------------------------


def fence(
    tx: PipeTx, env: StoreEnv, token: TurnToken, how: HeadEvent | HeadStatus, **kw: Any
) -> Later:
    """The compare-and-set of :func:`head.fence`, expected to hit; the head as updated
    (one row) once the round trip is back."""
    sql, params = head.cas_statement(
        env, token.agent_id, token.agent_turn_id, token.turn_epoch, how, **kw
    )
    return tx.later(
        f"WITH h AS ({sql}) SELECT h.* FROM (SELECT agentserver_expect("
        "(SELECT count(*) FROM h) = 1, ?) AS ok) e LEFT JOIN h ON e.ok",
        (*params, f"{token}: head not {how}"),
    )


def cas_expected(
    tx: PipeTx, env: StoreEnv, agent_id: str, how: HeadEvent, given: Mapping[str, Any]
) -> None:
    """:func:`head.cas` of a head whatever its Turn (a lease, its effects' values
    ``given``), expected to hit."""
    sql, params = head.cas_statement(env, agent_id, None, None, how, given=given)
    tx.execute(
        f"WITH h AS ({sql}) SELECT agentserver_expect((SELECT count(*) FROM h) = 1, ?)",
        (*params, f"{agent_id}: head not {how}"),
    )


def bump(event: HeadEvent) -> int:
    """What ``event`` adds to the head's epoch."""
    return 1 if head_event(event).bumps_epoch else 0


def move(tx: PipeTx, env: StoreEnv, inbox_id: str, event: InboxEvent, **sets: Any) -> None:
    """:func:`~agentserver.agents.store.sql.common.inbox_move`, expected to move its row."""
    sql, params = inbox_move_statement(env, inbox_id, event, **sets)
    tx.execute(
        f"WITH u AS ({sql} RETURNING 1) SELECT agentserver_expect((SELECT count(*) FROM u) = 1, ?)",
        (*params, f"inbox {inbox_id} did not move by {event}"),
    )


def head_of(column: str) -> str:
    """A scalar subquery: ``column`` of the head whose agent is the next parameter."""
    return f"(SELECT {column} FROM agent_state_head WHERE agent_id = ?)"


def cards_into_output(
    tx: PipeTx,
    env: StoreEnv,
    token: TurnToken,
    cards: Sequence[tuple[NewCard, int]],
) -> list[str]:
    """:func:`~agentserver.agents.store.sql.common.insert_cards` into the head's output box
    (read by the statement); their ids."""
    if not cards:
        return []
    now = env.clock.now()
    ids = [new_id() for _ in cards]
    rows = [
        (
            card_id,
            token.agent_id,
            token.agent_turn_id,
            card.card_type,
            card.content,
            json.dumps(dict(card.metadata)),
            now,
            tokens,
        )
        for card_id, (card, tokens) in zip(ids, cards, strict=True)
    ]
    one = f"(?,{head_of('output_box_id')},?,?,?,?,?,?)"
    for i in range(0, len(rows), INSERT_CHUNK):
        part = rows[i : i + INSERT_CHUNK]
        tx.execute(
            "INSERT INTO cards (card_id, box_id, agent_turn_id, card_type, content, "
            f"metadata, created_at, tokens) VALUES {','.join([one] * len(part))}",
            [v for r in part for v in r],
        )
    return ids


def tokens_exprs(delta: int) -> dict[str, Any]:
    """The compare-and-set's keywords that add ``delta`` context tokens (none if 0)."""
    if not delta:
        return {}
    return {"exprs": {"context_tokens": "context_tokens + ?"}, "expr_params": (delta,)}


def append_cards(
    tx: PipeTx,
    env: StoreEnv,
    token: TurnToken,
    cards: Sequence[NewCard],
    how: HeadEvent | HeadStatus = HeadStatus.RUNNING,
    given: Mapping[str, Any] | None = None,
) -> list[str]:
    """:func:`~agentserver.agents.store.sql.turns.append_cards` without a round trip: the
    compare-and-set (expected to hit, with an output box: the shared function raises
    StaleTurn after a hit without one) and the cards; their ids."""
    priced = with_tokens(env, token.agent_id, cards)
    fence(
        tx,
        env,
        token,
        how,
        given=given,
        where=" AND output_box_id IS NOT NULL",
        **tokens_exprs(sum(t for _, t in priced)),
    )
    return cards_into_output(tx, env, token, priced)


# -- the calls ------------------------------------------------------------------------


def closing(tx: PipeTx, channel: str | None, outcome: T) -> T:
    """The ``NOTIFY`` (if any) queued before the ``COMMIT`` that carries the deferred
    writes; ``outcome``."""
    if channel is not None:
        notify(tx, channel)
    return outcome
