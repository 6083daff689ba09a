"""Agent versions in the store (issue 49, agents/store/sql/versions.py and
agents/store/served.py): what a Turn records, which rows a process claims by the
versions it serves, the newest live version, a named version redefined, ``turns
migrate``, the tool calls a draining process waits for. Both stores (PostgreSQL when a
server is reachable: ``pg_url`` skips otherwise).

One store stands for several processes: its ``env.served`` is set as each would have it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from agentserver.agents.clock import ManualClock
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import NewCard, ToolCallRecord, TurnToken
from agentserver.agents.store.served import ServedVersions
from agentserver.agents.store.sql import inbox, tools, turns, versions, views
from agentserver.agents.store.sql_store import SqlAgentStore

A = "agent"


def served(version: str, *, pinned: bool = True, **kw) -> ServedVersions:
    return ServedVersions(
        versions={A: version},
        digests={A: f"digest-{version}"},
        pinned=frozenset({A}) if pinned else frozenset(),
        **kw,
    )


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[SqlAgentStore]:
    clock = ManualClock()
    settings = StoreSettings(path=tmp_path / "agents.sqlite3")
    if request.param == "sqlite":
        from agentserver.agents.store.sqlite_store import SqliteAgentStore

        s: SqlAgentStore = SqliteAgentStore.open(
            settings.path, clock=clock, settings=settings, served=served("v1")
        )
    else:
        from agentserver.agents.store.pg.store import PostgresAgentStore

        url = request.getfixturevalue("pg_url")
        s = PostgresAgentStore.open(url, clock=clock, settings=settings, served=served("v1"))
    try:
        yield s
    finally:
        await s.aclose()


async def start_waiting(store: SqlAgentStore, text: str = "task") -> TurnToken:
    """A Turn started on the store's version, suspended on one call to ``calc``."""
    await store.run(inbox.enqueue_turn, A, text.encode(), {"caller_thread": text})
    [row] = await store.run1(inbox.claim_due, A, 5)
    step = await store.run(turns.start_turn_step, row, 8)
    token = step.head.token
    assert token is not None and step.step_id is not None
    calls = [ToolCallRecord(f"call-{text}", "calc", "<add/>")]
    await store.run(tools.suspend, token, step.step_id, calls, [NewCard("sys.note", "x")], 1e12)
    return token


async def head_of(store: SqlAgentStore) -> tuple:
    def read(tx, env):
        return tx.one(
            "SELECT status, turn_version, turn_pin FROM agent_state_head WHERE agent_id = ?",
            (A,),
        )

    return await store.read(read)


async def test_a_turn_records_its_version_and_pin_its_task_and_steps_too(store):
    token = await start_waiting(store)
    assert await head_of(store) == ("suspended", "v1", "v1")

    def read(tx, env):
        return (
            tx.all("SELECT version FROM agent_inbox WHERE message_type = 'turn'"),
            tx.all(
                "SELECT version FROM agent_steps WHERE agent_turn_id = ?", (token.agent_turn_id,)
            ),
        )

    assert await store.read(read) == ([("v1",)], [("v1",)])


async def test_a_pinned_turn_is_claimed_only_where_its_version_is_served(store):
    await start_waiting(store)
    await store.run(inbox.report_tool_result, A, "call-task", b"<sum/>", False)
    # A process serving v2 (the newest, alone) neither lists the agent nor claims its row.
    store.env.served = served("v2")
    assert await store.read(inbox.due_agents, 10) == []
    assert await store.run1(inbox.claim_due, A, 5) == []
    # A v2 process whose agent is not pinned leaves it too: the pin is the Turn's.
    store.env.served = served("v2", pinned=False)
    assert await store.read(inbox.due_agents, 10) == []
    assert await store.run1(inbox.claim_due, A, 5) == []
    # v1 takes it.
    store.env.served = served("v1")
    assert await store.read(inbox.due_agents, 10) == [A]
    [row] = await store.run1(inbox.claim_due, A, 5)
    assert row.message_type == "tool_result"


async def test_new_work_is_claimed_by_the_newest_version_only_and_never_while_draining(store):
    await store.run(inbox.enqueue_turn, A, b"t", {"caller_thread": "t"})
    for taker in (
        served("v1", newest=frozenset()),  # an older version's process
        served("v1", draining=True),  # draining
    ):
        store.env.served = taker
        assert await store.read(inbox.due_agents, 10) == [], taker
        assert await store.run1(inbox.claim_due, A, 5) == [], taker
    store.env.served = served("v1", newest=frozenset({A}))
    assert await store.read(inbox.due_agents, 10) == [A]
    [row] = await store.run1(inbox.claim_due, A, 5)
    assert row.version == "v1"  # the version it was queued on


def test_the_newest_version_is_the_one_first_seen_last():
    seen = {(A, "v1"): 10.0, (A, "v2"): 20.0, (A, "v3"): 5.0}
    assert versions.newest({A: {"v1", "v2"}}, seen) == {A: "v2"}
    # A rollback's old version, served alone again, is the newest live one.
    assert versions.newest({A: {"v1"}}, seen) == {A: "v1"}
    assert versions.newest({A: {"v1", "v3"}}, seen) == {A: "v1"}
    assert versions.newest({A: set()}, seen) == {}


async def test_a_named_version_redefined_is_reported_once_recorded(store):
    assert await store.run(versions.register) == []
    store.env.served = ServedVersions(versions={A: "v1"}, digests={A: "other"})
    [changed] = await store.run(versions.register)
    assert (changed.agent_id, changed.version, changed.was, changed.now) == (
        A,
        "v1",
        "digest-v1",
        "other",
    )
    assert "was defined differently before" in changed.text()
    assert await store.read(versions.recorded) == {(A, "v1"): "other"}


async def test_migrate_moves_the_turns_of_a_version_and_keeps_them_pinned(store):
    token = await start_waiting(store)
    assert await store.run(versions.migrate_turns, A, "v0", "v2") == []  # none on v0
    assert await store.run(versions.migrate_turns, A, "v1", "v2") == [token.agent_turn_id]
    assert await head_of(store) == ("suspended", "v2", "v2")
    [agent] = await store.read(views.agents, [A])
    assert (agent["active_turn"]["version"], agent["active_turn"]["pinned"]) == ("v2", True)


async def test_calls_in_flight_count_until_their_report_arrives(store):
    await start_waiting(store)
    assert await store.read(versions.calls_in_flight, None) == 1
    await store.run(inbox.report_tool_result, A, "call-task", b"<sum/>", False)
    assert await store.read(versions.calls_in_flight, None) == 0
