"""Retention (issue 38) on both stores: what the pruner removes, and each promise it never
breaks (agents/store/sql/prune.py): an unacknowledged reply, a pending approval, a queued,
running or suspended Turn, an idempotency record in its window, a conversation's memory.
Two pruners at once (the lease), the ``pruned`` answer of the reads, SQLite's pages.

Backends: ``sqlite`` always; ``postgresql`` when a server is reachable (``pg_url`` skips).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio

from agentserver.agents.clock import ManualClock
from agentserver.agents.errors import ForkRefused, TurnPruned
from agentserver.agents.profile.retention import AgentRetention, RetentionSettings
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store import outbox, step_log
from agentserver.agents.store.base import CardType, NewCard, TaskStatus, ToolCallRecord, TurnToken
from agentserver.agents.store.pruner import Pruner
from agentserver.agents.store.sql import (
    a2a,
    conversations,
    forks,
    governance,
    head,
    record,
    replies,
    tools,
    turn_end,
    turns,
    views,
)
from agentserver.agents.store.sql import inbox as sql_inbox
from agentserver.agents.store.sql import prune as sql_prune
from agentserver.agents.store.sql_store import SqlAgentStore
from agentserver.steps.log import StepRow

A = "agent"
DAY = 86400.0
#: Retention of one day, nothing kept by count.
ONE_DAY = RetentionSettings(
    defaults=AgentRetention(finished_tasks_s=DAY, keep_last=0, events_s=DAY),
    step_log_s=DAY,
    acknowledged_replies_s=DAY,
)


#: Migration 18 (agent versions) undone, for a test that takes a store back before it.
UNDO_18 = (
    "ALTER TABLE agent_state_head DROP COLUMN turn_version",
    "ALTER TABLE agent_state_head DROP COLUMN turn_pin",
    "ALTER TABLE agent_inbox DROP COLUMN version",
    "ALTER TABLE agent_steps DROP COLUMN version",
    "DROP TABLE agent_versions",
)


def _settings(tmp_path) -> StoreSettings:
    return StoreSettings(path=tmp_path / "agents.sqlite3", retention=ONE_DAY)


async def _open(kind: str, request: pytest.FixtureRequest, tmp_path) -> SqlAgentStore:
    clock = ManualClock(1_000_000.0)
    settings = _settings(tmp_path)
    if kind == "sqlite":
        from agentserver.agents.store.sqlite_store import SqliteAgentStore

        return SqliteAgentStore.open(settings.path, clock=clock, settings=settings)
    from agentserver.agents.store.pg.store import PostgresAgentStore

    url = request.getfixturevalue("pg_url")  # skips when no server is reachable
    opened = PostgresAgentStore.open(url, clock=clock, settings=settings)
    return await opened if inspect.isawaitable(opened) else opened


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[SqlAgentStore]:
    s = await _open(request.param, request, tmp_path)
    try:
        yield s
    finally:
        await s.aclose()


def clock_of(store: SqlAgentStore) -> ManualClock:
    clock = store.env.clock
    assert isinstance(clock, ManualClock)
    return clock


async def count(store: SqlAgentStore, sql: str, *params: Any) -> int:
    def read(tx: Any, env: Any) -> int:
        row = tx.one(sql, params)
        return int(row[0]) if row else 0

    return await store.read(read)


async def running(store: SqlAgentStore, thread: str, **kw: Any) -> TurnToken:
    await store.run(sql_inbox.enqueue_turn, A, thread.encode(), {"caller_thread": thread}, **kw)
    [row] = await store.run1(sql_inbox.claim_due, A, 5)
    return await store.run(turns.start_turn, row)


async def finished(store: SqlAgentStore, thread: str, *, sent: bool = True, **kw: Any) -> str:
    """A Turn run to its end with one step and a card; its reply sent unless ``sent``."""
    token = await running(store, thread, **kw)
    step_id, _ = await store.run(turns.begin_step, token)
    await store.run(
        turns.complete_step, token, step_id, None, [NewCard(CardType.LLM_MESSAGE, "said")]
    )
    await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
    if sent:
        await store.run1(replies.mark_reply_sent, token.agent_turn_id)
    return token.agent_turn_id


async def prune(store: SqlAgentStore, settings: RetentionSettings = ONE_DAY) -> Any:
    return await Pruner(store, settings, (A,), pause_s=0).prune_once()


async def turn_rows(store: SqlAgentStore, turn: str) -> int:
    total = 0
    for table in ("agent_inbox", "agent_steps", "boxes", "execution_edges", "agent_replies"):
        total += await count(store, f"SELECT count(*) FROM {table} WHERE agent_turn_id = ?", turn)
    return total


async def test_an_old_finished_task_goes_whole_and_reads_answer_pruned(store):
    turn = await finished(store, "t1")
    assert await turn_rows(store, turn) > 0
    clock_of(store).advance(DAY / 2)
    assert (await prune(store)).tasks == 0  # inside its window
    clock_of(store).advance(DAY)
    report = await prune(store)
    assert report.tasks == 1
    assert await turn_rows(store, turn) == 0
    assert await count(store, "SELECT count(*) FROM cards WHERE agent_turn_id = ?", turn) == 0
    with pytest.raises(TurnPruned):
        await store.read(record.turn_record, A, "t1")
    with pytest.raises(TurnPruned):
        await store.read(views.task, A, "t1")
    with pytest.raises(TurnPruned):
        await store.run(forks.fork, A, "t1", 1)
    # A thread never seen is still "not found", not "pruned".
    assert await store.read(record.turn_record, A, "never") is None
    with pytest.raises(ForkRefused):
        await store.run(forks.fork, A, "never", 1)


async def test_a_tombstone_names_its_sender_who_alone_is_told_pruned(store):
    """Issue 44 (schema migration 17): the tombstone keeps the client that sent the task
    (its reply reference's ``client``, or ``speaks_for`` for an HTTP message), which the
    authorization rule reads; another client, or a scoped read by one, finds nothing."""
    await store.run(sql_inbox.enqueue_turn, A, b"x", {"caller_thread": "ta", "client": "alice"})
    [row] = await store.run1(sql_inbox.claim_due, A, 5)
    token = await store.run(turns.start_turn, row)
    await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
    await store.run1(replies.mark_reply_sent, token.agent_turn_id)
    await finished(store, "tb")  # an anonymous caller's: nobody's
    await store.run(sql_inbox.enqueue_turn, A, b"y", {"caller_thread": "tc", "speaks_for": "carol"})
    [row] = await store.run1(sql_inbox.claim_due, A, 5)
    token = await store.run(turns.start_turn, row)
    await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
    await store.run1(replies.mark_reply_sent, token.agent_turn_id)
    clock_of(store).advance(2 * DAY)
    assert (await prune(store)).tasks == 3
    # What the doors' rule reads: the sender, for the sender and for anyone else.
    assert await store.read(views.task_sender, A, "ta", "alice") == (True, "alice")
    assert await store.read(views.task_sender, A, "ta", "bob") == (True, "alice")
    assert await store.read(views.task_sender, A, "ta") == (True, "alice")
    assert await store.read(views.task_sender, A, "tc", "bob") == (True, "carol")
    assert await store.read(views.task_sender, A, "tb", "bob") == (True, None)
    assert await store.read(views.task_sender, A, "never", "bob") == (False, None)
    # The view scoped to its sender (a client's read) or unscoped (an operator's) says
    # "pruned", naming the sender; scoped to another client, nothing.
    for scope in ("alice", None):
        with pytest.raises(TurnPruned) as pruned:
            await store.read(views.task, A, "ta", scope)
        assert pruned.value.owner == "alice"
    assert await store.read(views.task, A, "ta", "bob") is None
    # ``agentserver result`` from the store: the sender, for the CLI to check.
    assert await store.read(views.task_answer, "ta") == {
        "agent": A,
        "thread": "ta",
        "pruned": True,
        "sender": "alice",
    }
    assert (await store.read(views.task_answer, "tb"))["sender"] is None
    # Another caller sends on the same thread id: alice is still told of her own pruned
    # task; an unscoped read (an operator's) finds the thread's latest, the live one.
    await finished(store, "ta")
    assert await store.read(views.task_sender, A, "ta", "alice") == (True, "alice")
    assert await store.read(views.task_sender, A, "ta", "bob") == (True, None)
    with pytest.raises(TurnPruned):
        await store.read(views.task, A, "ta", "alice")
    assert (await store.read(views.task, A, "ta"))["status"] == "succeeded"

    # A tombstone written before migration 17 names nobody: an operator's read only.
    def forget(tx: Any, env: Any) -> None:
        tx.execute("UPDATE pruned_turns SET sender = NULL WHERE caller_thread = ?", ("tc",))

    await store.run(forget)
    assert await store.read(views.task_sender, A, "tc", "carol") == (True, None)
    assert await store.read(views.task, A, "tc", "carol") is None
    with pytest.raises(TurnPruned):
        await store.read(views.task, A, "tc")


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_a_store_at_schema_16_gains_the_tombstones_sender(kind, request, tmp_path):
    """Schema migration 17 on a store with tombstones: they keep their rows and name no
    sender (an operator's read only); the next pruned task's names its own."""
    s = await _open(kind, request, tmp_path)
    try:
        await s.run(sql_inbox.enqueue_turn, A, b"x", {"caller_thread": "old", "client": "alice"})
        [row] = await s.run1(sql_inbox.claim_due, A, 5)
        token = await s.run(turns.start_turn, row)
        await s.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
        await s.run1(replies.mark_reply_sent, token.agent_turn_id)
        clock_of(s).advance(2 * DAY)
        assert (await prune(s)).tasks == 1

        def back_to_16(tx: Any, env: Any) -> None:
            tx.execute("ALTER TABLE pruned_turns DROP COLUMN sender")
            for statement in UNDO_18:
                tx.execute(statement)
            tx.execute("DELETE FROM schema_version WHERE version >= 17")

        await s.run(back_to_16)
    finally:
        await s.aclose()
    s = await _open(kind, request, tmp_path)
    try:
        from agentserver.agents.store.sql.schema import SCHEMA_VERSION

        assert await count(s, "SELECT max(version) FROM schema_version") == SCHEMA_VERSION
        assert await count(s, "SELECT count(*) FROM pruned_turns WHERE sender IS NULL") == 1
        assert await s.read(views.task_sender, A, "old", "alice") == (True, None)
        assert await s.read(views.task, A, "old", "alice") is None
        with pytest.raises(TurnPruned):
            await s.read(views.task, A, "old")
    finally:
        await s.aclose()


async def test_a_tombstone_goes_after_its_own_window(store):
    await finished(store, "t1")
    clock_of(store).advance(2 * DAY)
    assert (await prune(store)).tasks == 1
    tombstones = "SELECT count(*) FROM pruned_turns"
    assert await count(store, tombstones) == 1
    bounded = replace(ONE_DAY, tombstones_s=3 * DAY)
    clock_of(store).advance(2 * DAY)
    assert (await prune(store, bounded)).rows.get("pruned_turns", 0) == 0  # inside it
    with pytest.raises(TurnPruned):
        await store.read(record.turn_record, A, "t1")
    clock_of(store).advance(2 * DAY)
    dry = await Pruner(store, bounded, (A,)).prune_once(dry_run=True)
    assert dry.rows["pruned_turns"] == 1 and await count(store, tombstones) == 1
    assert (await prune(store, replace(bounded, tombstones_s=None))).rows.get(
        "pruned_turns", 0
    ) == 0  # none: kept forever
    assert (await prune(store, bounded)).rows["pruned_turns"] == 1
    assert await count(store, tombstones) == 0
    assert await store.read(record.turn_record, A, "t1") is None  # gone whole: "not found"


async def test_an_unacknowledged_reply_is_never_pruned(store):
    turn = await finished(store, "t1", sent=False)  # the outbox reply is still pending
    await store.run(replies.record_client_reply, "alice", {"t": 1}, b"<kept/>", failed=False)
    clock_of(store).advance(30 * DAY)
    assert (await prune(store)).tasks == 0
    assert await count(store, "SELECT count(*) FROM agent_replies WHERE agent_turn_id = ?", turn)
    assert len(await store.read(replies.pending_client_replies, "alice", 0, 10)) == 1
    await store.run1(replies.mark_reply_sent, turn)  # delivered: now the Turn may go
    clock_of(store).advance(2 * DAY)
    assert (await prune(store)).tasks == 1
    assert (
        len(await store.read(replies.pending_client_replies, "alice", 0, 10)) == 1
    )  # never by age


async def test_a_pending_approval_keeps_its_turn(store):
    turn = await finished(store, "t1")

    def add(tx: Any, env: Any) -> None:
        tx.execute(
            "INSERT INTO approvals (request_id, agent_id, agent_turn_id, step_id, target, "
            "payload, rule, approver, thread, status, deadline, created_at) "
            "VALUES ('r1', ?, ?, 's', 'tool', '<x/>', 'r', 'ops', 'th', 'pending', 0, 0)",
            (A, turn),
        )

    await store.run(add)
    clock_of(store).advance(30 * DAY)
    assert (await prune(store)).tasks == 0
    assert await store.read(governance.approval_status, "r1") == "pending"


@pytest.mark.parametrize("awaited", [True, False])
async def test_a_granted_approval_keeps_its_turn_only_while_the_call_is_awaited(store, awaited):
    """Granted and still to forward: kept. Granted after its Turn ended (a store from
    before such grants were marked ``withdrawn``): nothing will forward it, so it keeps
    nothing, or the Turn would stay for ever."""
    turn = await finished(store, "t1")

    def add(tx: Any, env: Any) -> None:
        tx.execute(
            "INSERT INTO approvals (request_id, agent_id, agent_turn_id, step_id, target, "
            "payload, rule, approver, thread, status, deadline, created_at) "
            "VALUES ('r1', ?, ?, 's', 'tool', '<x/>', 'r', 'ops', 'th', 'granted', 0, 0)",
            (A, turn),
        )
        if awaited:
            tx.execute(
                "INSERT INTO turn_waiting_tools (tool_call_id, agent_turn_id, turn_epoch, "
                "agent_id, step_id, to_listener, after_execution, status, created_at, "
                "updated_at) VALUES ('approval:r1', ?, 1, ?, 's', 'tool', 'retry', "
                "'waiting', 0, 0)",
                (turn, A),
            )

    await store.run(add)
    clock_of(store).advance(30 * DAY)
    assert (await prune(store)).tasks == (0 if awaited else 1)


async def test_a_turn_suspended_longer_than_the_window_is_kept_whole(store):
    token = await running(store, "t1")
    step_id, _ = await store.run(turns.begin_step, token)
    await store.run(
        turns.complete_step, token, step_id, None, [NewCard(CardType.LLM_MESSAGE, "calling")]
    )
    calls = [ToolCallRecord("c1", "calc", "<add/>", "suspend")]
    await store.run(
        tools.suspend, token, step_id, calls, [], resume_deadline=clock_of(store).now() + 60
    )
    before = await turn_rows(store, token.agent_turn_id)
    queued = await store.run(sql_inbox.enqueue_turn, A, b"next", {"caller_thread": "t2"})
    clock_of(store).advance(90 * DAY)
    report = await prune(store)
    assert report.tasks == 0
    assert await turn_rows(store, token.agent_turn_id) == before
    assert await count(
        store, "SELECT count(*) FROM agent_inbox WHERE inbox_id = ?", queued.inbox_id
    )
    assert (await store.read(head.read, A)).status == "suspended"


async def test_a_conversations_memory_is_kept(store):
    first = await finished(store, "t1", conversation="alice")
    clock_of(store).advance(2 * DAY)
    report = await prune(store)
    assert report.tasks == 0  # its boxes are the conversation's memory
    second = await finished(store, "t2", conversation="alice")
    clock_of(store).advance(2 * DAY)
    assert (await prune(store)).tasks == 1  # the first Turn goes, the last one stays
    assert await turn_rows(store, first) == 0 and await turn_rows(store, second) > 0
    seen = [c.content for c in await store.read(conversations.conversation_cards, A, "alice")]
    assert seen[-1] == "said" and "t1" in seen and "t2" in seen


async def test_keep_last_keeps_the_newest_tasks(store):
    for i in range(5):
        await finished(store, f"t{i}")
    clock_of(store).advance(2 * DAY)
    keep = RetentionSettings(defaults=AgentRetention(DAY, 2, None), step_log_s=None)
    assert (await prune(store, keep)).tasks == 3
    assert await store.read(record.turn_record, A, "t4") is not None
    assert await store.read(record.turn_record, A, "t3") is not None
    with pytest.raises(TurnPruned):
        await store.read(record.turn_record, A, "t2")


async def test_keep_last_counts_per_client_for_an_agent_without_memory(store):
    async def task(thread: str, ref: dict[str, Any]) -> None:
        await store.run(
            sql_inbox.enqueue_turn, A, thread.encode(), {"caller_thread": thread, **ref}
        )
        [row] = await store.run1(sql_inbox.claim_due, A, 5)
        token = await store.run(turns.start_turn, row)
        await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
        await store.run1(replies.mark_reply_sent, token.agent_turn_id)

    # bob's one task is older than all of alice's, and so is the anonymous caller's.
    await task("b0", {"client": "bob"})
    await task("o0", {"chain": ["endpoint-1", A]})
    for i in range(3):
        await task(f"a{i}", {"client": "alice"})
    clock_of(store).advance(2 * DAY)
    keep = RetentionSettings(defaults=AgentRetention(DAY, 2, None), step_log_s=None)
    assert (await prune(store, keep)).tasks == 1  # alice's oldest: she has two newer
    with pytest.raises(TurnPruned):
        await store.read(record.turn_record, A, "a0")
    for kept in ("b0", "o0", "a1", "a2"):
        assert await store.read(record.turn_record, A, kept) is not None


async def test_an_idempotency_record_in_its_window_is_kept(store):
    now = clock_of(store).now()
    await store.run(
        step_log.record_rows,
        [
            StepRow("old", "tool", "a", 1, "step.succeeded", "", now),
            StepRow("live", "tool", "a", 1, "step.dispatched", "", now),
        ],
    )
    clock_of(store).advance(2 * DAY)
    await store.run(
        step_log.record_rows,
        [StepRow("live", "tool", "a", 2, "step.retried", "", clock_of(store).now())],
    )
    report = await prune(store)
    assert report.rows.get("step_log") == 1
    assert await count(store, "SELECT count(*) FROM step_log WHERE step_id = 'live'") == 2
    assert await count(store, "SELECT count(*) FROM step_log WHERE step_id = 'old'") == 0


async def test_a_dry_run_counts_and_deletes_nothing(store):
    turn = await finished(store, "t1")
    clock_of(store).advance(2 * DAY)
    report = await Pruner(store, ONE_DAY, (A,)).prune_once(dry_run=True)
    assert report.tasks == 1
    assert await turn_rows(store, turn) > 0


async def test_a_dry_run_reports_exactly_what_the_prune_then_removes(store):
    """Issue 45: a dry run once counted a task's candidates only (0 rows, while the prune
    then removed 230: every row of each Turn, the records an earlier pass frees). It is
    now the prune itself, rolled back: its report is the prune's, figure for figure."""
    for i in range(12):
        await finished(store, f"t{i}", conversation=f"c{i % 3}")
    await finished(store, "unsent", sent=False)  # its reply is pending: kept
    await store.run(
        step_log.record_rows,
        [
            StepRow(f"s{i}", "tool", "a", 1, "step.done", "", clock_of(store).now())
            for i in range(5)
        ],
    )
    clock_of(store).advance(2 * DAY)
    await finished(store, "young")  # inside the window: kept
    settings = replace(ONE_DAY, defaults=replace(ONE_DAY.defaults, keep_last=1))
    tables = ("agent_inbox", "cards", "boxes", "agent_steps", "agent_replies", "step_log")
    before = {t: await count(store, f"SELECT count(*) FROM {t}") for t in tables}
    dry = await Pruner(store, settings, (A,)).prune_once(dry_run=True)
    # The dry run left everything as it was.
    assert {t: await count(store, f"SELECT count(*) FROM {t}") for t in tables} == before
    done = await prune(store, settings)
    assert dry.tasks == done.tasks and dry.tasks > 0
    assert dry.rows == done.rows
    assert dry.rows["task_rows"] > 0 and dry.rows["step_log"] == 5
    assert sum(dry.rows.values()) == sum(done.rows.values())


async def test_two_pruners_take_turns(store):
    """Two pruners on one store: while one holds the lease the other does nothing (and a
    batch fenced on a lease it does not hold deletes nothing); a dead one's lease expires."""
    await finished(store, "t1")
    clock_of(store).advance(2 * DAY)
    first, second = Pruner(store, ONE_DAY, (A,)), Pruner(store, ONE_DAY, (A,))
    assert await store.run(sql_prune.take_lease, first.owner, 60.0)
    skipped = await second.prune_once()
    assert skipped.skipped and skipped.tasks == 0
    assert (await store.run(sql_prune.prune_tasks, second.owner, A, DAY, 0, 16)).tasks == 0
    clock_of(store).advance(61)  # the first died: its lease expires
    assert (await second.prune_once()).tasks == 1


async def test_sqlite_gives_freed_pages_back(tmp_path):
    from agentserver.agents.store.sqlite_store import SqliteAgentStore

    settings = _settings(tmp_path)
    store = SqliteAgentStore.open(settings.path, clock=ManualClock(1e6), settings=settings)
    try:
        assert store.vacuum_mode() == 2  # a new file with retention on: INCREMENTAL
        for i in range(40):
            token = await running(store, f"t{i}")
            await store.run(turns.add_cards, token, [NewCard(CardType.LLM_MESSAGE, "x" * 20_000)])
            await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
            await store.run1(replies.mark_reply_sent, token.agent_turn_id)
        store.checkpoint()
        big = settings.path.stat().st_size
        clock_of(store).advance(2 * DAY)
        report = await prune(store)
        assert report.tasks == 40 and report.pages > 100
        store.checkpoint()
        assert settings.path.stat().st_size < big / 2
    finally:
        await store.aclose()


def _wal_frames(path: Path) -> int:
    """The frames in the WAL now (a checkpoint from a connection of our own reports the
    log's length; what it copies changes nothing the store can see)."""
    import sqlite3

    db = sqlite3.connect(path, isolation_level=None)
    try:
        _busy, log, _copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    finally:
        db.close()
    return int(log)


async def test_a_prune_run_lets_the_wal_start_over(tmp_path):
    """Issue 43: a pruner's deletions on top of the Turns' writes made the WAL peak 2.5x
    higher; after a prune run the log is copied back, so the next commit starts it over
    (a few frames) instead of appending to everything written since the store opened.
    No background checkpoint here (``serve`` is not running): only the pruner's."""
    from agentserver.agents.store.sqlite_store import SqliteAgentStore

    settings = _settings(tmp_path)
    store = SqliteAgentStore.open(settings.path, clock=ManualClock(1e6), settings=settings)
    try:
        for i in range(60):
            await finished(store, f"t{i}")
        clock_of(store).advance(2 * DAY)
        await finished(store, "fresh")  # kept: inside its window
        before = _wal_frames(settings.path)
        assert before > 200  # everything written so far is still in the log
        report = await prune(store)
        assert report.tasks == 60
        await finished(store, "after")  # the next commits (about 50 frames): started over
        assert _wal_frames(settings.path) < 100, "the WAL did not start over after the prune run"
    finally:
        await store.aclose()


async def test_an_existing_file_is_converted_when_stopped(tmp_path):
    from agentserver.agents.store.sqlite_store import SqliteAgentStore

    path = tmp_path / "agents.sqlite3"
    old = SqliteAgentStore.open(path, settings=StoreSettings(path=path))  # retention off
    assert old.vacuum_mode() == 0  # no cost for a store without retention
    assert old.make_incremental()
    assert old.vacuum_mode() == 2 and not old.make_incremental()
    await old.aclose()


async def test_two_stores_prune_at_once(store, request, tmp_path):
    """Two processes' stores on one database (SQLite: the second attached beside the
    first, as ``agentserver store prune`` is) prune together: one holds the lease, each
    task goes once, nothing fails."""
    for i in range(40):
        await finished(store, f"t{i}")
    clock_of(store).advance(2 * DAY)
    from agentserver.agents.store.sqlite_store import SqliteAgentStore

    if isinstance(store, SqliteAgentStore):
        other: SqlAgentStore = SqliteAgentStore.attach(
            store.settings.path, clock=store.env.clock, settings=store.settings
        )
    else:
        other = await _open("postgresql", request, tmp_path)
        other.env.clock = store.env.clock
    reports = []
    try:

        async def run(s: SqlAgentStore) -> None:
            reports.append(await Pruner(s, ONE_DAY, (A,), pause_s=0.001).prune_once())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, store)
            nursery.start_soon(run, other)
    finally:
        await other.aclose()
    assert sum(r.tasks for r in reports) == 40
    assert await count(store, "SELECT count(*) FROM pruned_turns") == 40
    assert await count(store, "SELECT count(*) FROM agent_inbox") == 0


async def test_a_cancelled_queued_task_leaves_a_tombstone(store):
    """A task cancelled before its Turn ran has no Turn: it is pruned with its failed
    answer once that is sent, and its thread reads "pruned" (found by the chaos bench:
    without the tombstone the checker saw an answer for a task not in the store)."""
    await running(store, "busy")  # the agent is busy: the next task stays queued
    await store.run(sql_inbox.enqueue_turn, A, b"later", {"caller_thread": "later"})
    [reply] = await store.run(replies.cancel_queued, A, "later", b"<cancelled/>")
    clock_of(store).advance(2 * DAY)
    assert (await prune(store)).tasks == 0  # its failed answer is still pending
    await store.run1(replies.mark_reply_sent, reply.agent_turn_id)
    clock_of(store).advance(2 * DAY)
    assert (await prune(store)).tasks == 1
    with pytest.raises(TurnPruned):
        await store.read(views.task, A, "later")


async def test_a_pass_walks_the_inbox_in_bounded_windows(store, monkeypatch):
    """A batch looks at most SCAN_WINDOW rows by primary key; the pass goes window by
    window to the end of what is old enough, kept rows in between included."""
    from agentserver.agents.store.sql import prune as prune_sql

    monkeypatch.setattr(prune_sql, "SCAN_WINDOW", 3)
    for i in range(20):
        await finished(store, f"t{i}", conversation="alice" if i % 2 else None)
    clock_of(store).advance(2 * DAY)
    keep = RetentionSettings(defaults=AgentRetention(DAY, 3, None), step_log_s=None)
    report = await prune(store, keep)
    assert report.tasks == 14  # 10 with a conversation, 10 without: 3 of each kept
    assert report.batches > 20 / 3
    # The newest three of each, and nothing else, are left.
    for i in range(14, 20):
        assert await store.read(record.turn_record, A, f"t{i}") is not None
    with pytest.raises(TurnPruned):
        await store.read(record.turn_record, A, "t13")


async def test_store_prune_converts_an_old_file_and_shrinks_it(tmp_path):
    """``agentserver store prune`` (app/store_admin.py) on a stopped server's file made
    before retention was on: converted to INCREMENTAL, pruned, and smaller after."""
    import shutil
    import time

    from agentserver.agents.store.sqlite_store import SqliteAgentStore
    from agentserver.app import store_admin

    here = Path(__file__).parent.parent / "data"
    shutil.copyfile(here / "agents-retention-boot.xml", tmp_path / "boot.xml")
    path = tmp_path / "state" / "agents.sqlite3"
    old = SqliteAgentStore.open(path, clock=ManualClock(time.time() - 100))  # no retention
    try:
        assert old.vacuum_mode() == 0
        for i in range(30):
            await old.run(sql_inbox.enqueue_turn, "assistant", b"t", {"caller_thread": f"t{i}"})
            [row] = await old.run1(sql_inbox.claim_due, "assistant", 5)
            token = await old.run(turns.start_turn, row)
            await old.run(turns.add_cards, token, [NewCard(CardType.LLM_MESSAGE, "x" * 30_000)])
            await old.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
            await old.run1(replies.mark_reply_sent, token.agent_turn_id)
    finally:
        await old.aclose()
    dry = await store_admin.prune(tmp_path / "boot.xml", dry_run=True, environ={})
    assert dry["tasks"] == 30 and dry["file_bytes_before"] == dry["file_bytes_after"]
    seen = []
    done = await store_admin.prune(tmp_path / "boot.xml", environ={}, progress=seen.append)
    assert done["tasks"] == 30 and seen
    assert any("converted" in n for n in done["notes"])
    assert done["file_bytes_after"] < done["file_bytes_before"] / 2
    stats = await store_admin.stats(tmp_path / "boot.xml", environ={})
    assert stats["auto_vacuum"] == "incremental"
    assert {t["table"]: t["rows"] for t in stats["tables"]}["pruned_turns"] == 30


# -- the records beside the Turns (agents/store/sql/prune_records.py) -----------------


async def execute(store: SqlAgentStore, sql: str, *params: Any) -> None:
    def write(tx: Any, env: Any) -> None:
        tx.execute(sql, params)

    await store.run(write)


async def test_done_deliveries_go_with_their_conversations_counter(store):
    from agentserver.agents.store.outbox import OutboxItem

    def item(key: str, conversation: str) -> OutboxItem:
        return OutboxItem("hook", "http://127.0.0.1:9/", b"{}", key, order_key=conversation)

    await store.run(outbox.enqueue, [item("a1", "A"), item("a2", "A"), item("b1", "B")])
    clock_of(store).advance(1.0)
    claimed = await store.run(outbox.claim, "me", 30.0, 10)
    await store.run(
        outbox.delivered, [(r.seq, r.channel, 200) for r in claimed if r.order_key == "A"]
    )
    rows, counters = "SELECT count(*) FROM outbox", "SELECT count(*) FROM outbox_sequences"
    clock_of(store).advance(DAY / 2)
    assert (await prune(store)).rows.get("outbox", 0) == 0  # inside its window
    clock_of(store).advance(DAY)
    dry = await Pruner(store, ONE_DAY, (A,)).prune_once(dry_run=True)
    # (exactly what the prune below removes: the two rows and their counter)
    assert dry.rows["outbox"] == 3 and await count(store, rows) == 3
    # none keeps them
    assert (await prune(store, replace(ONE_DAY, deliveries_s=None))).rows.get("outbox", 0) == 0
    # A's two delivered rows and its counter go; B's pending row never does, nor its counter.
    assert (await prune(store)).rows["outbox"] == 3
    assert await count(store, rows) == 1 and await count(store, counters) == 1
    assert await count(store, "SELECT count(*) FROM outbox_sequences WHERE order_key = 'B'") == 1
    clock_of(store).advance(10 * DAY)
    assert (await prune(store)).rows.get("outbox", 0) == 0
    # A conversation with nothing kept numbers its next event from 1 again.
    await store.run(outbox.enqueue, [item("a3", "A")])
    seq = "SELECT order_seq FROM outbox WHERE order_key = 'A'"
    assert await count(store, seq) == 1


async def test_old_schedule_runs_go_but_the_newest_and_those_with_a_task(store):
    now = clock_of(store).now()
    await execute(
        store,
        "INSERT INTO schedules (name, agent_id, cron, timezone, overlap, catchup_window, "
        "jitter, payload, source, next_tick, created_at, updated_at) "
        "VALUES ('s', ?, '* * * * *', 'UTC', 'skip', 60, 0, ?, 'api', ?, ?, ?)",
        A,
        b"<t/>",
        now + 60,
        now,
        now,
    )
    await store.run(sql_inbox.enqueue_turn, A, b"x", {"caller_thread": "kept"})
    [kept] = [
        r[0] for r in await store.read(lambda tx, env: tx.all("SELECT inbox_id FROM agent_inbox"))
    ]
    runs = [
        (1, "gone-1", "fired"),
        (2, None, "skipped"),
        (3, kept, "fired"),
        (4, "gone-4", "fired"),
    ]
    for tick, inbox, outcome in runs:
        await execute(
            store,
            "INSERT INTO schedule_runs (schedule, tick, inbox_id, outcome, at) VALUES ('s',?,?,?,?)",
            now - 100 + tick,
            inbox,
            outcome,
            now,
        )
    assert (await prune(store)).rows.get("schedule_runs", 0) == 0  # inside the window
    clock_of(store).advance(2 * DAY)
    assert (await prune(store)).rows["schedule_runs"] == 2
    left = await store.read(
        lambda tx, env: tx.all("SELECT inbox_id FROM schedule_runs ORDER BY tick")
    )
    assert [r[0] for r in left] == [kept, "gone-4"]  # its task is queued; the newest


async def test_an_a2a_tasks_record_goes_with_its_tombstone_a_refused_one_by_age(store):
    await store.run(a2a.record, "t1", A, "ctx", "owner", "m1", "hello")
    await store.run(a2a.record, "t2", A, "ctx", "owner", "m2", "hello")
    await store.run1(a2a.reject, "t2", "refused")
    await finished(store, "t1")
    records = "SELECT count(*) FROM a2a_tasks"
    clock_of(store).advance(2 * DAY)
    report = await prune(store)
    assert report.tasks == 1 and report.rows["a2a_tasks"] == 1  # the refused one
    # The task's record stays while its tombstone does: the same message is the same task.
    assert await count(store, records) == 1
    assert await store.run(a2a.record, "t9", A, "ctx", "owner", "m1", "hello") == ("t1", False)
    # Its reads say "pruned" (GetTask's TaskNotFound, http/a2a/handler.py), and ListTasks
    # leaves it out, with or without a filter on the state (issue 43: the chaos bench's
    # A2A client saw ListTasks and GetTask fail with an internal error instead).
    with pytest.raises(TurnPruned) as pruned:
        await store.read(a2a.task, "t1")
    assert pruned.value.owner == "owner"  # only its sender is told (http/a2a/handler.py)
    assert await store.read(a2a.tasks, "owner", None, [A], 10) == ([], 0, False)
    assert await store.read(a2a.tasks, "owner", "ctx", [A], 10, keep=lambda _: True) == (
        [],
        0,
        False,
    )
    bounded = replace(ONE_DAY, tombstones_s=3 * DAY)
    clock_of(store).advance(4 * DAY)
    assert (await prune(store, bounded)).rows["pruned_turns"] == 1
    assert await count(store, records) == 0


async def test_the_deliveries_pass_walks_bounded_windows_past_kept_rows(store, monkeypatch):
    """A batch looks at most SCAN_WINDOW deliveries by ``seq``; pending ones in between
    are kept and the pass goes on past them to the end of what is old enough."""
    from agentserver.agents.store.outbox import OutboxItem
    from agentserver.agents.store.sql import prune as prune_sql

    monkeypatch.setattr(prune_sql, "SCAN_WINDOW", 3)
    items = [
        OutboxItem("hook", "http://127.0.0.1:9/", b"{}", f"k{i}", order_key=f"c{i}")
        for i in range(12)
    ]
    await store.run(outbox.enqueue, items)
    clock_of(store).advance(1.0)
    claimed = await store.run(outbox.claim, "me", 30.0, 20)
    # Every third stays pending (never pruned); the others delivered.
    await store.run(
        outbox.delivered, [(r.seq, r.channel, 200) for r in claimed if int(r.order_key[1:]) % 3]
    )
    clock_of(store).advance(2 * DAY)
    report = await prune(store, replace(ONE_DAY, deliveries_s=DAY))
    assert report.rows["outbox"] == 8 + 8  # the rows and their conversations' counters
    assert report.batches > 12 / 3
    assert await count(store, "SELECT count(*) FROM outbox") == 4
