"""Store-level properties of the SQLite backend and the state machines: migrations, the
file lock, random sequences. The backend-neutral contract is test_store_contract.py."""

import trio
from agents_fakes import make_harness, result, task
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentserver.agents.clock import ManualClock
from agentserver.agents.errors import IllegalTransition
from agentserver.agents.store.base import ToolCallRecord
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.sql import inbox, tools, turn_end, turns
from agentserver.agents.store.sqlite_store import SCHEMA_VERSION, SqliteAgentStore
from agentserver.agents.store.states import (
    HEAD_TRANSITIONS,
    INBOX_TRANSITIONS,
    HeadEvent,
    HeadStatus,
    InboxEvent,
    InboxStatus,
    head_transition,
    inbox_transition,
)


def test_store_is_created_in_wal_and_reopened_without_migrating_twice(tmp_path):
    s = SqliteAgentStore.open(tmp_path / "x" / "a.db")
    assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    s.close()
    s = SqliteAgentStore.open(tmp_path / "x" / "a.db")
    versions = s._db.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
    assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)]
    s.close()


@given(st.lists(st.sampled_from(list(HeadEvent)), max_size=40))
def test_random_head_walks_keep_the_invariants(events):
    state, epoch, leases = HeadStatus.IDLE, 0, 0
    for event in events:
        try:
            t = head_transition(state, event)
        except IllegalTransition:
            assert (state, event) not in HEAD_TRANSITIONS
            continue
        epoch += t.bumps_epoch
        leases += event == HeadEvent.LEASE
        state = HeadStatus(t.target)
        assert epoch >= leases  # every lease moved the epoch; nothing moves it back
        if state != HeadStatus.IDLE:  # any active Turn can always be ended
            assert head_transition(state, HeadEvent.FORCE_END).target == HeadStatus.IDLE
        else:  # the only way out of idle is a lease
            assert [e for (s0, e) in HEAD_TRANSITIONS if s0 == state] == [HeadEvent.LEASE]


@given(st.lists(st.sampled_from(list(InboxEvent)), max_size=20))
def test_inbox_terminal_states_are_final(events):
    state = InboxStatus.QUEUED
    for event in events:
        try:
            state = InboxStatus(inbox_transition(state, event).target)
        except IllegalTransition:
            assert (state, event) not in INBOX_TRANSITIONS
    if state in (InboxStatus.CONSUMED, InboxStatus.ERROR, InboxStatus.SKIPPED):
        assert not [k for k in INBOX_TRANSITIONS if k[0] == state]


OPS = st.lists(
    st.sampled_from(["enqueue", "pump", "result", "dup", "tick", "advance", "stop"]),
    min_size=1,
    max_size=25,
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS)
def test_random_event_sequences_keep_the_invariants(tmp_path_factory, ops):
    trio.run(_random_run, tmp_path_factory.mktemp("h"), ops)


async def _random_run(path, ops):
    def script(req):
        last = req.messages[-1].content
        if "Result from" in last or "failed" in last:
            return "done"
        return "<add xmlns='urn:calc'><a>1</a></add>"

    h = make_harness(path, script, clock=ManualClock(), dispatch_timeout_s=5, max_running_s=50)
    enqueued = 0
    for op in ops:
        if op == "enqueue":
            await h.rt.enqueue("assistant", task(str(enqueued)), enqueued)
            enqueued += 1
        elif op == "pump":
            await h.pump()
        elif op in ("result", "dup") and h.tools.calls:
            sub = h.tools.calls[-1][0] if op == "result" else h.tools.calls[0][0]
            await h.rt.report_tool_result("assistant", sub, result("3"))
        elif op == "tick":
            await h.rt.watchdog.tick()
        elif op == "advance":
            h.clock.advance(20)
        elif op == "stop":
            await h.rt.stop("assistant")
        head = await h.rt.store.read(sql_head.read, "assistant")
        assert (head.status == "idle") == (head.agent_turn_id is None)
        waiting = h.sql(
            "SELECT count(*) FROM turn_waiting_tools WHERE agent_turn_id = ? AND "
            "turn_epoch = ? AND status = 'waiting'",
            head.agent_turn_id,
            head.turn_epoch,
        )[0][0]
        if head.status == "suspended":
            assert waiting == head.waiting_tool_count > 0
        else:
            assert head.waiting_tool_count == 0
    # drain: time passes, everything ends
    for _ in range(12):
        h.clock.advance(60)
        await h.rt.watchdog.tick()
        await h.pump()
    events = h.task_events()
    turn_ids = [e.agent_turn_id for e in events]
    assert len(turn_ids) == len(set(turn_ids)) == enqueued  # exactly one per Enqueue
    assert len(h.replies.sent) == enqueued
    assert sorted(r[0] for r in h.replies.sent) == list(range(enqueued))
    per_turn = h.sql(
        "SELECT agent_turn_id, count(*) FROM cards WHERE card_type = 'task.deliverable' "
        "GROUP BY agent_turn_id"
    )
    assert len(per_turn) == enqueued and all(n == 1 for _, n in per_turn)
    await h.rt.aclose()


def test_store_file_is_owned_by_one_process_at_a_time(tmp_path):
    import pytest

    from agentserver.agents.errors import StoreInUse
    from agentserver.agents.store.sqlite_store import SqliteAgentStore

    path = tmp_path / "agents.sqlite3"
    first = SqliteAgentStore.open(path)
    with pytest.raises(StoreInUse, match="in use by another agentserver process"):
        SqliteAgentStore.open(path)
    first.close()
    second = SqliteAgentStore.open(path)  # released on close
    second.close()
    second.close()  # idempotent


def test_the_store_sql_names_statuses_only_through_their_declarations():
    """Every status the store writes is declared in states.py; its SQL uses the constants
    (a quoted literal in a query would drift from the tables and the docs)."""
    from pathlib import Path

    from agentserver.agents.store import sql
    from agentserver.agents.store.states import STORE_STATUSES, MessageType

    declared = [HeadStatus, InboxStatus, MessageType, *STORE_STATUSES.values()]
    values = {str(v) for enum in declared for v in enum}
    for path in sorted(Path(sql.__file__).parent.glob("*.py")):
        text = path.read_text()
        assert not [v for v in values if f"'{v}'" in text], path.name


async def test_a_v4_file_with_a_turn_in_flight_opens_and_the_turn_goes_on(tmp_path):
    """Files in the field are at schema v4 (the split store kept the schema): one opens,
    is migrated to the current version (v5 adds the step log), and a Turn suspended in
    it resumes and ends."""
    import sqlite3

    from agentserver.agents.store.sql.schema import ddl

    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version in range(1, 5):
        for statement in ddl(version, "sqlite"):
            conn.execute(statement)
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    conn.commit()
    conn.close()
    clock = ManualClock()
    store = SqliteAgentStore.open(path, clock=clock)
    await store.run(inbox.enqueue_turn, "a", b"task", {"caller_thread": "t"})
    [row] = await store.run1(inbox.claim_due, "a", 5)
    token = await store.run(turns.start_turn, row)
    step_id, _ = await store.run(turns.begin_step, token)
    call = ToolCallRecord("c1", "calc", "<add/>")
    await store.run(tools.suspend, token, step_id, [call], [], clock.now() + 60)
    store.close()

    store = SqliteAgentStore.open(path, clock=clock)
    versions = store._db.execute("SELECT version FROM schema_version").fetchall()
    assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)] and SCHEMA_VERSION >= 7
    await store.run(inbox.report_tool_result, "a", "c1", b"3", failed=False)
    [report] = await store.run1(inbox.claim_due, "a", 5)
    resumed = (await store.run(tools.apply_report, report)).resumed
    assert resumed is not None
    fin = await store.run(turn_end.finish, resumed, "succeeded", "3", {}, b"<a/>")
    assert (
        fin.reply is not None and (await store.read(sql_head.read, "a")).status == HeadStatus.IDLE
    )
    store.close()
