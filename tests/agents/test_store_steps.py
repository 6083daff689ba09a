"""The worker's folded transactions, on every backend (the ``store`` fixture of
test_store_contract.py): a step begun with the head and the cards it needs, a Turn started
with its first step, a resume that opens the next step and returns the reply reference,
a suspend that says how many reports came early, a step written with its governance
record. Each writes what the separate calls it replaces would, or nothing."""

from __future__ import annotations

import json

import pytest
from test_store_contract import A, clock_of, rows, running, snapshot, store, suspended

from agentserver.agents.errors import StaleTurn
from agentserver.agents.ports import LLMCompletion, LLMUsage
from agentserver.agents.store.base import CardType, NewCard, ToolCallRecord, TurnToken
from agentserver.agents.store.governance import DecisionRecord, StepRecord
from agentserver.agents.store.sql import governance, inbox, memory, tools, turn_end, turns
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.sql.db import INSERT_CHUNK
from agentserver.agents.store.states import AgentStepStatus, HeadStatus, InboxStatus

__all__ = ["store"]  # the parametrised fixture, used by every test here


def _said(text: str) -> list[NewCard]:
    return [NewCard(CardType.LLM_MESSAGE, text)]


async def test_open_step_begins_the_step_and_returns_head_and_cards(store):
    token = await running(store, "the task")
    first = await store.run(turns.open_step, token, 6)
    assert first.step_id is not None and first.step_no == 1
    assert first.head.step_count == 1 and first.head.status == HeadStatus.RUNNING
    await store.run(turns.complete_step, token, first.step_id, None, _said("one"))
    await store.run(turns.add_cards, token, [NewCard(CardType.NOTE, "two")])
    step = await store.run(turns.open_step, token, 6)
    head = await store.read(sql_head.read, A)
    assert (step.step_no, step.head) == (2, head)
    assert list(step.context) == await store.read(memory.cards, head.context_box_id)
    assert list(step.output) == await store.read(memory.cards, head.output_box_id)
    assert [c.content for c in step.context] == ["the task"]
    assert [c.content for c in step.output] == ["one", "two"]
    assert await rows(
        store, "SELECT step_no, status FROM agent_steps WHERE step_id = ?", step.step_id
    ) == [(2, AgentStepStatus.STARTED)]


async def test_open_step_at_the_limit_begins_nothing(store):
    token = await running(store)
    step = await store.run(turns.open_step, token, 1)
    await store.run(turns.complete_step, token, step.step_id, None, _said("last words"))
    before = await snapshot(store)
    at_limit = await store.run(turns.open_step, token, 1)
    assert at_limit.step_id is None and at_limit.step_no == 1
    assert at_limit.head == await store.read(sql_head.read, A)
    assert [c.content for c in at_limit.output] == ["last words"]
    assert await snapshot(store) == before


async def test_open_step_of_a_stale_token_raises_and_writes_nothing(store):
    token = await running(store)
    before = await snapshot(store)
    stale = TurnToken(A, token.agent_turn_id, token.turn_epoch + 1)
    with pytest.raises(StaleTurn):
        await store.run(turns.open_step, stale, 6)
    # At the limit too: a stale token is never told "limit".
    step = await store.run(turns.open_step, token, 1)
    before = await snapshot(store)
    with pytest.raises(StaleTurn):
        await store.run(turns.open_step, stale, 1)
    assert await snapshot(store) == before
    assert step.step_id is not None


async def test_start_turn_step_starts_the_turn_with_its_first_step(store):
    await store.run(inbox.enqueue_turn, A, b"task", {"caller_thread": "t"})
    [row] = await store.run1(inbox.claim_due, A, 5)
    step = await store.run(turns.start_turn_step, row, 6)
    head = await store.read(sql_head.read, A)
    assert step.head == head and head.status == HeadStatus.RUNNING
    assert head.token == row.token and head.running_since is not None
    assert (step.step_no, head.step_count) == (1, 1)
    assert [c.content for c in step.context] == ["task"] and step.output == ()
    assert await rows(store, "SELECT status FROM agent_inbox WHERE inbox_id = ?", row.inbox_id) == [
        (InboxStatus.CONSUMED,)
    ]
    assert await rows(store, "SELECT status FROM agent_steps") == [(AgentStepStatus.STARTED,)]
    assert await rows(store, "SELECT count(*) FROM execution_edges WHERE primitive = 'start'") == [
        (1,)
    ]
    # Started already: a second start is stale and writes nothing.
    before = await snapshot(store)
    with pytest.raises(StaleTurn):
        await store.run(turns.start_turn_step, row, 6)
    assert await snapshot(store) == before


async def test_apply_report_then_step_resumes_into_the_next_step(store):
    token = await suspended(store, "c1")
    await store.run(inbox.report_tool_result, A, "c1", b"<sum>3</sum>", failed=False)
    [row] = await store.run1(inbox.claim_due, A, 5)
    outcome = await store.run(tools.apply_report, row, then_step=6)
    head = await store.read(sql_head.read, A)
    assert outcome.kind == "applied" and outcome.resumed == head.token
    assert json.loads(outcome.reply_ref_json) == {"caller_thread": "task"}
    assert outcome.reply_ref_json == await store.read(turns.turn_reply_ref, outcome.resumed)
    step = outcome.step
    assert step is not None and step.head == head and step.step_no == head.step_count == 2
    assert [c.card_type for c in step.output] == [
        CardType.LLM_MESSAGE,
        CardType.TOOL_CALL,
        CardType.TOOL_RESULT,
    ]
    assert token.turn_epoch < head.turn_epoch


async def test_apply_report_without_then_step_opens_no_step(store):
    await suspended(store, "c1")
    await store.run(inbox.report_tool_result, A, "c1", b"<sum>3</sum>", failed=False)
    [row] = await store.run1(inbox.claim_due, A, 5)
    outcome = await store.run(tools.apply_report, row)
    assert outcome.step is None and outcome.reply_ref_json is not None
    assert (await store.read(sql_head.read, A)).step_count == 1


async def test_apply_report_opens_no_step_when_a_tool_ends_the_turn(store):
    await suspended(store, "c1", after="terminate")
    await store.run(inbox.report_tool_result, A, "c1", b"<sum>3</sum>", failed=False)
    [row] = await store.run1(inbox.claim_due, A, 5)
    outcome = await store.run(tools.apply_report, row, then_step=6)
    assert outcome.terminate_card_id is not None and outcome.step is None
    assert (await store.read(sql_head.read, A)).step_count == 1


async def test_suspend_says_how_many_reports_came_early(store):
    token = await running(store)
    deadline = clock_of(store).now() + 60
    step_id, _ = await store.run(turns.begin_step, token)
    calls = [ToolCallRecord("c1", "calc", "<add/>")]
    assert await store.run(tools.suspend, token, step_id, calls, [], deadline) == 0
    await store.run(inbox.report_tool_result, A, "c1", b"<sum>1</sum>", failed=False)
    [row] = await store.run1(inbox.claim_due, A, 5)
    token = (await store.run(tools.apply_report, row)).resumed
    step_id, _ = await store.run(turns.begin_step, token)
    await store.run(inbox.report_tool_result, A, "early", b"<sum>2</sum>", failed=False)  # deferred
    calls = [ToolCallRecord(c, "calc", "<add/>") for c in ("early", "late")]
    assert await store.run(tools.suspend, token, step_id, calls, [], deadline) == 1
    [row] = await store.run1(inbox.claim_due, A, 5)
    assert row.correlation_id == "early"


async def test_complete_step_writes_the_screened_record_with_the_step(store):
    token = await running(store)
    step_id, _ = await store.run(turns.begin_step, token)
    completion = LLMCompletion("calling", LLMUsage(10, 5, 15), cost=0.5, model="m", backend="b")
    refusal = NewCard(CardType.TOOL_REFUSED, "refused", {"to": "calc", "rule": "deny"})
    record = StepRecord(
        (
            DecisionRecord("calc", "add", "deny", "no-calc", "refused"),
            DecisionRecord("search", "query", "allow", "peers", "", "k1"),
        ),
        (refusal,),
    )
    stale = TurnToken(A, token.agent_turn_id, token.turn_epoch + 1)
    before = await snapshot(store)
    with pytest.raises(StaleTurn):
        await store.run(
            governance.complete_screened_step, stale, step_id, completion, _said("calling"), record
        )
    assert await snapshot(store) == before
    await store.run(
        governance.complete_screened_step, token, step_id, completion, _said("calling"), record
    )
    head = await store.read(sql_head.read, A)
    cards = await store.read(memory.cards, head.output_box_id)
    assert [(c.card_type, c.content) for c in cards] == [
        (CardType.LLM_MESSAGE, "calling"),
        (CardType.TOOL_REFUSED, "refused"),
    ]
    decided = await store.read(governance.turn_decisions, token.agent_turn_id)
    assert [(d.target, d.decision, d.rule, d.rate_key, d.step_id) for d in decided] == [
        ("calc", "deny", "no-calc", None, step_id),
        ("search", "allow", "peers", "k1", step_id),
    ]
    [(status, meta)] = await rows(
        store, "SELECT status, metadata FROM agent_steps WHERE step_id = ?", step_id
    )
    assert status == AgentStepStatus.COMPLETED
    meta = json.loads(meta)
    assert meta["llm_usage"]["total_tokens"] == 15 and meta["llm_response_cost"] == 0.5
    assert meta["policy"] == [
        {"target": "calc", "decision": "deny", "rule": "no-calc"},
        {"target": "search", "decision": "allow", "rule": "peers"},
    ]
    assert await store.read(governance.rate_window, "k1", 0.0) == [decided[1].at]


async def test_cards_inserted_in_one_batch_keep_their_order_past_a_chunk(store):
    token = await running(store)
    many = [NewCard(CardType.NOTE, f"note {i}") for i in range(INSERT_CHUNK * 2 + 3)]
    await store.run(turns.add_cards, token, many)
    head = await store.read(sql_head.read, A)
    assert [c.content for c in await store.read(memory.cards, head.output_box_id)] == [
        c.content for c in many
    ]


async def test_finish_with_its_last_step_writes_both_in_one_transaction(store):
    token = await running(store)
    step_id, _ = await store.run(turns.begin_step, token)
    tokens_before = (await store.read(sql_head.read, A)).context_tokens
    completion = LLMCompletion("done", LLMUsage(10, 5, 15), cost=0.5, model="m", backend="b")
    stale = TurnToken(A, token.agent_turn_id, token.turn_epoch + 1)
    before = await snapshot(store)
    with pytest.raises(StaleTurn):
        await store.run(turn_end.finish,
            stale, "succeeded", "done", {}, b"<a/>", step_id=step_id, completion=completion,
            cards=_said("done"),
        )  # fmt: skip
    assert await snapshot(store) == before
    fin = await store.run(turn_end.finish,
        token, "succeeded", "done", {}, b"<a/>", step_id=step_id, completion=completion,
        cards=_said("done"),
    )  # fmt: skip
    cards = await store.read(memory.cards, fin.output_box_id)
    assert [(c.card_type, c.content) for c in cards] == [
        (CardType.LLM_MESSAGE, "done"),
        (CardType.DELIVERABLE, "done"),
    ]
    assert fin.deliverable_card_id == cards[-1].card_id
    head = await store.read(sql_head.read, A)
    assert head.status == HeadStatus.IDLE and head.context_tokens > tokens_before
    [(status, total, meta)] = await rows(
        store, "SELECT status, total_tokens, metadata FROM agent_steps WHERE step_id = ?", step_id
    )
    assert (status, total) == (AgentStepStatus.COMPLETED, 15)
    assert json.loads(meta)["llm_response_cost"] == 0.5
