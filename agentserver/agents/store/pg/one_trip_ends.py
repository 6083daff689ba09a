"""A Turn's ends on PostgreSQL in one round trip each (two for ``finish``): its
enqueue (with its lease), the tool reports that arrive for it, its finish (with the
next Turn's lease): the variants of ``agents/store/sql/inbox.py`` and ``turn_end.py`` (see
:mod:`.one_trip` for how, and what a miss does)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agentserver.agents.errors import StaleTurn
from agentserver.agents.ports import ReplyRef
from agentserver.agents.store.base import (
    CardType,
    EnqueueResult,
    Finished,
    NewCard,
    PendingReply,
    TaskStatus,
    TurnToken,
)
from agentserver.agents.store.pg.notify import notify
from agentserver.agents.store.pg.one_trip import (
    Missed,
    PipeTx,
    bump,
    cards_into_output,
    cas_expected,
    closing,
    fence,
    one_trip,
    tokens_exprs,
)
from agentserver.agents.store.sql import fair, head, inbox, replies, turn_end
from agentserver.agents.store.sql.budgets import Spend, settle_spends
from agentserver.agents.store.sql.common import (
    edge,
    tokens_of,
)
from agentserver.agents.store.sql.db import SqlValue, StoreEnv, marks, new_id
from agentserver.agents.store.sql.turns import close_step, with_tokens
from agentserver.agents.store.states import (
    AgentStepStatus,
    HeadEvent,
    InboxEvent,
    InboxStatus,
    MessageType,
    ReplyStatus,
    head_sources,
    inbox_sources,
    inbox_transition,
)


@one_trip
def enqueue_turn(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    agent_id: str,
    payload: bytes,
    reply_ref: ReplyRef,
    conversation: str | None,
) -> EnqueueResult:
    """:func:`~agentserver.agents.store.sql.inbox.enqueue_turn` in one round trip: the head
    ensured, the row queued, and its lease written on condition in the server: the
    compare-and-set takes the head if it is idle and this row is its only queued one,
    and the lease's other writes are made only if it did (their rows come from its
    ``RETURNING``): one data-modifying CTE. Python knows everything the lease
    writes but the epoch, which the inbox row takes from the compare-and-set's
    ``RETURNING``. An idle head with older queued rows (the shared
    function leases the oldest) is a miss; so is a Turn continuing a conversation (its
    cards are read first), all before anything is sent. With ``<store fair-share>`` the
    same statement moves the client's fair-share tags as the shared lease does
    (agents/store/sql/fair.py): a lease that hits leases the agent's only queued row, so
    the fair choice is this row, and its start tag is ``max(V, the client's finish)``,
    read in the statement; fair share off, nothing is added."""
    if conversation:
        raise Missed("a conversation's cards are read first")
    fair_tags = _fair_tags(env, reply_ref)
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
        given=head.lease_given(turn_id, inbox_id, context_box, output_box, now, task_tokens),
        where=f" AND NOT EXISTS ({others})",
        where_params=other_params,
    )
    sources = head_sources(HeadEvent.LEASE)
    dispatch = inbox_sources(InboxEvent.DISPATCH)
    if channel is not None:
        notify(tx, channel)
    fair_sql = ""
    fair_params: tuple[SqlValue, ...] = ()
    if fair_tags is not None:
        client, step = fair_tags
        # f: the start tag, from the tags before this statement (h took the head, so this
        # row is the only queued one: the fair choice); t: the client's finish and the
        # agent's clock moved, as fair.next_queued moves them.
        fair_sql = (
            ", f AS (SELECT greatest(coalesce((SELECT vfinish FROM fair_share WHERE "
            "agent_id = ? AND client = ?), 0), coalesce((SELECT vfinish FROM fair_share "
            "WHERE agent_id = ? AND client = ?), 0)) AS s FROM h), "
            "t AS (INSERT INTO fair_share (agent_id, client, vfinish) "
            "SELECT ?, ?, s + ? FROM f UNION ALL SELECT ?, ?, s FROM f "
            "ON CONFLICT (agent_id, client) DO UPDATE SET vfinish = excluded.vfinish)"
        )
        fair_params = (
            agent_id, fair.AGENT_CLOCK, agent_id, client,
            agent_id, client, step, agent_id, fair.AGENT_CLOCK,
        )  # fmt: skip
    # One statement: the compare-and-set (h), and what the lease writes besides, from h
    # (nothing if it missed); then whether it hit, and the check that a miss was not an
    # idle head with older queued rows (the statement's snapshot: the head before it).
    # An A2A task's Enqueue is a miss (it may repeat an earlier send, which the shared
    # function drops: sql/a2a.py, earlier_send); every other Enqueue pays one index probe.
    threads = (
        [t for t in (reply_ref.get("caller_thread"), reply_ref.get("hop")) if isinstance(t, str)]
        if isinstance(reply_ref, Mapping)
        else []
    )
    threads = threads or [""]
    ((took, _, _),) = tx.last(
        f"WITH h AS ({sql}), "
        "b AS (INSERT INTO boxes (box_id, agent_id, agent_turn_id, kind, created_at) "
        "SELECT ?, ?, ?, ?, ? FROM h UNION ALL SELECT ?, ?, ?, ?, ? FROM h), "
        "c AS (INSERT INTO cards (card_id, box_id, agent_turn_id, card_type, content, "
        "metadata, created_at, tokens) SELECT ?, ?, ?, ?, ?, ?, ?, ? FROM h), "
        "i AS (UPDATE agent_inbox SET status = ?, updated_at = ?, agent_turn_id = ?, "
        "turn_epoch = h.turn_epoch, next_retry_at = ? FROM h WHERE agent_inbox.inbox_id = ? "
        f"AND agent_inbox.status IN ({marks(len(dispatch))})), "
        "e AS (INSERT INTO execution_edges (agent_id, agent_turn_id, primitive, edge_phase, "
        "correlation_id, inbox_id, created_at, metadata) SELECT ?, ?, ?, ?, ?, ?, ?, ? FROM h)"
        f"{fair_sql} "
        "SELECT (SELECT count(*) FROM h), agentserver_expect(NOT EXISTS (SELECT 1 FROM "
        f"agent_state_head WHERE agent_id = ? AND status IN ({marks(len(sources))}) "
        f"AND EXISTS ({others})), ?), agentserver_expect(NOT EXISTS (SELECT 1 FROM a2a_tasks "
        f"WHERE agent_id = ? AND task_id IN ({marks(len(threads))})), ?)",
        (
            *params,
            context_box, agent_id, turn_id, "context", now,
            output_box, agent_id, turn_id, "output", now,
            new_id(), context_box, turn_id, task.card_type, task.content,
            json.dumps(dict(task.metadata)), now, task_tokens,
            str(inbox_transition(dispatch[0], InboxEvent.DISPATCH).target),
            env.clock.now(), turn_id, now, inbox_id, *dispatch,
            agent_id, turn_id, "lease", "request", None, inbox_id, env.clock.now(), "{}",
            *fair_params,
            agent_id, *sources, *other_params, f"{agent_id}: older queued Turns to lease",
            agent_id, *threads, f"{agent_id}: an A2A task, maybe sent before",
        ),
    )  # fmt: skip
    return EnqueueResult(inbox_id, bool(took))


def _fair_tags(env: StoreEnv, reply_ref: ReplyRef) -> tuple[str, float] | None:
    """With fair share on, the client the lease tags and its step ``1/weight``; None with it
    off. A client the statement cannot name as fair.py's SQL does is a miss."""
    if env.settings.fair_weights is None:
        return None
    client = reply_ref.get("client") if isinstance(reply_ref, Mapping) else None
    if client is None:
        client = ""
    if not isinstance(client, str) or client == fair.AGENT_CLOCK:
        raise Missed("a client fair.py names in SQL")
    return client, 1.0 / dict(env.settings.fair_weights).get(client, 1.0)


@one_trip
def report_tool_result(
    tx: PipeTx,
    env: StoreEnv,
    channel: str | None,
    agent_id: str,
    tool_call_id: str,
    payload: bytes,
    failed: bool,
) -> str:
    """:func:`~agentserver.agents.store.sql.inbox.report_tool_result` in one round trip: the
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
    return closing(tx, channel, inbox_id)


@one_trip
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
    sent: Sequence[str] = (),
    spends: Sequence[Spend] = (),
) -> Finished:
    """:func:`~agentserver.agents.store.sql.turn_end.finish` in two round trips: all its
    writes with the read of the agent's next queued Turn, then ``COMMIT`` (with that
    Turn's lease when there is one: the shared code, as in ``finish``). With
    ``spends``, two more: a settle reads what it releases and the marks it crosses."""
    if step_id is None and (cards or spends):
        raise ValueError("cards and spends are written with the step they close")
    now = env.clock.now()
    agent, turn = token.agent_id, token.agent_turn_id
    # What the compare-and-set clears (the Turn's inbox row: its reply reference and
    # conversation) is read by the statements before it. The read locks the head first,
    # as every other end of a Turn does (turn_end.end_turn fences the head before its
    # reply row): inserting the reply row first would deadlock with a stop ending the
    # same Turn, each holding what the other waits for.
    ending = tx.later(turn_end.ENDING + " FOR UPDATE OF h", (agent, turn))
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
    fence(
        tx,
        env,
        token,
        HeadEvent.FINISH,
        **tokens_exprs(sum(t for _, t in priced)),
    )
    deliverable = NewCard(CardType.DELIVERABLE, text, {"status": status, **metadata})
    *_, card_id = cards_into_output(tx, env, token, [*priced, (deliverable, 0)])
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
    replies.mark_replies_sent(tx, env, sent)
    settle_spends(tx, env, spends)
    queued = head.next_queued(tx, env, agent)
    if not ending.rows:  # (the compare-and-set would have missed: not reached)
        raise StaleTurn(f"{token}: not the active Turn")
    _, _, output_box, _, _, ref, _ = ending.rows[0]
    leased = False
    if queued is not None:
        # The head is idle and locked by this transaction (its compare-and-set above):
        # the lease's compare-and-set hits, and its epoch is known.
        epoch = token.turn_epoch + bump(HeadEvent.FINISH)

        def take(given: Mapping[str, Any]) -> int:
            cas_expected(tx, env, agent, HeadEvent.LEASE, given)
            return epoch + bump(HeadEvent.LEASE)

        leased = head.lease_with(tx, env, agent, queued, take)
    if channel is not None:
        notify(tx, channel)
    reply = None
    if ref is not None:
        reply = PendingReply(turn, agent, ref, reply_payload, failed, 0)
    return Finished(agent, turn, status, output_box, card_id, reply, leased)
