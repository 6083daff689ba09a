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
    assert (
        to_pg("SELECT ? WHERE x LIKE 'a%' AND y = ?") == b"SELECT $1 WHERE x LIKE 'a%' AND y = $2"
    )
    assert to_pg("SELECT 1") == b"SELECT 1"


async def test_values_round_trip_as_psycopg_types(pg_url: str) -> None:
    """The statement layer under PgTx (libpq and psycopg's adapters, no cursors): each
    Python type the store uses goes in and comes back as itself, whatever the order in
    which one prepared statement sees its parameter types."""
    ex = await PgExecutor.open(pg_url)
    try:
        await ex.run(
            lambda tx: tx.execute(
                "CREATE TABLE vals (k text PRIMARY KEY, i bigint, f double precision, "
                "b bytea, flag integer)"
            )
        )
        rows = [
            ("small", 1, 0.5, b"\x00\xff", 0),
            ("big", 2**62, -1e300, b"", 1),
            ("none", None, None, None, None),
            ("ünïcode \u2603", -(2**40), float("inf"), bytes(range(256)), 1),
        ]
        insert = "INSERT INTO vals (k, i, f, b, flag) VALUES (?, ?, ?, ?, ?)"
        for row in rows:  # one statement, prepared once per set of parameter types
            assert await ex.run(lambda tx, r=row: tx.execute(insert, r)) == 1
        got = await ex.run(lambda tx: tx.all("SELECT k, i, f, b, flag FROM vals"))
        assert sorted(got, key=repr) == sorted(rows, key=repr)
        assert await ex.run(lambda tx: tx.one("SELECT k FROM vals WHERE k = ?", ("nope",))) is None
        # rowcount of an UPDATE, of executemany, and of a statement with no rows
        n = await ex.run(lambda tx: tx.execute("UPDATE vals SET flag = ? WHERE flag = ?", (7, 1)))
        assert n == 2

        def many(tx) -> int:
            tx.executemany(
                "UPDATE vals SET i = ? WHERE k = ?", [(1, "small"), (2, "big"), (3, "x")]
            )
            return tx.rowcount

        assert await ex.run(many) == 2
        assert await ex.run_single(lambda tx: tx.all("UPDATE vals SET i = 0 WHERE false")) == []
    finally:
        await ex.aclose()


async def test_statement_errors_are_typed_and_leave_the_connection_usable(pg_url: str) -> None:
    ex = await PgExecutor.open(pg_url, pool_size=1)
    try:
        with pytest.raises(StoreError, match="division by zero"):
            await ex.run(lambda tx: tx.one("SELECT 1 / ?", (0,)))
        with pytest.raises(StoreError, match="syntax"):
            await ex.run(lambda tx: tx.one("SELEKT ?", (1,)))
        # the same (only) connection, after both failures, inside and outside BEGIN
        assert await ex.run(lambda tx: tx.one("SELECT 1 / ?", (1,))) == (1,)
        assert await ex.run_single(lambda tx: tx.one("SELECT ?::int + 1", (1,))) == (2,)
    finally:
        await ex.aclose()


async def test_past_the_prepared_statements_cap_statements_run_unprepared(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentserver.agents.pg import executor

    monkeypatch.setattr(executor, "MAX_PREPARED", 1)
    ex = await PgExecutor.open(pg_url, pool_size=1)
    try:
        for i in range(5):
            assert await ex.run(lambda tx, i=i: tx.one(f"SELECT ?::int + {i}", (1,))) == (1 + i,)
        assert len(next(iter(ex._statements.values()))) == 1
    finally:
        await ex.aclose()


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


async def test_opening_an_executor_shortens_the_switch_interval_never_lengthens_it(
    pg_url: str,
) -> None:
    import sys

    from agentserver.agents.pg.executor import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        await (await PgExecutor.open(pg_url)).aclose()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        sys.setswitchinterval(SWITCH_INTERVAL_S / 2)
        await (await PgExecutor.open(pg_url)).aclose()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S / 2)
    finally:
        sys.setswitchinterval(before)
