"""Pruning during a SIGKILL (issue 38): a batch is one transaction, so a pruner killed
at any moment leaves every finished task either whole or gone with its tombstone, never
half; the next run redoes what was left. A real process, a real SQLite file or a real
PostgreSQL database (``pg_url`` skips when no server is reachable)."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from agentserver.agents.clock import ManualClock
from agentserver.agents.profile.retention import AgentRetention, RetentionSettings
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import CardType, NewCard, TaskStatus
from agentserver.agents.store.pruner import Pruner
from agentserver.agents.store.sql import inbox, replies, turn_end, turns
from agentserver.agents.store.sql.prune import LEASE_S
from agentserver.agents.store.sql_store import SqlAgentStore
from agentserver.agents.store.sqlite_store import SqliteAgentStore

A = "agent"
TASKS = 300
RETENTION = RetentionSettings(
    defaults=AgentRetention(finished_tasks_s=3600.0, keep_last=0, events_s=None),
    step_log_s=None,
    acknowledged_replies_s=None,
)

# The pruner in its own process: prints a line per batch, forever slow enough to be killed.
CHILD = """
import sys, trio
from agentserver.agents.profile.retention import AgentRetention, RetentionSettings
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.pruner import Pruner
from agentserver.agents.store.sql.prune import LEASE_S
from agentserver.agents.store.sqlite_store import SqliteAgentStore

target = sys.argv[1]
r = RetentionSettings(defaults=AgentRetention(3600.0, 0, None), step_log_s=None,
                      acknowledged_replies_s=None)

async def main():
    if target.startswith("postgresql"):
        from agentserver.agents.store.pg.store import PostgresAgentStore
        store = PostgresAgentStore.open(target, settings=StoreSettings(retention=r))
        if hasattr(store, "__await__"):
            store = await store
    else:
        store = SqliteAgentStore.open(target, settings=StoreSettings(path=target, retention=r))
    def progress(report):
        print("batch", report.tasks, flush=True)
    await Pruner(store, r, ("agent",), pause_s=0.01).prune_once(progress=progress)
    print("done", flush=True)

trio.run(main)
"""


async def _open(
    target: str, clock: ManualClock | None = None, retention: RetentionSettings | None = None
) -> SqlAgentStore:
    """The store at ``target``: a SQLite file's path or a PostgreSQL URL."""
    if target.startswith("postgresql"):
        from agentserver.agents.store.pg.store import PostgresAgentStore

        opened = PostgresAgentStore.open(
            target, clock=clock, settings=StoreSettings(retention=retention)
        )
        return await opened if inspect.isawaitable(opened) else opened
    settings = StoreSettings(path=Path(target), retention=retention)
    return SqliteAgentStore.open(Path(target), clock=clock, settings=settings)


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "agents.sqlite3")
    return str(request.getfixturevalue("pg_url"))  # skips when no server is reachable


async def _fill(target: str) -> None:
    store = await _open(target, ManualClock(time.time() - 86400), RETENTION)
    try:
        for i in range(TASKS):
            await store.run(inbox.enqueue_turn, A, b"t", {"caller_thread": f"t{i}"})
            [row] = await store.run1(inbox.claim_due, A, 5)
            token = await store.run(turns.start_turn, row)
            step_id, _ = await store.run(turns.begin_step, token)
            await store.run(
                turns.complete_step, token, step_id, None, [NewCard(CardType.LLM_MESSAGE, "x")]
            )
            await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
            await store.run1(replies.mark_reply_sent, token.agent_turn_id)
    finally:
        await store.aclose()


def _check(target: str) -> tuple[int, int]:
    """(tasks left, tasks pruned); asserts none is half there."""
    return trio.run(_check_async, target)


async def _check_async(target: str) -> tuple[int, int]:
    store = await _open(target)
    try:

        def read(tx: Any, env: Any) -> tuple[int, int]:
            pruned = {r[0] for r in tx.all("SELECT agent_turn_id FROM pruned_turns")}
            left = {
                r[0]
                for r in tx.all("SELECT agent_turn_id FROM agent_inbox WHERE message_type='turn'")
            }
            assert not pruned & left
            for turn in pruned:
                for table in ("agent_inbox", "agent_steps", "boxes", "agent_replies"):
                    assert tx.one(
                        f"SELECT count(*) FROM {table} WHERE agent_turn_id=?", (turn,)
                    ) == (0,)
            for turn in left:  # whole: its step, its boxes and their cards, its reply
                assert tx.one(
                    "SELECT count(*) FROM agent_steps WHERE agent_turn_id=?", (turn,)
                ) == (1,)
                assert tx.one(
                    "SELECT count(*) FROM agent_replies WHERE agent_turn_id=?", (turn,)
                ) == (1,)
                (cards,) = tx.one(
                    "SELECT count(*) FROM cards WHERE box_id IN "
                    "(SELECT box_id FROM boxes WHERE agent_turn_id=?)",
                    (turn,),
                )
                assert cards >= 2
            return len(left), len(pruned)

        result: tuple[int, int] = await store.read(read)
        return result
    finally:
        await store.aclose()


def test_a_killed_pruner_leaves_nothing_half_done(target):
    trio.run(_fill, target)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, target], stdout=subprocess.PIPE, env=dict(os.environ)
    )
    try:
        assert proc.stdout is not None
        for _ in range(3):  # a few batches in: it is mid-run
            assert proc.stdout.readline().startswith(b"batch")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left, pruned = _check(target)
    assert left + pruned == TASKS and 0 < pruned < TASKS

    # The next run redoes the rest, once the dead pruner's lease has expired.
    async def again(ahead: float) -> bool:
        store = await _open(target, ManualClock(time.time() + ahead), RETENTION)
        try:
            return (await Pruner(store, RETENTION, (A,), pause_s=0).prune_once()).skipped
        finally:
            await store.aclose()

    assert trio.run(again, 0.0)  # the lease is still the dead pruner's
    assert _check(target) == (left, pruned)
    assert not trio.run(again, LEASE_S + 1)
    assert _check(target) == (0, TASKS)
