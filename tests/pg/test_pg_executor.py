"""PgExecutor against a real server: one transaction per thread hop, bounded by the
pool, server-side timeouts, bounded retries of what may be retried."""

from __future__ import annotations

import threading

import psycopg
import pytest
import trio

from agentserver.agents.errors import StoreError
from agentserver.agents.pg.executor import PgExecutor, to_pg


def test_placeholders() -> None:
    assert to_pg("SELECT ? WHERE x LIKE 'a%'") == "SELECT %s WHERE x LIKE 'a%%'"


async def _executor(url: str, **kw) -> PgExecutor:
    ex = await PgExecutor.open(url, **kw)
    await ex.run(lambda tx: tx.execute("CREATE TABLE IF NOT EXISTS t (k text PRIMARY KEY, v int)"))
    return ex


async def test_commits_a_whole_transaction_or_nothing(pg_url: str) -> None:
    ex = await _executor(pg_url)
    try:

        def write(tx, k: str, fail: bool) -> int:
            tx.execute("INSERT INTO t (k, v) VALUES (?, ?)", (k, 1))
            tx.execute("INSERT INTO t (k, v) VALUES (?, ?)", (k + "2", 2))
            if fail:
                raise ValueError("boom")
            return tx.one("SELECT count(*) FROM t")[0]

        assert await ex.run(write, "a", False) == 2
        with pytest.raises(ValueError, match="boom"):
            await ex.run(write, "b", True)
        rows = await ex.run(lambda tx: tx.all("SELECT k FROM t ORDER BY k"))
        assert rows == [("a",), ("a2",)]
        with pytest.raises(StoreError, match="duplicate key"):
            await ex.run(write, "a", False)
    finally:
        await ex.aclose()


async def test_no_more_transactions_in_flight_than_connections(pg_url: str) -> None:
    ex = await _executor(pg_url, pool_size=3)
    lock = threading.Lock()
    now = peak = 0

    def slow(tx) -> None:
        nonlocal now, peak
        with lock:
            now += 1
            peak = max(peak, now)
        try:
            tx.execute("SELECT pg_sleep(0.02)")
        finally:
            with lock:
                now -= 1

    try:
        assert ex.limiter.total_tokens == 3
        async with trio.open_nursery() as nursery:
            for _ in range(12):
                nursery.start_soon(ex.run, slow)
        assert peak == 3
    finally:
        await ex.aclose()


_RAISE_40001 = """DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$"""


async def test_serialization_failures_are_rerun_a_bounded_number_of_times(pg_url: str) -> None:
    ex = await _executor(pg_url, retries=3)
    attempts = 0
    keys = iter(range(1000))

    def conflicting(tx, fail_times: int) -> str:
        nonlocal attempts
        attempts += 1
        tx.execute("INSERT INTO t (k, v) VALUES (?, ?)", (f"try{next(keys)}", attempts))
        if attempts <= fail_times:
            tx.execute(_RAISE_40001)
        return "done"

    try:
        assert await ex.run(conflicting, 2) == "done"
        assert attempts == 3 and ex.reruns == 2
        # Only the successful attempt's row was committed.
        assert await ex.run(lambda tx: tx.all("SELECT k FROM t")) == [("try2",)]
        attempts = 0
        with pytest.raises(StoreError, match="failed 4 times"):
            await ex.run(conflicting, 99)
        assert attempts == 4
    finally:
        await ex.aclose()


async def test_a_connection_lost_before_commit_is_rerun_on_a_new_one(pg_url: str) -> None:
    ex = await _executor(pg_url)
    pids = []

    def write(tx) -> None:
        pids.append(tx.one("SELECT pg_backend_pid()")[0])
        tx.execute(
            "INSERT INTO t (k, v) VALUES ('once', 1) ON CONFLICT (k) DO UPDATE SET v = t.v + 1"
        )
        if len(pids) == 1:
            tx.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    try:
        await ex.run(write)
        assert len(pids) == 2 and pids[0] != pids[1]
        assert await ex.run(lambda tx: tx.all("SELECT k, v FROM t")) == [("once", 1)]
    finally:
        await ex.aclose()


async def test_statement_and_lock_timeouts_bound_a_thread(pg_url: str) -> None:
    ex = await _executor(pg_url, statement_timeout_s=0.3, lock_timeout_s=0.2)
    try:
        with trio.fail_after(20):
            with pytest.raises(StoreError, match="statement timeout"):
                await ex.run(lambda tx: tx.execute("SELECT pg_sleep(60)"))
            # Cancelling the caller cannot abandon the thread: the server's timeout ends it.
            with trio.move_on_after(0.05) as scope:
                with pytest.raises(StoreError, match="statement timeout"):
                    await ex.run(lambda tx: tx.execute("SELECT pg_sleep(60)"))
                await trio.lowlevel.checkpoint()
            assert scope.cancelled_caught
            await ex.run(lambda tx: tx.execute("INSERT INTO t VALUES ('locked', 0)"))
            with psycopg.connect(pg_url) as holder:
                holder.execute("SELECT * FROM t WHERE k = 'locked' FOR UPDATE")
                with pytest.raises(StoreError, match="lock timeout"):
                    await ex.run(lambda tx: tx.execute("UPDATE t SET v = 1 WHERE k = 'locked'"))
        assert ex.reruns == 0
    finally:
        await ex.aclose()


async def test_an_unreachable_server_is_a_clear_error() -> None:
    with pytest.raises(StoreError, match=r"cannot connect to the agent store .*:\*\*\*@"):
        await PgExecutor.open("postgresql://u:pw@127.0.0.1:1/db", connect_timeout_s=1)
