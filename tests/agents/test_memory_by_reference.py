"""A conversation's memory is written once (issue 38, agents/store/sql/memory.py): a new
Turn's context box names the boxes its conversation's last Turn left instead of copying
their cards; what its model is shown, its record, its fork and the conversation's cards
are the same as with the copies; pruning an earlier Turn copies the memory once into the
Turn that named it; a store made before migration 14 continues its conversations.

Backends: ``sqlite`` always; ``postgresql`` when a server is reachable (``pg_url`` skips).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentserver.agents.clock import ManualClock
from agentserver.agents.profile.retention import AgentRetention, RetentionSettings
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import (
    CardType,
    NewCard,
    StepStart,
    TaskStatus,
    ToolCallRecord,
)
from agentserver.agents.store.pruner import Pruner
from agentserver.agents.store.sql import (
    conversations,
    forks,
    inbox,
    memory,
    turn_end,
    turns,
)
from agentserver.agents.store.sql import record as sql_record
from agentserver.agents.store.sql import replies as sql_replies
from agentserver.agents.store.sql import tools as sql_tools
from agentserver.agents.store.sql.schema import SCHEMA_VERSION
from agentserver.agents.store.sql_store import SqlAgentStore

A = "agent"
DAY = 86400.0
ONE_DAY = RetentionSettings(
    defaults=AgentRetention(finished_tasks_s=DAY, keep_last=0, events_s=None),
    step_log_s=None,
)


async def _open(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> SqlAgentStore:
    clock = ManualClock(1_000_000.0)
    settings = StoreSettings(path=tmp_path / "agents.sqlite3", retention=ONE_DAY)
    if kind == "sqlite":
        from agentserver.agents.store.sqlite_store import SqliteAgentStore

        return SqliteAgentStore.open(settings.path, clock=clock, settings=settings)
    from agentserver.agents.store.pg.store import PostgresAgentStore

    url = request.getfixturevalue("pg_url")  # skips when no server is reachable
    opened = PostgresAgentStore.open(url, clock=clock, settings=settings)
    return await opened if inspect.isawaitable(opened) else opened


@pytest.fixture(params=["sqlite", "postgresql"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def store(
    kind: str, request: pytest.FixtureRequest, tmp_path
) -> AsyncIterator[SqlAgentStore]:
    s = await _open(kind, request, tmp_path)
    try:
        yield s
    finally:
        await s.aclose()


async def one(store: SqlAgentStore, sql: str, *params: Any) -> Any:
    def read(tx: Any, env: Any) -> Any:
        row = tx.one(sql, params)
        return row[0] if row else None

    return await store.read(read)


async def execute(store: SqlAgentStore, *statements: str) -> None:
    def run(tx: Any, env: Any) -> None:
        for s in statements:
            tx.execute(s)

    await store.run(run)


async def step(store: SqlAgentStore, thread: str) -> StepStart:
    """A Turn of conversation ``alice`` on ``thread``, leased and at its first step."""
    await store.run(
        inbox.enqueue_turn, A, thread.encode(), {"caller_thread": thread}, conversation="alice"
    )
    [row] = await store.run1(inbox.claim_due, A, 5)
    started = await store.run(turns.start_turn_step, row, 10)
    assert started.step_id is not None
    return started


async def turn(store: SqlAgentStore, thread: str) -> StepStart:
    """:func:`step`, then the step's card and the Turn's end (its reply sent)."""
    started = await step(store, thread)
    token = started.head.token
    assert token is not None and started.step_id is not None
    said = NewCard(CardType.LLM_MESSAGE, f"said {thread}", {"step_id": started.step_id})
    await store.run(turns.complete_step, token, started.step_id, None, [said])
    await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
    await store.run1(sql_replies.mark_reply_sent, token.agent_turn_id)
    return started


def texts(cards: Any) -> list[str]:
    return [c.content for c in cards]


async def test_a_turn_names_its_memory_and_sees_it_whole(store):
    await turn(store, "t1")
    await turn(store, "t2")
    cards_before = await one(store, "SELECT count(*) FROM cards")
    third = await step(store, "t3")
    # What its model is shown: the conversation so far (no deliverable), then its task.
    assert texts(third.context) == ["t1", "said t1", "t2", "said t2", "t3"]
    tokens = [
        await one(store, "SELECT tokens FROM cards WHERE card_id = ?", c.card_id)
        for c in third.context
    ]
    assert third.head.context_tokens == sum(int(t) for t in tokens)
    # ...of which it wrote one card: the memory is named, not copied.
    assert await one(store, "SELECT count(*) FROM cards") == cards_before + 1
    ctx = third.head.context_box_id
    assert await one(store, "SELECT count(*) FROM cards WHERE box_id = ?", ctx) == 1
    assert await one(store, "SELECT memory_of FROM boxes WHERE box_id = ?", ctx) is not None
    assert texts(await store.read(memory.cards, ctx)) == texts(third.context)
    token = third.head.token
    assert token is not None
    opened = await store.run(turns.open_step, token, 10)  # the shared (not one-trip) read too
    assert texts(opened.context) == texts(third.context)


async def test_record_fork_and_conversation_read_through_the_memory(store):
    await turn(store, "t1")
    await turn(store, "t2")
    record = await store.read(sql_record.turn_record, A, "t2")
    assert record is not None
    assert [c["content"] for c in record["cards"]] == ["t1", "said t1", "t2", "said t2", "done"]
    assert texts(await store.read(conversations.conversation_cards, A, "alice")) == [
        "t1",
        "said t1",
        "t2",
        "said t2",
    ]
    # A started Turn's inbox row gives its payload up: its task card holds it.
    consumed = "SELECT count(*) FROM agent_inbox WHERE message_type = 'turn' AND payload = ?"
    assert await one(store, consumed, b"") == 2
    assert record["task"] == "t2"
    forked = await store.run(forks.fork, A, "t2", 1)
    assert forked["cards"] == 4 and forked["task"] == "t2"
    assert texts(await store.read(conversations.conversation_cards, A, forked["conversation"])) == [
        "t1",
        "said t1",
        "t2",
        "said t2",
    ]


async def test_pruning_an_earlier_turn_copies_the_memory_once(store):
    await turn(store, "t1")
    await turn(store, "t2")
    await turn(store, "t3")
    before = await store.read(sql_record.turn_record, A, "t3")
    store.env.clock.advance(2 * DAY)  # type: ignore[attr-defined]
    report = await Pruner(store, ONE_DAY, (A,), pause_s=0).prune_once()
    assert report.tasks == 2  # t3 is the conversation's memory: kept
    # t3's record and the conversation are whole: t3's context box names a copy now.
    assert await store.read(sql_record.turn_record, A, "t3") == before
    seen = texts(await store.read(conversations.conversation_cards, A, "alice"))
    assert seen == ["t1", "said t1", "t2", "said t2", "t3", "said t3"]
    assert await one(store, "SELECT count(*) FROM boxes WHERE kind = 'memory'") == 1
    fourth = await step(store, "t4")
    assert texts(fourth.context) == [*seen, "t4"]


async def test_a_store_from_before_migration_13_continues_its_conversations(
    kind, request, tmp_path
):
    # A store at schema 12: boxes without their memory, a Turn whose context box holds
    # copies (as every Turn's did), the conversation pointing at its boxes.
    s = await _open(kind, request, tmp_path)
    try:
        await execute(
            s,
            "DROP INDEX boxes_memory",
            "ALTER TABLE boxes DROP COLUMN memory_of",
            "ALTER TABLE boxes DROP COLUMN memory_out",
            "DROP INDEX agent_inbox_caller",
            "ALTER TABLE agent_inbox DROP COLUMN caller",
            "DROP INDEX pruned_turns_age",
            "DROP TABLE ui_sessions",
            # (and migrations 15 to 18, which run again after 14)
            "DROP INDEX budget_holds_turn",
            "ALTER TABLE budget_holds DROP COLUMN agent_id",
            "ALTER TABLE budget_holds DROP COLUMN agent_turn_id",
            "ALTER TABLE budget_holds DROP COLUMN turn_epoch",
            "ALTER TABLE budget_holds DROP COLUMN step_id",
            "ALTER TABLE pruned_turns DROP COLUMN sender",
            "ALTER TABLE agent_state_head DROP COLUMN turn_version",
            "ALTER TABLE agent_state_head DROP COLUMN turn_pin",
            "ALTER TABLE agent_inbox DROP COLUMN version",
            "ALTER TABLE agent_steps DROP COLUMN version",
            "DROP TABLE agent_versions",
            "DELETE FROM schema_version WHERE version >= 14",
            "INSERT INTO boxes (box_id, agent_id, agent_turn_id, kind, created_at) VALUES "
            "('c1', 'agent', 'old', 'context', 1), ('o1', 'agent', 'old', 'output', 1)",
            "INSERT INTO cards (card_id, box_id, agent_turn_id, card_type, content, created_at, "
            "tokens) VALUES ('k0', 'c1', 'old', 'llm.message', 'copied earlier', 1, 3), "
            "('k1', 'c1', 'old', 'task.input', 'old task', 1, 2), "
            "('k2', 'o1', 'old', 'llm.message', 'old said', 1, 2), "
            "('k3', 'o1', 'old', 'task.deliverable', 'old done', 1, 0)",
            "INSERT INTO conversations (agent_id, conversation, context_box_id, "
            "output_box_id, updated_at) VALUES ('agent', 'alice', 'c1', 'o1', 1)",
        )
    finally:
        await s.aclose()
    s = await _open(kind, request, tmp_path)
    try:
        assert await one(s, "SELECT max(version) FROM schema_version") == SCHEMA_VERSION
        started = await step(s, "t1")
        assert texts(started.context) == ["copied earlier", "old task", "old said", "t1"]
        assert started.head.context_tokens >= 7
        assert await one(s, "SELECT count(*) FROM agent_inbox WHERE caller IS NULL") == 1
        assert texts(await s.read(conversations.conversation_cards, A, "alice")) == [
            "copied earlier",
            "old task",
            "old said",
        ]
    finally:
        await s.aclose()


@pytest.mark.parametrize("then_step", [None, 10])
async def test_a_tool_result_is_kept_once_as_its_card(store, then_step):
    started = await step(store, "t1")
    token = started.head.token
    assert token is not None and started.step_id is not None
    calls = [ToolCallRecord("c1", "calc", "<add/>", "suspend")]
    await store.run(sql_tools.suspend, token, started.step_id, calls, [], resume_deadline=1e12)
    inbox_id = await store.run(inbox.report_tool_result, A, "c1", b"<sum>3</sum>", failed=False)
    [row] = await store.run1(inbox.claim_due, A, 5)
    assert (await store.run(sql_tools.apply_report, row, then_step=then_step)).kind == "applied"
    # The consumed report's payload went: its tool.result card holds it.
    payload = await one(store, "SELECT payload FROM agent_inbox WHERE inbox_id = ?", inbox_id)
    assert bytes(payload) == b""
    result = await one(
        store,
        "SELECT c.content FROM turn_waiting_tools w JOIN cards c "
        "ON c.card_id = w.result_card_id WHERE w.tool_call_id = ?",
        "c1",
    )
    assert result == "<sum>3</sum>"


async def test_a_forks_boxes_go_after_the_turn_naming_them_gets_a_copy(store):
    await turn(store, "t1")
    forked = await store.run(forks.fork, A, "t1", 1)
    conversation = forked["conversation"]

    async def on_fork(thread: str) -> StepStart:
        ref = {"caller_thread": thread}
        await store.run(inbox.enqueue_turn, A, thread.encode(), ref, conversation=conversation)
        [row] = await store.run1(inbox.claim_due, A, 5)
        started = await store.run(turns.start_turn_step, row, 10)
        token = started.head.token
        assert token is not None and started.step_id is not None
        said = NewCard(CardType.LLM_MESSAGE, f"said {thread}", {"step_id": started.step_id})
        await store.run(turns.complete_step, token, started.step_id, None, [said])
        await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
        await store.run1(sql_replies.mark_reply_sent, token.agent_turn_id)
        return started

    first = await on_fork("f1")
    assert texts(first.context) == ["t1", "said t1", "f1"]
    await on_fork("f2")  # the fork's conversation moves on: its own boxes are orphans
    before = await store.read(sql_record.turn_record, A, "f1")
    store.env.clock.advance(2 * DAY)  # type: ignore[attr-defined]
    keep = RetentionSettings(defaults=AgentRetention(DAY, 2, None), step_log_s=None)
    report = await Pruner(store, keep, (A,), pause_s=0).prune_once()
    assert report.rows["boxes"] > 0  # the fork's boxes went
    fork_boxes = "SELECT count(*) FROM boxes WHERE agent_turn_id = ?"
    assert await one(store, fork_boxes, conversation) == 0
    assert (
        await store.read(sql_record.turn_record, A, "f1") == before
    )  # whole: it named a copy first
