"""Pruning during a SIGKILL (issue 38): a batch is one transaction, so a pruner killed
at any moment leaves every finished task either whole or gone with its tombstone, never
half; the next run redoes what was left. A real process, a real SQLite file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import trio

from agentserver.agents.clock import ManualClock
from agentserver.agents.profile.retention import AgentRetention, RetentionSettings
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import CardType, NewCard, TaskStatus
from agentserver.agents.store.pruner import Pruner
from agentserver.agents.store.sql.prune import LEASE_S
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

path = sys.argv[1]
r = RetentionSettings(defaults=AgentRetention(3600.0, 0, None), step_log_s=None,
                      acknowledged_replies_s=None)

async def main():
    store = SqliteAgentStore.open(path, settings=StoreSettings(path=path, retention=r))
    def progress(report):
        print("batch", report.tasks, flush=True)
    await Pruner(store, r, ("agent",), pause_s=0.01).prune_once(progress=progress)
    print("done", flush=True)

trio.run(main)
"""


async def _fill(path) -> None:
    settings = StoreSettings(path=path, retention=RETENTION)
    store = SqliteAgentStore.open(path, clock=ManualClock(time.time() - 86400), settings=settings)
    try:
        for i in range(TASKS):
            await store.enqueue_turn(A, b"t", {"caller_thread": f"t{i}"})
            [row] = await store.claim_due(A, 5)
            token = await store.start_turn(row)
            step_id, _ = await store.begin_step(token)
            await store.complete_step(token, step_id, None, [NewCard(CardType.LLM_MESSAGE, "x")])
            await store.finish(token, TaskStatus.SUCCEEDED, "done", {}, b"<a/>")
            await store.mark_reply_sent(token.agent_turn_id)
    finally:
        await store.aclose()


def _check(path) -> tuple[int, int]:
    """(tasks left, tasks pruned); asserts none is half there."""
    store = SqliteAgentStore.open(path, settings=StoreSettings(path=path))
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

        return _sync_read(store, read)
    finally:
        store.close()


def _sync_read(store: SqliteAgentStore, fn: Any) -> Any:
    async def go() -> Any:
        return await store._read(fn)

    return trio.run(go)


def test_a_killed_pruner_leaves_nothing_half_done(tmp_path):
    path = tmp_path / "agents.sqlite3"
    trio.run(_fill, path)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, env=dict(os.environ)
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
    left, pruned = _check(path)
    assert left + pruned == TASKS and 0 < pruned < TASKS

    # The next run redoes the rest, once the dead pruner's lease has expired.
    async def again(ahead: float) -> bool:
        store = SqliteAgentStore.open(
            path,
            clock=ManualClock(time.time() + ahead),
            settings=StoreSettings(path=path, retention=RETENTION),
        )
        try:
            return (await Pruner(store, RETENTION, (A,), pause_s=0).prune_once()).skipped
        finally:
            await store.aclose()

    assert trio.run(again, 0.0)  # the lease is still the dead pruner's
    assert _check(path) == (left, pruned)
    assert not trio.run(again, LEASE_S + 1)
    assert _check(path) == (0, TASKS)
