"""The hot store calls on PostgreSQL in one round trip: their statements rewritten so no
statement needs an earlier one's answer in Python (the one place the PostgreSQL store's
SQL differs from the shared ``agents/sql``, which SQLite runs unchanged).

Each function here does what its namesake in ``agents/sql`` does, with the same
statements where it can, and these changes:

- A compare-and-set on the head (:func:`~agentserver.agents.sql.head.cas`) or a checked
  inbox move is wrapped in ``agentserver_expect`` (a function the store's migration
  creates, ``agents/pg/schema.py``): a miss raises an error in the server, which aborts
  the transaction there, so the statements queued after it never run and ``COMMIT``
  does not happen. The store then runs the shared function in a new transaction
  (:class:`Missed`), which meets the miss as before (raises ``StaleTurn``, takes the
  step-limit path, …): what a miss does is the shared code's, by construction.
- A value the shared function passes from the compare-and-set's ``RETURNING`` to a later
  statement (the output box, the step number) is read by that statement from the head it
  just updated (a scalar subquery: the row is locked by this transaction, and a later
  statement sees its writes).
- What the function returns from those reads comes back with the last round trip
  (:meth:`~.trio_executor.PgPipeTx.later`), and its last statement carries ``COMMIT``
  (:meth:`~.trio_executor.PgPipeTx.last`).

Atomic: each call is one transaction, as its namesake's; a miss rolls all of it back
before the shared function runs. Cancel: as any store call (the executor's). Bounded:
the statements of one call, in one round trip (``finish`` two: the next queued Turn's
task must be read before its lease is written, and a lease three).

Each function takes the store's ``NOTIFY`` channel (None: none) after ``env``, since the
notification must go out before the last statement, and is named as its namesake (the
benches count per function name).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import psycopg

from agentserver.agents.errors import StaleTurn
from agentserver.agents.governance_store import StepRecord
from agentserver.agents.pg.executor import Later
from agentserver.agents.pg.notify import notify
from agentserver.agents.pg.schema import EXPECT_FAILED
from agentserver.agents.sql import governance, head, inbox, tools, turn_end, turns
from agentserver.agents.sql.common import (
    CARD_COLS,
    HEAD_COLS,
    edge,
    inbox_move_statement,
    insert_cards,
    split_turn_cards,
    tokens_of,
)
from agentserver.agents.sql.db import INSERT_CHUNK, StoreEnv, marks, new_id
from agentserver.agents.sql.turns import close_step, with_tokens
from agentserver.agents.states import (
    AfterExecution,
    AgentStepStatus,
    HeadEvent,
    HeadStatus,
    InboxEvent,
    InboxStatus,
    MessageType,
    ReplyStatus,
    WaitingStatus,
    head_event,
    head_sources,
    inbox_sources,
    inbox_transition,
)
from agentserver.agents.store import (
    CardType,
    EnqueueResult,
    Finished,
    Head,
    InboxRow,
    NewCard,
    PendingReply,
    ReportOutcome,
    StepStart,
    TaskStatus,
    ToolCallRecord,
    TurnToken,
)

T = TypeVar("T")


class PipeTx(Protocol):
    """What these functions need of a transaction: the store's Tx, plus reads that wait
    in the pipeline (:class:`~.trio_executor.PgPipeTx`; the thread executor's
    :class:`~.executor.PgTx` runs them at once)."""

    dialect: str
    rowcount: int

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any: ...
    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...
    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None: ...
    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...
    def later(self, sql: str, params: Sequence[Any] = ()) -> Later: ...
    def last(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...
    def end(self) -> None: ...


class Missed(Exception):
    """An ``agentserver_expect`` failed: the call's transaction was rolled back, and the
    store runs the shared function instead."""


def _one_trip(fn: Callable[..., T]) -> Callable[..., T]:
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


def _fence(
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


def _cas_expected(
    tx: PipeTx, env: StoreEnv, agent_id: str, how: HeadEvent, sets: Mapping[str, Any]
) -> None:
    """:func:`head.cas` of a head whatever its Turn (a lease), expected to hit."""
    sql, params = head.cas_statement(env, agent_id, None, None, how, sets=sets)
    tx.execute(
        f"WITH h AS ({sql}) SELECT agentserver_expect((SELECT count(*) FROM h) = 1, ?)",
        (*params, f"{agent_id}: head not {how}"),
    )


def _bump(event: HeadEvent) -> int:
    """What ``event`` adds to the head's epoch."""
    return 1 if head_event(event).bumps_epoch else 0


def _move(tx: PipeTx, env: StoreEnv, inbox_id: str, event: InboxEvent, **sets: Any) -> None:
    """:func:`~agentserver.agents.sql.common.inbox_move`, expected to move its row."""
    sql, params = inbox_move_statement(env, inbox_id, event, **sets)
    tx.execute(
        f"WITH u AS ({sql} RETURNING 1) SELECT agentserver_expect((SELECT count(*) FROM u) = 1, ?)",
        (*params, f"inbox {inbox_id} did not move by {event}"),
    )


def _head_of(column: str) -> str:
    """A scalar subquery: ``column`` of the head whose agent is the next parameter."""
    return f"(SELECT {column} FROM agent_state_head WHERE agent_id = ?)"


def _cards_into_output(
    tx: PipeTx,
    env: StoreEnv,
    token: TurnToken,
    cards: Sequence[tuple[NewCard, int]],
) -> list[str]:
    """:func:`~agentserver.agents.sql.common.insert_cards` into the head's output box
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
    one = f"(?,{_head_of('output_box_id')},?,?,?,?,?,?)"
    for i in range(0, len(rows), INSERT_CHUNK):
        part = rows[i : i + INSERT_CHUNK]
        tx.execute(
            "INSERT INTO cards (card_id, box_id, agent_turn_id, card_type, content, "
            f"metadata, created_at, tokens) VALUES {','.join([one] * len(part))}",
            [v for r in part for v in r],
        )
    return ids


def _tokens_exprs(delta: int) -> dict[str, Any]:
    """The compare-and-set's keywords that add ``delta`` context tokens (none if 0)."""
    if not delta:
        return {}
    return {"exprs": {"context_tokens": "context_tokens + ?"}, "expr_params": (delta,)}


def _append_cards(
    tx: PipeTx,
    env: StoreEnv,
    token: TurnToken,
    cards: Sequence[NewCard],
    how: HeadEvent | HeadStatus = HeadStatus.RUNNING,
    sets: Mapping[str, Any] | None = None,
) -> list[str]:
    """:func:`~agentserver.agents.sql.turns.append_cards` without a round trip: the
    compare-and-set (expected to hit, with an output box: the shared function raises
    StaleTurn after a hit without one) and the cards; their ids."""
    priced = with_tokens(env, token.agent_id, cards)
    _fence(
        tx,
        env,
        token,
        how,
        sets=sets,
        where=" AND output_box_id IS NOT NULL",
        **_tokens_exprs(sum(t for _, t in priced)),
    )
    return _cards_into_output(tx, env, token, priced)


# -- the calls ------------------------------------------------------------------------


@_one_trip
def complete_step(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    token: TurnToken,
    step_id: str,
    completion: Any,
    cards: Sequence[NewCard],
    swap: Any = None,
) -> None:
    """:func:`~agentserver.agents.sql.turns.complete_step` in one round trip (its
    ``COMMIT``'s); with a box swap, the shared function."""
    if swap is not None:
        raise Missed("a box swap")  # (nothing sent yet)
    _append_cards(tx, env, token, cards)
    close_step(tx, env, step_id, completion, AgentStepStatus.COMPLETED, ())
    _ending(tx, channel, None)


@_one_trip
def complete_screened_step(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    token: TurnToken,
    step_id: str,
    completion: Any,
    cards: Sequence[NewCard],
    screened: StepRecord,
) -> None:
    """:func:`~agentserver.agents.sql.governance.complete_screened_step` in one round
    trip (its ``COMMIT``'s; one more for a step without a completion whose decisions
    go into its metadata)."""
    _append_cards(tx, env, token, [*cards, *screened.cards])
    governance.close_screened_step(tx, env, token, step_id, completion, screened)
    _ending(tx, channel, None)


@_one_trip
def report_tool_result(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    agent_id: str,
    tool_call_id: str,
    payload: bytes,
    failed: bool,
) -> str:
    """:func:`~agentserver.agents.sql.inbox.report_tool_result` in one round trip: the
    waiting row's Turn (or its absence: the report is parked as deferred) is read by
    the ``INSERT``, and the edge takes the Turn from the row inserted."""
    now = env.clock.now()
    inbox_id = new_id()
    mtype = MessageType.TOOL_RESULT
    tx.execute(
        "INSERT INTO agent_inbox (inbox_id, agent_id, message_type, status, agent_turn_id, "
        "turn_epoch, correlation_id, payload, failed, next_retry_at, defer_reason, "
        "created_at, updated_at) SELECT ?, ?, ?, "
        "CASE WHEN w.tool_call_id IS NULL THEN ? ELSE ? END, w.agent_turn_id, "
        "w.turn_epoch, ?, ?, ?, "
        "CASE WHEN w.tool_call_id IS NULL THEN ? ELSE ? END, "
        "CASE WHEN w.tool_call_id IS NULL THEN ? END, ?, ? "
        "FROM (SELECT 1) AS one LEFT JOIN turn_waiting_tools w ON w.tool_call_id = ?",
        (
            inbox_id,
            agent_id,
            mtype,
            InboxStatus.DEFERRED,
            InboxStatus.PENDING,
            tool_call_id,
            payload,
            int(failed),
            now + env.settings.retry_base_s,
            now,
            "awaiting suspend",
            now,
            now,
            tool_call_id,
        ),
    )
    tx.execute(
        "INSERT INTO execution_edges (agent_id, agent_turn_id, primitive, edge_phase, "
        "correlation_id, inbox_id, created_at, metadata) VALUES "
        "(?,(SELECT agent_turn_id FROM agent_inbox WHERE inbox_id = ?),?,?,?,?,?,?)",
        (
            agent_id,
            inbox_id,
            "report",
            "response",
            tool_call_id,
            inbox_id,
            now,
            json.dumps({"message_type": str(mtype)}),
        ),
    )
    return _ending(tx, channel, inbox_id)


@_one_trip
def start_turn_step(
    tx: PipeTx, env: StoreEnv, channel: str | None, row: InboxRow, max_steps: int
) -> StepStart:
    """:func:`~agentserver.agents.sql.turns.start_turn_step` in one round trip."""
    token = row.token
    if token is None:
        raise Missed("no Turn")  # (nothing sent yet) the shared function says why
    h = _fence(
        tx,
        env,
        token,
        HeadEvent.START,
        sets={"running_since": env.clock.now()},
        exprs={"step_count": "step_count + 1"},
        where=turns.UNDER_LIMIT,
        where_params=(max_steps,),
    )
    _move(tx, env, row.inbox_id, InboxEvent.CONSUME)
    edge(tx, env, token.agent_id, token.agent_turn_id, "start", "request", inbox_id=row.inbox_id)
    step_id = new_id()
    tx.execute(
        "INSERT INTO agent_steps (step_id, agent_id, agent_turn_id, turn_epoch, step_no, "
        f"status, started_at) VALUES (?,?,?,?,{_head_of('step_count')},?,?)",
        (
            step_id,
            token.agent_id,
            token.agent_turn_id,
            token.turn_epoch,
            token.agent_id,
            AgentStepStatus.STARTED,
            env.clock.now(),
        ),
    )
    if channel is not None:
        notify(tx, channel)
    rows = tx.last(
        f"SELECT {CARD_COLS}, seq FROM cards WHERE box_id IN ("
        "SELECT context_box_id FROM agent_state_head WHERE agent_id = ? UNION ALL "
        "SELECT output_box_id FROM agent_state_head WHERE agent_id = ?)",
        (token.agent_id, token.agent_id),
    )
    new = Head(*h.rows[0])
    return StepStart(
        new, step_id, new.step_count, *split_turn_cards(rows, new.context_box_id, new.output_box_id)
    )


@_one_trip
def suspend(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    token: TurnToken,
    step_id: str,
    calls: Sequence[ToolCallRecord],
    cards: Sequence[NewCard],
    resume_deadline: float,
) -> int:
    """:func:`~agentserver.agents.sql.tools.suspend` in one round trip."""
    if not calls:
        raise ValueError("suspend needs at least one tool call")
    now = env.clock.now()
    call_cards = [
        NewCard(
            CardType.TOOL_CALL,
            call.payload,
            {**call.metadata, "tool_call_id": call.tool_call_id, "to": call.to},
        )
        for call in calls
    ]
    ids = _append_cards(
        tx,
        env,
        token,
        [*cards, *call_cards],
        HeadEvent.SUSPEND,
        sets={
            "waiting_tool_count": len(calls),
            "resume_deadline": resume_deadline,
            "expecting_correlation_id": None,
        },
    )
    call_ids = [c.tool_call_id for c in calls]
    tools.record_waiting(tx, token, step_id, calls, ids[len(cards) :], now)
    close_step(tx, env, step_id, None, AgentStepStatus.COMPLETED, call_ids)
    if channel is not None:
        notify(tx, channel)
    sql, params = tools.early_reports_statement(token, call_ids, now)
    ((early,),) = tx.last(f"WITH u AS ({sql} RETURNING 1) SELECT count(*) FROM u", params)
    return int(early)


@_one_trip
def finish(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    token: TurnToken,
    status: str,
    text: str,
    metadata: Mapping[str, Any],
    reply_payload: bytes,
    step_id: str | None = None,
    completion: Any = None,
    cards: Sequence[NewCard] = (),
) -> Finished:
    """:func:`~agentserver.agents.sql.turn_end.finish` in two round trips: all its
    writes with the read of the agent's next queued Turn, then ``COMMIT`` (with that
    Turn's lease when there is one: the shared code, as in ``finish``)."""
    now = env.clock.now()
    agent, turn = token.agent_id, token.agent_turn_id
    # What the compare-and-set clears (the Turn's inbox row: its reply reference and
    # conversation) is read by the statements before it.
    ending = tx.later(turn_end.ENDING, (agent, turn))
    by_turn_row = (
        "FROM agent_state_head h JOIN agent_inbox i ON i.inbox_id = h.turn_inbox_id "
        "WHERE h.agent_id = ? AND h.active_agent_turn_id = ?"
    )
    failed = status != TaskStatus.SUCCEEDED
    tx.execute(
        "INSERT INTO agent_replies (agent_turn_id, agent_id, reply_ref, payload, failed, "
        f"status, created_at) SELECT ?, ?, i.reply_ref, ?, ?, ?, ? {by_turn_row} "
        "AND i.reply_ref IS NOT NULL",
        (turn, agent, reply_payload, int(failed), ReplyStatus.PENDING, now, agent, turn),
    )
    tx.execute(
        "INSERT INTO conversations (agent_id, conversation, context_box_id, output_box_id, "
        f"updated_at) SELECT h.agent_id, i.conversation, h.context_box_id, h.output_box_id, "
        f"? {by_turn_row} AND i.conversation IS NOT NULL AND i.conversation != '' "
        "AND h.context_box_id IS NOT NULL AND h.output_box_id IS NOT NULL "
        "ON CONFLICT (agent_id, conversation) DO UPDATE "
        "SET context_box_id = excluded.context_box_id, "
        "output_box_id = excluded.output_box_id, updated_at = excluded.updated_at",
        (now, agent, turn),
    )
    priced = with_tokens(env, agent, cards)
    _fence(
        tx,
        env,
        token,
        HeadEvent.FINISH,
        sets={
            "active_agent_turn_id": None,
            "turn_inbox_id": None,
            "waiting_tool_count": 0,
            "resume_deadline": None,
            "dispatched_at": None,
            "running_since": None,
        },
        **_tokens_exprs(sum(t for _, t in priced)),
    )
    deliverable = NewCard(CardType.DELIVERABLE, text, {"status": status, **metadata})
    *_, card_id = _cards_into_output(tx, env, token, [*priced, (deliverable, 0)])
    edge(
        tx,
        env,
        agent,
        turn,
        "deliver",
        "response",
        metadata={"status": status, "deliverable_card_id": card_id},
    )
    if step_id is not None:
        close_step(tx, env, step_id, completion, AgentStepStatus.COMPLETED, ())
    queued = tx.one(head.QUEUED_NEXT, (agent, InboxStatus.QUEUED))
    if not ending.rows:  # (the compare-and-set would have missed: not reached)
        raise StaleTurn(f"{token}: not the active Turn")
    _, _, output_box, _, _, ref, _ = ending.rows[0]
    leased = False
    if queued is not None:
        # The head is idle and locked by this transaction (its compare-and-set above):
        # the lease's compare-and-set hits, and its epoch is known.
        epoch = token.turn_epoch + _bump(HeadEvent.FINISH)

        def take(sets: Mapping[str, Any]) -> int:
            _cas_expected(tx, env, agent, HeadEvent.LEASE, sets)
            return epoch + _bump(HeadEvent.LEASE)

        leased = head.lease_with(tx, env, agent, queued, take)
    if channel is not None:
        notify(tx, channel)
    reply = None
    if ref is not None:
        reply = PendingReply(turn, agent, ref, reply_payload, failed, 0)
    return Finished(agent, turn, status, output_box, card_id, reply, leased)


_LOCK_HEAD = f"SELECT {HEAD_COLS} FROM agent_state_head WHERE agent_id = ? FOR UPDATE"
#: The report's waiting row, the first terminating result of its Turn so far (and
#: when it came), the Turn's reply reference: read after the head is locked (a statement
#: of its own, so its snapshot is taken after the lock is held).
_WAITING = (
    "SELECT w.agent_turn_id, w.turn_epoch, w.status, w.to_listener, w.after_execution, "
    "w.created_at, t.result_card_id, t.created_at, (SELECT i.reply_ref FROM "
    "agent_state_head h JOIN agent_inbox i ON i.inbox_id = h.turn_inbox_id "
    "WHERE h.agent_id = w.agent_id) FROM turn_waiting_tools w LEFT JOIN LATERAL "
    "(SELECT result_card_id, created_at FROM turn_waiting_tools WHERE agent_turn_id = "
    "w.agent_turn_id AND turn_epoch = w.turn_epoch AND status = ? AND after_execution = ? "
    "ORDER BY created_at LIMIT 1) t ON true WHERE w.tool_call_id = ? AND w.agent_id = ?"
)


@_one_trip
def apply_report(
    tx: PipeTx, env: StoreEnv, channel: str | None, row: InboxRow, then_step: int | None = None
) -> ReportOutcome:
    """:func:`~agentserver.agents.sql.tools.apply_report` in two round trips: the head
    locked (``FOR UPDATE``) and the report's waiting row read, then every write with
    ``COMMIT``. With the head locked, what the shared function learns from its
    compare-and-sets (a stale Turn, the count of calls still waiting, the step limit)
    is known from the head read, so the writes that follow need no answer."""
    now = env.clock.now()
    agent = row.agent_id
    locked = tx.later(_LOCK_HEAD, (agent,))
    waiting = tx.one(
        _WAITING,
        (WaitingStatus.RECEIVED, AfterExecution.TERMINATE, row.correlation_id, agent),
    )
    if waiting is None or waiting[2] != WaitingStatus.WAITING:
        return _ending(tx, channel, tools.unapplied(tx, env, row, waiting))
    turn_id, epoch, _, to, after, created, term_before, term_at, ref = waiting
    h = Head(*locked.rows[0]) if locked.rows else None
    if (
        h is None
        or h.agent_turn_id != turn_id
        or h.turn_epoch != epoch
        or h.status != HeadStatus.SUSPENDED
    ):
        tools.skip_stale(tx, env, row)
        return _ending(tx, channel, ReportOutcome("stale"))
    token = TurnToken(agent, turn_id, epoch)
    result = tools.result_card(row, to, after)
    tokens = tokens_of(env, agent, result)
    _fence(
        tx,
        env,
        token,
        HeadStatus.SUSPENDED,
        exprs={
            "waiting_tool_count": "waiting_tool_count - 1",
            "context_tokens": "context_tokens + ?",
        },
        expr_params=(tokens,),
    )
    (card_id,) = insert_cards(tx, env, str(h.output_box_id), turn_id, [(result, tokens)])
    tx.execute(*tools.received_statement(row, card_id, now))
    tx.execute(*inbox_move_statement(env, row.inbox_id, InboxEvent.CONSUME))
    if h.waiting_tool_count - 1 > 0:
        return _ending(tx, channel, ReportOutcome("applied"))
    resumed = _fence(tx, env, token, HeadEvent.RESUME, sets=tools.resume_sets(now))
    term = term_before
    if (
        row.message_type != MessageType.TIMEOUT
        and after == AfterExecution.TERMINATE
        and (term_before is None or created < term_at)
    ):
        term = card_id  # this report's own result comes first
    edge(tx, env, agent, turn_id, "resume", "request")
    new_epoch = epoch + _bump(HeadEvent.RESUME)
    now_running = TurnToken(agent, turn_id, new_epoch)
    if then_step is None or term is not None:
        _ending(tx, channel, None)
        return ReportOutcome("applied", now_running, term, ref, None)
    stepped: Later | None = None
    step_id = None
    if h.step_count < then_step:  # (the step's compare-and-set would hit: under the limit)
        stepped = _fence(tx, env, now_running, HeadStatus.RUNNING, **_STEP)
        step_id = new_id()
        tx.execute(
            "INSERT INTO agent_steps (step_id, agent_id, agent_turn_id, turn_epoch, step_no, "
            "status, started_at) VALUES (?,?,?,?,?,?,?)",
            (
                step_id,
                agent,
                turn_id,
                new_epoch,
                h.step_count + 1,
                AgentStepStatus.STARTED,
                env.clock.now(),
            ),
        )
    if channel is not None:
        notify(tx, channel)
    rows = tx.last(
        f"SELECT {CARD_COLS}, seq FROM cards WHERE box_id IN (?, ?)",
        (h.context_box_id, h.output_box_id),
    )
    now_head = Head(*(stepped if stepped is not None else resumed).rows[0])
    step = StepStart(
        now_head,
        step_id,
        now_head.step_count,
        *split_turn_cards(rows, now_head.context_box_id, now_head.output_box_id),
    )
    return ReportOutcome("applied", now_running, term, ref, step)


#: The compare-and-set keywords of a step begun (as ``open_step``'s, under the limit).
_STEP: dict[str, Any] = {"exprs": {"step_count": "step_count + 1"}}


def _ending(tx: PipeTx, channel: str | None, outcome: T) -> T:
    """The ``NOTIFY`` (if any) queued before the ``COMMIT`` that carries the deferred
    writes; ``outcome``."""
    if channel is not None:
        notify(tx, channel)
    return outcome


@_one_trip
def enqueue_turn(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    agent_id: str,
    payload: bytes,
    reply_ref: Any,
    conversation: str | None,
) -> EnqueueResult:
    """:func:`~agentserver.agents.sql.inbox.enqueue_turn` in one round trip: the head
    ensured, the row queued, and its lease written on condition in the server: the
    compare-and-set takes the head if it is idle and this row is its only queued one,
    and the lease's other writes are made only if it did (their rows come from its
    ``RETURNING``): one data-modifying CTE. Python knows everything the lease
    writes but the epoch, which the inbox row takes from the compare-and-set's
    ``RETURNING``. An idle head with older queued rows (the shared
    function leases the oldest) is a miss; so is a Turn continuing a conversation (its
    cards are read first), before anything is sent."""
    if conversation:
        raise Missed("a conversation's cards are read first")
    ref_json = json.dumps(reply_ref)
    inbox_id = new_id()
    head.ensure(tx, env, agent_id)
    inbox.queue(tx, env, inbox_id, agent_id, payload, ref_json, None)
    task = NewCard(CardType.TASK_INPUT, payload.decode("utf-8", "replace"))
    task_tokens = tokens_of(env, agent_id, task)
    now = env.clock.now()
    turn_id, context_box, output_box = new_id(), new_id(), new_id()
    others = "SELECT 1 FROM agent_inbox WHERE agent_id = ? AND status = ? AND inbox_id != ?"
    other_params = (agent_id, InboxStatus.QUEUED, inbox_id)
    sql, params = head.cas_statement(
        env,
        agent_id,
        None,
        None,
        HeadEvent.LEASE,
        sets=head.lease_sets(turn_id, inbox_id, context_box, output_box, now, task_tokens),
        where=f" AND NOT EXISTS ({others})",
        where_params=other_params,
    )
    sources = head_sources(HeadEvent.LEASE)
    dispatch = inbox_sources(InboxEvent.DISPATCH)
    if channel is not None:
        notify(tx, channel)
    # One statement: the compare-and-set (h), and what the lease writes besides, from h
    # (nothing if it missed); then whether it hit, and the check that a miss was not an
    # idle head with older queued rows (the statement's snapshot: the head before it).
    ((took, _),) = tx.last(
        f"WITH h AS ({sql}), "
        "b AS (INSERT INTO boxes (box_id, agent_id, agent_turn_id, kind, created_at) "
        "SELECT ?, ?, ?, ?, ? FROM h UNION ALL SELECT ?, ?, ?, ?, ? FROM h), "
        "c AS (INSERT INTO cards (card_id, box_id, agent_turn_id, card_type, content, "
        "metadata, created_at, tokens) SELECT ?, ?, ?, ?, ?, ?, ?, ? FROM h), "
        "i AS (UPDATE agent_inbox SET status = ?, updated_at = ?, agent_turn_id = ?, "
        "turn_epoch = h.turn_epoch, next_retry_at = ? FROM h WHERE agent_inbox.inbox_id = ? "
        f"AND agent_inbox.status IN ({marks(len(dispatch))})), "
        "e AS (INSERT INTO execution_edges (agent_id, agent_turn_id, primitive, edge_phase, "
        "correlation_id, inbox_id, created_at, metadata) SELECT ?, ?, ?, ?, ?, ?, ?, ? FROM h) "
        "SELECT (SELECT count(*) FROM h), agentserver_expect(NOT EXISTS (SELECT 1 FROM "
        f"agent_state_head WHERE agent_id = ? AND status IN ({marks(len(sources))}) "
        f"AND EXISTS ({others})), ?)",
        (
            *params,
            context_box, agent_id, turn_id, "context", now,
            output_box, agent_id, turn_id, "output", now,
            new_id(), context_box, turn_id, task.card_type, task.content,
            json.dumps(dict(task.metadata)), now, task_tokens,
            str(inbox_transition(dispatch[0], InboxEvent.DISPATCH).target),
            env.clock.now(), turn_id, now, inbox_id, *dispatch,
            agent_id, turn_id, "lease", "request", None, inbox_id, env.clock.now(), "{}",
            agent_id, *sources, *other_params, f"{agent_id}: older queued Turns to lease",
        ),
    )  # fmt: skip
    return EnqueueResult(inbox_id, bool(took))


#: The shared function → its one-round-trip variant (the store's one place to look).
ONE_TRIP: dict[Callable[..., Any], Callable[..., Any]] = {
    turns.start_turn_step: start_turn_step,
    tools.suspend: suspend,
    tools.apply_report: apply_report,
    turns.complete_step: complete_step,
    governance.complete_screened_step: complete_screened_step,
    inbox.report_tool_result: report_tool_result,
    inbox.enqueue_turn: enqueue_turn,
    turn_end.finish: finish,
}
