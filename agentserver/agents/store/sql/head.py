"""The agent head: the one compare-and-set every head update goes through, and the lease.

:func:`cas` is a single ``UPDATE … WHERE <expected> RETURNING <head>``: the expected
statuses and the target come from the transition tables (``agents/store/states.py``), so no
read precedes it, and the head it returns is passed down instead of read again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentserver.agents.errors import StaleTurn
from agentserver.agents.store.base import CardType, Head, NewCard, TurnToken
from agentserver.agents.store.sql import fair, memory
from agentserver.agents.store.sql.common import (
    HEAD_COLS,
    edge,
    inbox_move,
    insert_cards,
    tokens_of,
)
from agentserver.agents.store.sql.db import (
    Row,
    SqlValue,
    StoreEnv,
    Tx,
    insert_rows,
    locking,
    marks,
    new_id,
)
from agentserver.agents.store.states import (
    HeadEvent,
    HeadStatus,
    InboxEvent,
    InboxStatus,
    head_effects,
    head_event,
    head_sources,
)


def cas(
    tx: Tx,
    env: StoreEnv,
    agent_id: str,
    turn_id: str | None,
    epoch: int | None,
    how: HeadEvent | HeadStatus,
    *,
    sets: Mapping[str, SqlValue] | None = None,
    given: Mapping[str, SqlValue] | None = None,
    exprs: Mapping[str, str] | None = None,
    expr_params: Sequence[SqlValue] = (),
    where: str = "",
    where_params: Sequence[SqlValue] = (),
    stale: str = "",
) -> Head:
    """Compare-and-set the head of ``agent_id``; returns the head as updated.

    ``how``: a :class:`HeadEvent` (the status moves to its target, the epoch bumps if the
    transition says so, and the columns of its :data:`~.states.HEAD_EFFECTS` are set,
    with the values ``given`` by keyword; ``now`` defaults to this compare-and-set's
    clock reading) or a :class:`HeadStatus` (a fence: the head must be in it and stays).
    The head must hold ``turn_id`` at ``epoch`` (None: not checked, as for the
    lease of an idle head). ``sets`` are more ``column = value``; ``exprs`` and ``where`` are
    fixed SQL fragments (``column = expr``, whose ``?`` take ``expr_params``; `` AND …``,
    whose ``?`` take ``where_params``).
    Raises StaleTurn on a miss, and then nothing was written.
    """
    sql, params = cas_statement(
        env,
        agent_id,
        turn_id,
        epoch,
        how,
        sets=sets,
        given=given,
        exprs=exprs,
        expr_params=expr_params,
        where=where,
        where_params=where_params,
    )
    row = tx.one(sql, params)
    if row is None:
        raise StaleTurn(f"{agent_id}/{turn_id}@{epoch}: {stale or f'head not {how}'}")
    return Head(*row)


def cas_statement(
    env: StoreEnv,
    agent_id: str,
    turn_id: str | None,
    epoch: int | None,
    how: HeadEvent | HeadStatus,
    *,
    sets: Mapping[str, SqlValue] | None = None,
    given: Mapping[str, SqlValue] | None = None,
    exprs: Mapping[str, str] | None = None,
    expr_params: Sequence[SqlValue] = (),
    where: str = "",
    where_params: Sequence[SqlValue] = (),
) -> tuple[str, tuple[SqlValue, ...]]:
    """The ``UPDATE … RETURNING <head>`` of :func:`cas` and its parameters (not run)."""
    now = env.clock.now()
    cols: dict[str, SqlValue] = {}
    bump = False
    if isinstance(how, HeadEvent):
        t = head_event(how)
        sources: tuple[str, ...] = head_sources(how)
        cols["status"] = str(t.target)
        bump = t.bumps_epoch
        cols.update(head_effects(how, {"now": now, **(given or {})}))
    else:
        sources = (str(how),)
    cols.update(sets or {})
    cols["updated_at"] = now
    params: list[SqlValue] = [*cols.values(), *expr_params, agent_id]
    if turn_id is not None:
        params.append(turn_id)
    if epoch is not None:
        params.append(epoch)
    sql = _cas_sql(
        tuple(cols),
        bump,
        tuple((exprs or {}).items()),
        turn_id is not None,
        epoch is not None,
        len(sources),
        where,
    )
    return sql, (*params, *sources, *where_params)


@functools.cache
def _cas_sql(
    cols: tuple[str, ...],
    bump: bool,
    exprs: tuple[tuple[str, str], ...],
    by_turn: bool,
    by_epoch: bool,
    n_sources: int,
    where: str,
) -> str:
    """The text of one shape of compare-and-set (built once per shape)."""
    assignments = [f"{c} = ?" for c in cols]
    if bump:
        assignments.append("turn_epoch = turn_epoch + 1")
    assignments += [f"{c} = {e}" for c, e in exprs]
    cond = "agent_id = ?"
    if by_turn:
        cond += " AND active_agent_turn_id = ?"
    if by_epoch:
        cond += " AND turn_epoch = ?"
    return (
        f"UPDATE agent_state_head SET {', '.join(assignments)} WHERE {cond} "
        f"AND status IN ({marks(n_sources)}){where} RETURNING {HEAD_COLS}"
    )


def fence(
    tx: Tx,
    env: StoreEnv,
    token: TurnToken,
    how: HeadEvent | HeadStatus = HeadStatus.RUNNING,
    **kw: Any,
) -> Head:
    """:func:`cas` keyed by a Turn's token (every worker write)."""
    return cas(tx, env, token.agent_id, token.agent_turn_id, token.turn_epoch, how, **kw)


def idle_head(env: StoreEnv, agent_id: str) -> Head:
    return Head(
        agent_id, HeadStatus.IDLE, None, 0, None, None, None, 0, 0, None, None, None,
        env.clock.now(), 0,
    )  # fmt: skip


def read(tx: Tx, env: StoreEnv, agent_id: str) -> Head:
    row = tx.one(f"SELECT {HEAD_COLS} FROM agent_state_head WHERE agent_id = ?", (agent_id,))
    return Head(*row) if row else idle_head(env, agent_id)


def ensure(tx: Tx, env: StoreEnv, agent_id: str) -> None:
    tx.execute(
        "INSERT INTO agent_state_head (agent_id, status, updated_at) VALUES (?, ?, ?) "
        "ON CONFLICT (agent_id) DO NOTHING",
        (agent_id, HeadStatus.IDLE, env.clock.now()),
    )


def lease_next(tx: Tx, env: StoreEnv, agent_id: str) -> bool:
    """L0 dispatch_next: lease the oldest queued Turn if the agent is idle.

    Everything is read before the compare-and-set, so a busy head writes nothing (with
    fair share, the tags it moves are rolled back with the lease that is not taken)."""
    row = next_queued(tx, env, agent_id)
    return lease_row(tx, env, agent_id, row) if row is not None else False


def next_queued(tx: Tx, env: StoreEnv, agent_id: str) -> Row | None:
    """The queued Turn to lease next: the oldest, or with ``<store fair-share>`` the fair
    one (agents/store/sql/fair.py)."""
    if env.settings.fair_weights is not None:
        return fair.next_queued(tx, env, agent_id)
    # Locked (PostgreSQL): a double text of another process may supersede this row between
    # this read and the lease's move of it (docs/runs.md); unlocked, the head would run a
    # task already answered "superseded" (its move then matched no row). The lock waits
    # for that transaction, and a row it took out of the queue is passed over for the next.
    return tx.one(QUEUED_NEXT + locking(tx), (agent_id, InboxStatus.QUEUED))


#: The oldest queued Turn of an agent (parameters: the agent, ``InboxStatus.QUEUED``).
QUEUED_NEXT = (
    "SELECT inbox_id, payload, conversation FROM agent_inbox WHERE agent_id = ? "
    "AND status = ? ORDER BY created_at, seq LIMIT 1"
)


def lease_row(tx: Tx, env: StoreEnv, agent_id: str, row: Row) -> bool:
    """:func:`lease_next` for the queued ``row`` it read (a row of :data:`QUEUED_NEXT`)."""

    def take(given: Mapping[str, SqlValue]) -> int | None:
        try:
            return cas(tx, env, agent_id, None, None, HeadEvent.LEASE, given=given).turn_epoch
        except StaleTurn:
            return None  # busy: the row stays queued for the Turn's end

    return lease_with(tx, env, agent_id, row, take)


def lease_with(
    tx: Tx,
    env: StoreEnv,
    agent_id: str,
    row: Row,
    take: Callable[[Mapping[str, SqlValue]], int | None],
) -> bool:
    """:func:`lease_row` with ``take`` for its compare-and-set: given the values of the
    lease's effects (:func:`lease_given`), it moves the head (:data:`HeadEvent.LEASE`)
    and returns the new epoch, or None if the head is busy (then nothing is written)."""
    inbox_id, payload, conversation = row
    # The conversation's memory is named, not copied (agents/store/sql/memory.py).
    earlier = memory.conversation_memory(tx, agent_id, conversation) if conversation else None
    memory_of, memory_out, earlier_tokens = earlier or (None, None, 0)
    task = NewCard(CardType.TASK_INPUT, bytes(payload).decode("utf-8", "replace"))
    task_tokens = tokens_of(env, agent_id, task)
    now = env.clock.now()
    turn_id, context_box, output_box = new_id(), new_id(), new_id()
    tokens = earlier_tokens + task_tokens
    epoch = take(lease_given(turn_id, inbox_id, context_box, output_box, now, tokens))
    if epoch is None:
        return False
    insert_rows(
        tx,
        "INSERT INTO boxes (box_id, agent_id, agent_turn_id, kind, created_at, memory_of, "
        "memory_out)",
        [
            (context_box, agent_id, turn_id, "context", now, memory_of, memory_out),
            (output_box, agent_id, turn_id, "output", now, None, None),
        ],
    )
    insert_cards(tx, env, context_box, turn_id, [(task, task_tokens)])
    inbox_move(
        tx,
        env,
        inbox_id,
        InboxEvent.DISPATCH,
        agent_turn_id=turn_id,
        turn_epoch=epoch,
        next_retry_at=now,
    )
    edge(tx, env, agent_id, turn_id, "lease", "request", inbox_id=inbox_id)
    return True


def lease_given(
    turn_id: str, inbox_id: str, context_box: str, output_box: str, now: float, tokens: int
) -> dict[str, SqlValue]:
    """The values a lease's effects take (:data:`~.states.HEAD_EFFECTS`): the new Turn
    ``turn_id`` of the queued row ``inbox_id``, its boxes, ``tokens`` in its context."""
    return {
        "turn": turn_id,
        "inbox": inbox_id,
        "context_box": context_box,
        "output_box": output_box,
        "now": now,
        "tokens": tokens,
    }
