"""The web console's sessions in the agents' store (issue 44,
``agents/store/sql/ui_sessions.py``, migration 15), on both engines: a session is read
back until its expiry in store time (the store's clock, moved by hand), a sign-out
deletes it, each sign-in sweeps expired rows and keeps a client's newest sessions only,
and a store made at schema 14 gains the table when opened.

Backends: ``sqlite`` always; ``postgresql`` when a server is reachable (``pg_url`` skips).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from test_memory_by_reference import _open, execute, one

from agentserver.agents.store.sql import ui_sessions
from agentserver.agents.store.sql.schema import SCHEMA_VERSION
from agentserver.agents.store.sql_store import SqlAgentStore
from agentserver.core.handshake import Credential, Identity
from agentserver.http.auth import HttpAuth
from agentserver.http.ui.sessions import StoreSessionTable, UiSessions


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


def advance(store: SqlAgentStore, seconds: float) -> None:
    store.env.clock.advance(seconds)  # type: ignore[attr-defined]  # a ManualClock


async def test_a_session_lives_until_its_expiry_in_store_time(store):
    expires = await store.run(ui_sessions.put_session, "h1", "alice", "p1", 100.0)
    assert expires == store.env.clock.now() + 100.0
    assert await store.read(ui_sessions.get_session, "h1") == ("alice", "p1")
    assert await store.read(ui_sessions.get_session, "nope") is None
    advance(store, 99.5)
    assert await store.read(ui_sessions.get_session, "h1") == ("alice", "p1")
    advance(store, 0.5)
    assert await store.read(ui_sessions.get_session, "h1") is None
    # Expired rows stay until a sign-in sweeps them.
    assert await one(store, "SELECT count(*) FROM ui_sessions") == 1
    await store.run(ui_sessions.put_session, "h2", "bob", "p2", 100.0)
    assert await one(store, "SELECT count(*) FROM ui_sessions") == 1
    assert await store.read(ui_sessions.get_session, "h2") == ("bob", "p2")


async def test_signing_out_deletes_the_row(store):
    await store.run(ui_sessions.put_session, "h1", "alice", "p1", 100.0)
    await store.run(ui_sessions.put_session, "h2", "alice", "p2", 100.0)
    assert await store.run1(ui_sessions.delete_session, "h1") is True
    assert await store.read(ui_sessions.get_session, "h1") is None
    assert await store.run1(ui_sessions.delete_session, "h1") is False
    assert await store.read(ui_sessions.get_session, "h2") == ("alice", "p2")


async def test_a_client_keeps_its_newest_sessions_only(store):
    cap = ui_sessions.MAX_PER_CLIENT
    for i in range(cap + 3):
        await store.run(ui_sessions.put_session, f"a{i:03}", "alice", "p", 1000.0)
        advance(store, 1.0)
    await store.run(ui_sessions.put_session, "b", "bob", "p", 1000.0)
    assert await one(store, "SELECT count(*) FROM ui_sessions WHERE client = 'alice'") == cap
    assert [await store.read(ui_sessions.get_session, f"a{i:03}") for i in range(3)] == [None] * 3
    assert await store.read(ui_sessions.get_session, f"a{cap + 2:03}") == ("alice", "p")
    assert await store.read(ui_sessions.get_session, "b") == ("bob", "p")


async def test_ui_sessions_on_the_store_resolve_to_the_clients_identity(store):
    auth = HttpAuth({"alice": Credential("alice-token", frozenset({"echo"}))})
    ui = UiSessions(StoreSessionTable(store), auth, lifetime_s=60.0)
    session = await ui.create(Identity("alice", frozenset({"echo"})))
    assert await ui.resolve(session) == Identity("alice", frozenset({"echo"}))
    # Only a hash of the id and a proof are stored: neither the id nor the token.
    stored = str(await one(store, "SELECT id_hash || ' ' || proof FROM ui_sessions"))
    assert session not in stored and "alice-token" not in stored
    advance(store, 60.0)
    assert await ui.resolve(session) is None
    again = await ui.create(Identity("alice", frozenset({"echo"})))
    assert await ui.revoke(again) is True
    assert await ui.resolve(again) is None


async def test_a_store_at_schema_14_gains_the_sessions_table(kind, request, tmp_path):
    s = await _open(kind, request, tmp_path)
    try:
        # Back to 14: migration 15 (this table), 16 (the budget holds' owners) and 17 (the
        # tombstones' sender) undone.
        await execute(
            s,
            "DROP TABLE ui_sessions",
            "DROP INDEX budget_holds_turn",
            "ALTER TABLE budget_holds DROP COLUMN agent_id",
            "ALTER TABLE budget_holds DROP COLUMN agent_turn_id",
            "ALTER TABLE budget_holds DROP COLUMN turn_epoch",
            "ALTER TABLE budget_holds DROP COLUMN step_id",
            "ALTER TABLE pruned_turns DROP COLUMN sender",
            # (and 18, the agent versions)
            "ALTER TABLE agent_state_head DROP COLUMN turn_version",
            "ALTER TABLE agent_state_head DROP COLUMN turn_pin",
            "ALTER TABLE agent_inbox DROP COLUMN version",
            "ALTER TABLE agent_steps DROP COLUMN version",
            "DROP TABLE agent_versions",
            "DELETE FROM schema_version WHERE version >= 15",
        )
        assert await one(s, "SELECT max(version) FROM schema_version") == 14
    finally:
        await s.aclose()
    s = await _open(kind, request, tmp_path)
    try:
        assert await one(s, "SELECT max(version) FROM schema_version") == SCHEMA_VERSION == 18
        await s.run(ui_sessions.put_session, "h", "alice", "p", 10.0)
        assert await s.read(ui_sessions.get_session, "h") == ("alice", "p")
    finally:
        await s.aclose()
