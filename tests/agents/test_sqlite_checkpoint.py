"""The SQLite store checkpoints its WAL on a worker thread while it is served, not inline
in a commit on the trio thread (agents/store/sqlite_store.py, "Checkpoints")."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
import trio
import trio.testing

from agentserver.agents.doorbell import Doorbell
from agentserver.agents.store import sqlite_store
from agentserver.agents.store.sql import inbox
from agentserver.agents.store.sqlite_store import SqliteAgentStore


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    # pytest-trio runs a test on the clock fixture it is given: sleeps take no real time.
    return trio.testing.MockClock(autojump_threshold=0)


def rows_in_main_file(path: Path, tmp: Path) -> int:
    """Inbox rows in the database file alone (what a checkpoint has copied out of the WAL)."""
    copy = tmp / "copy.sqlite3"
    shutil.copyfile(path, copy)
    db = sqlite3.connect(copy)
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "agent_inbox" not in tables:
            return 0
        return db.execute("SELECT count(*) FROM agent_inbox").fetchone()[0]
    finally:
        db.close()
        copy.unlink()


def test_commits_do_not_checkpoint_inline_below_the_backstop(tmp_path):
    path = tmp_path / "agents.sqlite3"
    store = SqliteAgentStore.open(path)
    try:
        pages = store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
        assert pages == sqlite_store.AUTOCHECKPOINT_PAGES > 1000
    finally:
        store.close()


async def test_serve_checkpoints_the_wal_off_the_trio_thread(tmp_path, autojump_clock):
    path = tmp_path / "agents.sqlite3"
    store = SqliteAgentStore.open(path)
    try:
        await store.run(inbox.ensure_agents, ["a"])
        for i in range(40):
            await store.run(inbox.enqueue_turn, "a", b"<task/>", {"caller_thread": f"t{i}"})
        before = rows_in_main_file(path, tmp_path)
        async with trio.open_nursery() as nursery:
            await nursery.start(store.serve, Doorbell())
            await trio.sleep(sqlite_store.CHECKPOINT_PERIOD * 2.5)
            nursery.cancel_scope.cancel()
        after = rows_in_main_file(path, tmp_path)
    finally:
        store.close()
    assert before == 0  # every commit so far is only in the WAL
    assert after == 40  # the background checkpoint copied them into the database file


async def test_close_after_serve_releases_the_checkpoint_connection(tmp_path, autojump_clock):
    path = tmp_path / "agents.sqlite3"
    store = SqliteAgentStore.open(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.serve, Doorbell())
        await trio.sleep(sqlite_store.CHECKPOINT_PERIOD * 1.5)
        nursery.cancel_scope.cancel()
    store.close()
    store.close()  # idempotent
    # The lock and both connections are released: the file opens again in this process.
    SqliteAgentStore.open(path).close()


def test_the_wal_is_cut_back_once_a_checkpoint_lets_it_start_over(tmp_path):
    # Without journal_size_limit the WAL file keeps the size of its busiest moment for
    # good: the store's size on disk grows with its peaks, not with what it holds.
    path = tmp_path / "agents.sqlite3"
    wal = path.with_name(path.name + "-wal")
    store = SqliteAgentStore.open(path)
    try:
        db = store._db
        db.execute("CREATE TABLE filler (blob BLOB)")
        db.execute("BEGIN IMMEDIATE")
        for _ in range(3 * sqlite_store.WAL_SIZE_LIMIT // 8192):
            db.execute("INSERT INTO filler VALUES (zeroblob(8192))")
        db.execute("COMMIT")
        assert wal.stat().st_size > sqlite_store.WAL_SIZE_LIMIT
        store.checkpoint()  # copies every frame back: the next writer starts over
        db.execute("INSERT INTO filler VALUES (zeroblob(10))")
        assert wal.stat().st_size <= sqlite_store.WAL_SIZE_LIMIT
    finally:
        store.close()
