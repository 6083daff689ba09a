"""The step log: durable rows in the agent store, or the last rows in memory."""

from __future__ import annotations

from agentserver.agents.sqlite_store import SqliteAgentStore
from agentserver.agents.step_log import MemoryStepLog, StepRow, StoreStepLog


def rows(n: int, listener: str = "search") -> list[StepRow]:
    return [
        StepRow(f"s{i // 2}", listener, "assistant", i % 2, "step.x", at=float(i)) for i in range(n)
    ]


def test_store_rows_survive_a_reopen_and_page_in_order(tmp_path):
    path = tmp_path / "agents.sqlite3"
    store = SqliteAgentStore.open(path)
    log = StoreStepLog(store)
    written = [log.append(r) for r in rows(5)]
    assert [r.seq for r in written] == [1, 2, 3, 4, 5]
    store.close()
    store = SqliteAgentStore.open(path)
    log = StoreStepLog(store)
    assert [r.seq for r in log] == [1, 2, 3, 4, 5]
    assert log.append(rows(1, "other")[0]).seq == 6  # numbering goes on after a restart
    assert [r.seq for r in log.rows(after=2, limit=2)] == [3, 4]
    assert [r.seq for r in log.rows(step="s1")] == [3, 4]
    assert [r.listener for r in log.rows(listener="other")] == ["other"]
    assert log.rows(after=2, limit=2)[0] == StepRow(
        "s1", "search", "assistant", 0, "step.x", "", 2.0, 3
    )
    store.close()


def test_memory_log_keeps_the_last_rows():
    log = MemoryStepLog(size=3)
    for r in rows(5):
        log.append(r)
    assert [r.seq for r in log] == [3, 4, 5]
    assert [r.seq for r in log.rows(after=3)] == [4, 5]
    assert [r.seq for r in log.rows(step="s2")] == [5]
    assert not log.durable
