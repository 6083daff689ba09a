"""The agent store's contract, run against every backend (``store`` is parametrised).

Each test drives one store through its calls (``store.run(module.fn, ...)``) and checks what they promise
(agents/store/base.py): a refused compare-and-set writes nothing, claims and leases keep their
order, suspend/report/resume, step retry, the end of a Turn, replies, conversations,
compaction, governance rows. Raw rows are read through the store's own ``read`` (a
backend-neutral transaction), never through a backend's driver.

Backends: ``sqlite`` always; ``postgresql`` when a server is reachable (the ``pg_url``
fixture skips otherwise).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from agentserver.agents.clock import ManualClock
from agentserver.agents.errors import StaleTurn
from agentserver.agents.governance.approvals import PendingApproval
from agentserver.agents.ports import LLMCompletion
from agentserver.agents.profile.retry import step_retries_done
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import (
    BoxSwap,
    CardType,
    NewCard,
    TaskStatus,
    ToolCallRecord,
    TurnToken,
)
from agentserver.agents.store.governance import DecisionRecord
from agentserver.agents.store.sql import (
    conversations,
    governance,
    inbox,
    memory,
    replies,
    tools,
    turn_end,
    turns,
    watchdog,
)
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.sql_store import SqlAgentStore
from agentserver.agents.store.states import (
    AgentStepStatus,
    HeadStatus,
    InboxStatus,
    MessageType,
    ReplyStatus,
    WaitingStatus,
)

TABLES = (
    "agent_state_head",
    "agent_inbox",
    "turn_waiting_tools",
    "execution_edges",
    "agent_steps",
    "boxes",
    "cards",
    "agent_replies",
    "client_replies",
    "conversations",
    "policy_decisions",
    "approvals",
)
A = "agent"


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[SqlAgentStore]:
    clock = ManualClock()
    settings = StoreSettings(path=tmp_path / "agents.sqlite3", client_replies_max=3)
    if request.param == "sqlite":
        from agentserver.agents.store.sqlite_store import SqliteAgentStore

        s: SqlAgentStore = SqliteAgentStore.open(settings.path, clock=clock, settings=settings)
    else:
        from agentserver.agents.store.pg.store import PostgresAgentStore

        url = request.getfixturevalue("pg_url")  # skips when no server is reachable
        opened = PostgresAgentStore.open(url, clock=clock, settings=settings)
        s = await opened if inspect.isawaitable(opened) else opened
    try:
        yield s
    finally:
        await s.aclose()


def clock_of(store: SqlAgentStore) -> ManualClock:
    clock = store.env.clock
    assert isinstance(clock, ManualClock)
    return clock


async def rows(store: SqlAgentStore, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    def read(tx: Any, env: Any) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in tx.all(sql, params)]

    return await store.read(read)


async def snapshot(store: SqlAgentStore) -> dict[str, list[str]]:
    out = {}
    for table in TABLES:
        out[table] = sorted(repr(r) for r in await rows(store, f"SELECT * FROM {table}"))
    return out


async def running(store: SqlAgentStore, text: str = "task", **kw: Any) -> TurnToken:
    """Enqueue a task for the idle agent and start its Turn."""
    await store.run(inbox.enqueue_turn, A, text.encode(), {"caller_thread": text}, **kw)
    [row] = await store.run1(inbox.claim_due, A, 5)
    return await store.run(turns.start_turn, row)


async def suspended(store: SqlAgentStore, *calls: str, after: str = "suspend") -> TurnToken:
    token = await running(store)
    step_id, _ = await store.run(turns.begin_step, token)
    await store.run(
        turns.complete_step, token, step_id, None, [NewCard(CardType.LLM_MESSAGE, "calling")]
    )
    records = [ToolCallRecord(c, "calc", f"<add>{c}</add>", after) for c in calls]
    await store.run(
        tools.suspend, token, step_id, records, [], resume_deadline=clock_of(store).now() + 60
    )
    return token


# -- intake, claims, leases ------------------------------------------------------------------


async def test_enqueue_leases_an_idle_agent_and_queues_behind_a_busy_one(store):
    first = await store.run(inbox.enqueue_turn, A, b"one", {"caller_thread": "one"})
    second = await store.run(inbox.enqueue_turn, A, b"two", {"caller_thread": "two"})
    assert (first.leased, second.leased) == (True, False)
    head = await store.read(sql_head.read, A)
    assert head.status == HeadStatus.DISPATCHED and head.turn_epoch == 1
    assert head.turn_inbox_id == first.inbox_id
    task_cards = await store.read(memory.cards, head.context_box_id)
    assert [(c.card_type, c.content) for c in task_cards] == [(CardType.TASK_INPUT, "one")]
    assert head.context_tokens > 0  # the task card is counted on the head
    # The queued Turn is leased, in order, when the first ends.
    [row] = await store.run1(inbox.claim_due, A, 5)
    token = await store.run(turns.start_turn, row)
    fin = await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
    assert fin.next_leased
    head = await store.read(sql_head.read, A)
    assert head.turn_inbox_id == second.inbox_id and head.turn_epoch == 2


async def test_claims_take_due_rows_in_order_once(store):
    token = await suspended(store, "c1", "c2")
    clock = clock_of(store)
    await store.run(inbox.report_tool_result, A, "c2", b"2", failed=False)
    clock.advance(1)
    await store.run(inbox.report_tool_result, A, "c1", b"1", failed=False)
    clock.advance(1)
    claimed = await store.run1(inbox.claim_due, A, 5)
    assert [r.correlation_id for r in claimed] == ["c2", "c1"]
    assert all(r.token == token for r in claimed)
    assert await store.run1(inbox.claim_due, A, 5) == []  # processing: not claimed twice
    assert await store.read(inbox.due_agents, 5) == []


async def test_a_report_before_its_suspend_waits_deferred_then_is_due(store):
    token = await running(store)
    await store.run(inbox.report_tool_result, A, "early", b"r", failed=False)
    [(status,)] = await rows(
        store, "SELECT status FROM agent_inbox WHERE correlation_id = ?", "early"
    )
    assert status == InboxStatus.DEFERRED
    step_id, _ = await store.run(turns.begin_step, token)
    await store.run(
        tools.suspend, token, step_id, [ToolCallRecord("early", "calc", "<x/>")], [], 1e12
    )
    [row] = await store.run1(inbox.claim_due, A, 5)  # due at once, without waiting for the backoff
    assert row.correlation_id == "early" and row.token == token


# -- the one compare-and-set -------------------------------------------------------------------


async def test_a_refused_compare_and_set_writes_nothing(store):
    token = await running(store)
    step_id, _ = await store.run(turns.begin_step, token)
    await store.run(
        turns.complete_step, token, step_id, None, [NewCard(CardType.LLM_MESSAGE, "hi")]
    )
    [card] = [
        c
        for c in await store.read(memory.cards, (await store.read(sql_head.read, A)).output_box_id)
    ]
    stale = TurnToken(token.agent_id, token.agent_turn_id, token.turn_epoch - 1)
    before = await snapshot(store)
    attempts = [
        store.run(turns.add_cards, stale, [NewCard(CardType.NOTE, "no")]),
        store.run(turns.begin_step, stale),
        store.run(turns.complete_step, stale, step_id, None, [NewCard(CardType.NOTE, "no")]),
        store.run(tools.suspend, stale, step_id, [ToolCallRecord("t", "calc", "<x/>")], [], 1.0),
        store.run(
            turns.compact, BoxSwap(NewCard(CardType.SUMMARY, "s"), (card.card_id,), {}), stale
        ),
        store.run1(turns.add_context_tokens, stale, 10),
        store.run(
            turns.retry_step, stale, step_id, attempt=1, kind="TIMEOUT", delay_s=1, error="e"
        ),
        store.run(turn_end.finish, stale, TaskStatus.SUCCEEDED, "no", {}, b"<a/>"),
        store.run(
            governance.record_decisions,
            stale,
            step_id,
            [DecisionRecord("t", "x", "deny", "r", "y")],
            [],
        ),
    ]
    for attempt in attempts:
        with pytest.raises(StaleTurn):
            await attempt
    assert (
        await store.run(
            turn_end.force_end, A, "stopped", "no", None, turn_epoch=token.turn_epoch - 1
        )
        is None
    )
    assert await snapshot(store) == before
    assert (await store.read(sql_head.read, A)).status == HeadStatus.RUNNING


async def test_start_turn_refuses_a_row_whose_turn_moved_on(store):
    await store.run(inbox.enqueue_turn, A, b"x", {})
    [row] = await store.run1(inbox.claim_due, A, 5)
    await store.run(turn_end.force_end, A, TaskStatus.STOPPED, "stopped", None)
    before = await snapshot(store)
    with pytest.raises(StaleTurn):
        await store.run(turns.start_turn, row)
    assert await snapshot(store) == before


# -- steps ----------------------------------------------------------------------------------


async def test_steps_are_counted_and_closed_with_their_usage(store):
    token = await running(store)
    step_id, step_no = await store.run(turns.begin_step, token)
    assert step_no == 1 and (await store.read(sql_head.read, A)).step_count == 1
    before = (await store.read(sql_head.read, A)).context_tokens
    completion = LLMCompletion("hello", model="m", backend="b", cost=0.5)
    await store.run(
        turns.complete_step, token, step_id, completion, [NewCard(CardType.LLM_MESSAGE, "hello")]
    )
    head = await store.read(sql_head.read, A)
    assert head.context_tokens > before  # the reply's card is counted
    [(status, model, cost)] = await rows(
        store, "SELECT status, model, cost FROM agent_steps WHERE step_id = ?", step_id
    )
    assert (status, model, cost) == (AgentStepStatus.COMPLETED, "m", 0.5)
    assert (await store.run(turns.begin_step, token))[1] == 2


async def test_step_retry_waits_durably_and_does_not_count_the_failed_attempt(store):
    token = await running(store)
    clock = clock_of(store)
    step_id, _ = await store.run(turns.begin_step, token)
    due = await store.run(
        turns.retry_step, token, step_id, attempt=1, kind="RATE_LIMIT", delay_s=30, error="429"
    )
    assert due == clock.now() + 30
    head = await store.read(sql_head.read, A)
    assert head.step_count == 0 and head.status == HeadStatus.RUNNING
    [(status,)] = await rows(store, "SELECT status FROM agent_steps WHERE step_id = ?", step_id)
    assert status == AgentStepStatus.RETRYING
    assert (
        await store.read(memory.cards, head.output_box_id) == []
    )  # the failed attempt left no card
    assert await store.run1(inbox.claim_due, A, 5) == []  # not due yet
    clock.advance(31)
    [row] = await store.run1(inbox.claim_due, A, 5)
    assert row.message_type == MessageType.RESUME and step_retries_done(row.payload) == 1
    assert await store.run(turns.take_resume, row) == token


async def test_a_restart_keeps_the_retry_wait_and_fences_the_old_worker(store):
    token = await running(store)
    clock = clock_of(store)
    step_id, _ = await store.run(turns.begin_step, token)
    await store.run(
        turns.retry_step, token, step_id, attempt=2, kind="OVERLOADED", delay_s=40, error="e"
    )
    [recovered] = await store.recover_running()
    assert recovered.turn_epoch == token.turn_epoch + 1
    with pytest.raises(StaleTurn):
        await store.run(turns.begin_step, token)
    assert await store.run1(inbox.claim_due, A, 5) == []  # the wait's due time survived
    clock.advance(41)
    [row] = await store.run1(inbox.claim_due, A, 5)
    assert row.token == recovered and step_retries_done(row.payload) == 2


# -- suspend, report, resume ------------------------------------------------------------------


async def test_suspend_report_resume(store):
    token = await suspended(store, "c1", "c2")
    head = await store.read(sql_head.read, A)
    assert head.status == HeadStatus.SUSPENDED and head.waiting_tool_count == 2
    await store.run(inbox.report_tool_result, A, "c1", b"one", failed=False)
    await store.run(inbox.report_tool_result, A, "c1", b"again", failed=False)
    await store.run(inbox.report_tool_result, A, "c2", b"two", failed=True)
    outcomes = [
        await store.run(tools.apply_report, r) for r in await store.run1(inbox.claim_due, A, 5)
    ]
    assert [o.kind for o in outcomes] == ["applied", "duplicate", "applied"]
    assert outcomes[0].resumed is None
    resumed = outcomes[2].resumed
    assert resumed == TurnToken(A, token.agent_turn_id, token.turn_epoch + 1)
    head = await store.read(sql_head.read, A)
    assert head.status == HeadStatus.RUNNING and head.waiting_tool_count == 0
    results = [
        c
        for c in await store.read(memory.cards, head.output_box_id)
        if c.card_type == "tool.result"
    ]
    assert [(c.content, c.metadata["failed"]) for c in results] == [("one", False), ("two", True)]
    statuses = await rows(store, "SELECT status FROM turn_waiting_tools ORDER BY tool_call_id")
    assert statuses == [(WaitingStatus.RECEIVED,), (WaitingStatus.RECEIVED,)]
    with pytest.raises(StaleTurn):  # the old epoch is fenced out
        await store.run(turns.add_cards, token, [NewCard(CardType.NOTE, "late")])


async def test_a_terminating_tool_names_its_result_card(store):
    await suspended(store, "t1", after="terminate")
    await store.run(inbox.report_tool_result, A, "t1", b"final", failed=False)
    [row] = await store.run1(inbox.claim_due, A, 5)
    outcome = await store.run(tools.apply_report, row)
    card = await store.read(memory.card, outcome.terminate_card_id)
    assert card is not None and card.content == "final"


async def test_timeouts_are_injected_once_per_waiting_tool(store):
    token = await suspended(store, "c1", "c2")
    clock_of(store).advance(61)
    assert await store.read(watchdog.expired_suspensions) == [token]
    assert await store.read(watchdog.suspended_turns) == [token]
    assert await store.run(tools.inject_timeouts, token) == 2
    with pytest.raises(StaleTurn):  # the deadline is cleared: once
        await store.run(tools.inject_timeouts, token)
    assert await store.read(watchdog.expired_suspensions) == []
    kinds = [r.message_type for r in await store.run1(inbox.claim_due, A, 5)]
    assert kinds == [MessageType.TIMEOUT, MessageType.TIMEOUT]


async def test_a_report_for_no_call_is_deferred_then_given_up(store):
    await running(store)
    clock = clock_of(store)
    await store.run(inbox.report_tool_result, A, "ghost", b"?", failed=False)
    kinds = []
    for _ in range(store.settings.max_retries + 1):
        clock.advance(1000)
        [row] = await store.run1(inbox.claim_due, A, 5)
        kinds.append((await store.run(tools.apply_report, row)).kind)
    assert kinds == ["deferred"] * store.settings.max_retries + ["exhausted"]
    [(status,)] = await rows(
        store, "SELECT status FROM agent_inbox WHERE correlation_id = ?", "ghost"
    )
    assert status == InboxStatus.ERROR


# -- the end of a Turn -------------------------------------------------------------------------


async def test_finish_writes_deliverable_reply_and_idles_the_head(store):
    token = await running(store)
    fin = await store.run(
        turn_end.finish, token, TaskStatus.SUCCEEDED, "the answer", {"k": 1}, b"<a/>"
    )
    head = await store.read(sql_head.read, A)
    assert head.status == HeadStatus.IDLE and head.agent_turn_id is None
    card = await store.read(memory.card, fin.deliverable_card_id)
    assert card is not None and card.card_type == CardType.DELIVERABLE
    assert card.metadata == {"status": "succeeded", "k": 1}
    assert fin.reply is not None and not fin.reply.failed
    [pending] = await store.read(replies.pending_replies, 10)
    assert pending.agent_turn_id == token.agent_turn_id and pending.payload == b"<a/>"
    with pytest.raises(StaleTurn):
        await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "twice", {}, b"<a/>")


async def test_force_end_of_a_suspended_turn_cancels_its_waits(store):
    token = await suspended(store, "c1")
    assert (
        await store.run(turn_end.force_end, A, "stopped", "x", None, agent_turn_id="other") is None
    )
    assert (
        await store.run(turn_end.force_end, A, "stopped", "x", None, expect_status=["running"])
        is None
    )
    fin = await store.run(turn_end.force_end, A, TaskStatus.STOPPED, "stopped", b"<stopped/>")
    assert fin is not None and fin.agent_turn_id == token.agent_turn_id
    [(status,)] = await rows(store, "SELECT status FROM turn_waiting_tools")
    assert status == WaitingStatus.CANCELLED
    head = await store.read(sql_head.read, A)
    assert head.status == HeadStatus.IDLE and head.turn_epoch == token.turn_epoch + 1
    assert await store.run(turn_end.force_end, A, TaskStatus.STOPPED, "again", None) is None
    # A late result is acknowledged and changes nothing.
    await store.run(inbox.report_tool_result, A, "c1", b"late", failed=False)
    [row] = await store.run1(inbox.claim_due, A, 5)
    assert (await store.run(tools.apply_report, row)).kind == "duplicate"


async def test_a_malformed_enqueue_fails_its_turn(store):
    await store.run(inbox.enqueue_turn, A, b"bad", {"caller_thread": "x"})
    [row] = await store.run1(inbox.claim_due, A, 5)
    fin = await store.run(turn_end.fail_turn_row, row, "malformed", b"<failed/>")
    assert fin is not None and fin.status == TaskStatus.FAILED and fin.reply is not None
    [(status,)] = await rows(store, "SELECT status FROM agent_inbox")
    assert status == InboxStatus.ERROR
    assert await store.run(turn_end.fail_turn_row, row, "again", None) is None


async def test_watchdog_queries(store):
    clock = clock_of(store)
    await store.run(inbox.enqueue_turn, A, b"x", {})
    [row] = await store.run1(inbox.claim_due, A, 5)
    clock.advance(100)
    assert [h.agent_id for h in await store.read(watchdog.stale_dispatched, 50)] == [A]
    assert await store.run1(inbox.requeue_stuck, 50) == 1  # the claimed row was never applied
    [again] = await store.run1(inbox.claim_due, A, 5)
    assert again.inbox_id == row.inbox_id
    await store.run(turns.start_turn, again)
    clock.advance(100)
    assert [h.agent_id for h in await store.read(watchdog.overdue_running, 50)] == [A]
    assert await store.read(watchdog.stale_dispatched, 50) == []


# -- replies -----------------------------------------------------------------------------------


async def test_reply_outbox_attempts_and_give_up(store):
    token = await running(store)
    await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "a", {}, b"<a/>")
    await store.run1(replies.mark_reply_attempt, token.agent_turn_id, give_up=False)
    [pending] = await store.read(replies.pending_replies, 10)
    assert pending.attempts == 1
    await store.run1(replies.mark_reply_attempt, token.agent_turn_id, give_up=True)
    assert await store.read(replies.pending_replies, 10) == []
    [(status,)] = await rows(store, "SELECT status FROM agent_replies")
    assert status == ReplyStatus.UNDELIVERABLE


async def test_client_replies_are_bounded_and_kept_until_received(store):
    for i in range(5):
        await store.run(replies.record_client_reply, "alice", {"t": i}, b"<a/>", failed=False)
    await store.run(replies.record_client_reply, "bob", {"t": 9}, b"<b/>", failed=True)
    got = await store.read(replies.pending_client_replies, "alice")
    assert [json.loads(r.thread_ref_json) for r in got] == [{"t": 2}, {"t": 3}, {"t": 4}]
    assert (
        await store.read(replies.pending_client_replies, "alice") == got
    )  # reading hands nothing over
    bob = await store.read(replies.pending_client_replies, "bob")
    assert (
        await store.run1(replies.ack_client_replies, "alice", [bob[0].reply_id]) == 0
    )  # not alice's
    assert await store.run1(replies.ack_client_replies, "alice", [r.reply_id for r in got[:2]]) == 2
    assert await store.read(replies.pending_client_replies, "alice", after_id=0) == got[2:]
    assert await store.run1(replies.ack_client_replies, "alice", [r.reply_id for r in got]) == 1
    assert await store.read(replies.pending_client_replies, "alice") == []
    assert await store.run1(replies.ack_client_replies, "alice", []) == 0


async def test_client_reply_kept_and_outbox_marked_sent_in_one_transaction(store):
    token = await running(store)
    await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "a", {}, b"<a/>")
    turn_id = token.agent_turn_id
    assert await store.run(
        replies.record_client_reply, "alice", {"t": 1}, b"<r/>", failed=False, agent_turn_id=turn_id
    )
    assert await rows(store, "SELECT status, attempts FROM agent_replies") == [("sent", 1)]
    # kept once: a second hand-over of the same Turn keeps nothing more
    again = await store.run(
        replies.record_client_reply, "alice", {"t": 1}, b"<r/>", failed=False, agent_turn_id=turn_id
    )
    assert again == 0
    await store.run1(replies.mark_reply_sent, turn_id)  # idempotent
    assert await rows(store, "SELECT status, attempts FROM agent_replies") == [("sent", 1)]
    assert [r.payload for r in await store.read(replies.pending_client_replies, "alice")] == [
        b"<r/>"
    ]


async def test_cancel_queued_and_turn_of_thread(store):
    await store.run(inbox.enqueue_turn, A, b"one", {"caller_thread": "t1"})
    await store.run(inbox.enqueue_turn, A, b"two", {"caller_thread": "t2"})
    await store.run(inbox.enqueue_turn, A, b"three", {"caller_thread": "t3"})
    head = await store.read(sql_head.read, A)
    assert await store.read(replies.turn_of_thread, A, "t1") == head.agent_turn_id
    assert await store.read(replies.turn_of_thread, A, "t2") is None
    [one] = await store.run(replies.cancel_queued, A, "t2", b"<cancelled/>")
    assert json.loads(one.reply_ref_json) == {"caller_thread": "t2"} and one.failed
    rest = await store.run(replies.cancel_queued, A, None, b"<cancelled/>")
    assert [json.loads(r.reply_ref_json)["caller_thread"] for r in rest] == ["t3"]
    assert len(await store.read(replies.pending_replies, 10)) == 2


# -- memory across tasks, compaction -----------------------------------------------------------


async def test_a_conversation_continues_from_its_last_turn(store):
    token = await running(store, "my name is Ada", conversation="alice")
    await store.run(turns.add_cards, token, [NewCard(CardType.LLM_MESSAGE, "hello Ada")])
    await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "hello Ada", {}, b"<a/>")
    boxes = await store.read(conversations.conversation_boxes, A, "alice")
    assert boxes is not None
    seen = [c.content for c in await store.read(conversations.conversation_cards, A, "alice")]
    assert seen == ["my name is Ada", "hello Ada"]  # no deliverable
    await store.run(inbox.enqueue_turn, A, b"who am I?", {}, conversation="alice")
    head = await store.read(sql_head.read, A)
    context = [c.content for c in await store.read(memory.cards, head.context_box_id)]
    assert context == ["my name is Ada", "hello Ada", "who am I?"]
    assert await store.read(conversations.conversation_cards, A, "bob") == []
    # Manual compaction of an idle conversation: only from the boxes it still points at.
    assert not await store.run(
        conversations.replace_conversation,
        A,
        "alice",
        ("x", "y"),
        NewCard(CardType.SUMMARY, "s"),
        [],
    )
    kept = [c for c in await store.read(conversations.conversation_cards, A, "alice")][-1:]
    assert await store.run(
        conversations.replace_conversation,
        A,
        "alice",
        boxes,
        NewCard(CardType.SUMMARY, "Ada's chat"),
        [kept[0].card_id],
    )
    seen = [c.content for c in await store.read(conversations.conversation_cards, A, "alice")]
    assert seen == ["Ada's chat", "hello Ada"]


async def test_compaction_swaps_the_boxes_and_recounts(store):
    token = await running(store)
    await store.run(
        turns.add_cards,
        token,
        [NewCard(CardType.LLM_MESSAGE, "a" * 400), NewCard(CardType.LLM_MESSAGE, "b" * 40)],
    )
    head = await store.read(sql_head.read, A)
    old = await store.read(memory.cards, head.output_box_id)
    swap = BoxSwap(NewCard(CardType.SUMMARY, "sum"), (old[1].card_id,), {})
    total = await store.run(turns.compact, swap, token)
    head = await store.read(sql_head.read, A)
    assert head.context_tokens == total < (await store.read(sql_head.read, A)).context_tokens + 400
    assert [c.content for c in await store.read(memory.cards, head.context_box_id)] == ["sum"]
    assert [c.content for c in await store.read(memory.cards, head.output_box_id)] == ["b" * 40]
    assert await store.read(memory.cards, old[0].box_id) == old  # the old boxes stay


async def test_a_step_commits_its_compaction_or_neither(store):
    token = await running(store)
    step_id, _ = await store.run(turns.begin_step, token)
    await store.run(turns.add_cards, token, [NewCard(CardType.LLM_MESSAGE, "old " * 100)])
    [old] = await store.read(memory.cards, (await store.read(sql_head.read, A)).output_box_id)
    swap = BoxSwap(NewCard(CardType.SUMMARY, "sum"), (old.card_id,), {"folded_cards": 1})
    reply = [NewCard(CardType.LLM_MESSAGE, "new")]
    stale = TurnToken(token.agent_id, token.agent_turn_id, token.turn_epoch + 1)
    before = await snapshot(store)
    with pytest.raises(StaleTurn):
        await store.run(turns.complete_step, stale, step_id, None, reply, swap=swap)
    assert await snapshot(store) == before
    await store.run(
        turns.complete_step, token, step_id, None, reply, swap=replace(swap, correction=7)
    )
    head = await store.read(sql_head.read, A)
    assert [c.content for c in await store.read(memory.cards, head.context_box_id)] == ["sum"]
    shown = [c.content for c in await store.read(memory.cards, head.output_box_id)]
    assert shown == [old.content, "new"]
    [(meta,)] = await rows(
        store, "SELECT metadata FROM execution_edges WHERE primitive = ?", "compact"
    )
    assert json.loads(meta)["context_tokens"] == head.context_tokens
    [(status,)] = await rows(store, "SELECT status FROM agent_steps WHERE step_id = ?", step_id)
    assert status == AgentStepStatus.COMPLETED


# -- governance rows ---------------------------------------------------------------------------


async def test_policy_decisions_and_rate_windows(store):
    token = await running(store)
    clock = clock_of(store)
    step_id, _ = await store.run(turns.begin_step, token)
    decisions = [
        DecisionRecord("calc", "add", "allow", "r1", "ok", rate_key="calc"),
        DecisionRecord("shell", "run", "deny", "r2", "no"),
    ]
    refusal = NewCard(CardType.TOOL_REFUSED, "refused", {"to": "shell"})
    await store.run(governance.record_decisions, token, step_id, decisions, [refusal])
    got = await store.read(governance.turn_decisions, token.agent_turn_id)
    assert [(d.target, d.decision, d.step_id) for d in got] == [
        ("calc", "allow", step_id),
        ("shell", "deny", step_id),
    ]
    assert await store.read(governance.rate_window, "calc", clock.now() - 1) == [clock.now()]
    assert await store.read(governance.rate_window, "calc", clock.now()) == []
    [(meta,)] = await rows(store, "SELECT metadata FROM agent_steps WHERE step_id = ?", step_id)
    assert [p["decision"] for p in json.loads(meta)["policy"]] == ["allow", "deny"]
    head = await store.read(sql_head.read, A)
    assert [c.content for c in await store.read(memory.cards, head.output_box_id)] == ["refused"]


async def test_an_approval_is_decided_once(store):
    from agentserver.agents.governance.approvals import APPROVAL_PREFIX

    token = await running(store)
    step_id, _ = await store.run(turns.begin_step, token)
    ask = PendingApproval(
        "req1", A, token.agent_turn_id, "shell", "<run/>", "r", "boss", 1e12, "th"
    )
    await store.run(governance.record_decisions, token, step_id, [], [], [ask])
    assert await store.read(governance.unsent_approvals) == []  # not before its waiting row exists
    call = ToolCallRecord(APPROVAL_PREFIX + "req1", "shell", "<run/>", "approval")
    await store.run(tools.suspend, token, step_id, [call], [], 1e12)
    assert await store.read(governance.unsent_approvals) == [ask]
    assert await store.read(governance.pending_approvals, "boss") == [ask]
    assert await store.read(governance.pending_approvals, "nobody") == []
    await store.run(governance.mark_approval_sent, "req1")
    assert await store.read(governance.unsent_approvals) == []
    assert (
        await store.run(governance.decide_approval, "req1", True, "fine", by="intruder")
        == "not-yours"
    )
    assert await store.run(governance.decide_approval, "req1", True, "fine", by="boss") == "applied"
    assert (
        await store.run(governance.decide_approval, "req1", False, "no", by="boss") == "duplicate"
    )
    assert await store.run(governance.decide_approval, "nope", True, "", by=None) == "unknown"
    assert await store.read(governance.approval_status, "req1") == "granted"
    [row] = await store.run1(inbox.claim_due, A, 5)
    assert row.message_type == MessageType.APPROVAL
    begun = await store.run(governance.begin_forward, row)
    assert begun is not None and begun[0] == "req1" and begun[1] == token
    await store.run(governance.finish_forward, "req1", row, "sub-1", "suspend", 2e12)
    assert await store.read(governance.approval_status, "req1") == "forwarded"
    assert (await store.read(sql_head.read, A)).resume_deadline == 2e12
    await store.run(inbox.report_tool_result, A, "sub-1", b"ran", failed=False)
    [result] = await store.run1(inbox.claim_due, A, 5)
    outcome = await store.run(tools.apply_report, result)
    assert outcome.kind == "applied" and outcome.resumed is not None
