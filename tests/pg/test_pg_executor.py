"""Both store executors against a real server (the thread one: a transaction per thread
hop; the trio one: libpq's non-blocking pipeline on the trio thread): bounded by the
pool, server-side timeouts, bounded retries of what may be retried; the trio one's
cancellation never leaves a transaction open."""

from __future__ import annotations

import threading

import psycopg
import pytest
import trio

from agentserver.agents.errors import StoreError
from agentserver.agents.store.pg.executor import PgExecutor, to_pg
from agentserver.agents.store.pg.trio_executor import PgTrioExecutor

EXECUTORS = {"thread": PgExecutor, "trio": PgTrioExecutor}


@pytest.fixture(params=sorted(EXECUTORS))
def Executor(request: pytest.FixtureRequest) -> type:
    return EXECUTORS[request.param]


def test_placeholders() -> None:
    assert (
        to_pg("SELECT ? WHERE x LIKE 'a%' AND y = ?") == b"SELECT $1 WHERE x LIKE 'a%' AND y = $2"
    )
    assert to_pg("SELECT 1") == b"SELECT 1"


def changed(tx, sql: str, params: tuple) -> int:
    tx.execute(sql, params)
    return tx.rowcount


async def test_values_round_trip_as_psycopg_types(pg_url: str, Executor: type) -> None:
    """The statement layer under PgTx (libpq and psycopg's adapters, no cursors): each
    Python type the store uses goes in and comes back as itself, whatever the order in
    which one prepared statement sees its parameter types."""
    ex = await Executor.open(pg_url)
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
            assert await ex.run(changed, insert, row) == 1
        got = await ex.run(lambda tx: tx.all("SELECT k, i, f, b, flag FROM vals"))
        assert sorted(got, key=repr) == sorted(rows, key=repr)
        assert await ex.run(lambda tx: tx.one("SELECT k FROM vals WHERE k = ?", ("nope",))) is None
        # rowcount of an UPDATE, of executemany, and of a statement with no rows
        n = await ex.run(changed, "UPDATE vals SET flag = ? WHERE flag = ?", (7, 1))
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


async def test_statement_errors_are_typed_and_leave_the_connection_usable(
    pg_url: str, Executor: type
) -> None:
    ex = await Executor.open(pg_url, pool_size=1)
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
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
    Executor: type,
) -> None:
    from agentserver.agents.store.pg import executor

    monkeypatch.setattr(executor, "MAX_PREPARED", 1)
    ex = await Executor.open(pg_url, pool_size=1)
    try:
        for i in range(5):
            assert await ex.run(lambda tx, i=i: tx.one(f"SELECT ?::int + {i}", (1,))) == (1 + i,)
        if Executor is PgExecutor:
            assert len(next(iter(ex._statements.values()))) == 1
    finally:
        await ex.aclose()


async def _executor(Executor: type, url: str, **kw):
    ex = await Executor.open(url, **kw)
    await ex.run(lambda tx: tx.execute("CREATE TABLE IF NOT EXISTS t (k text PRIMARY KEY, v int)"))
    return ex


async def test_commits_a_whole_transaction_or_nothing(pg_url: str, Executor: type) -> None:
    ex = await _executor(Executor, pg_url)
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


async def test_no_more_transactions_in_flight_than_connections(pg_url: str, Executor: type) -> None:
    ex = await _executor(Executor, pg_url, pool_size=3)
    lock = threading.Lock()
    now = peak = 0

    def slow(tx) -> None:
        nonlocal now, peak
        with lock:
            now += 1
            peak = max(peak, now)
        try:
            tx.one("SELECT pg_sleep(0.02)")
        finally:
            with lock:
                now -= 1

    try:
        if Executor is PgExecutor:
            assert ex.limiter.total_tokens == 3
        async with trio.open_nursery() as nursery:
            for _ in range(12):
                nursery.start_soon(ex.run, slow)
        assert peak == 3
    finally:
        await ex.aclose()


_RAISE_40001 = """DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$"""


async def test_serialization_failures_are_rerun_a_bounded_number_of_times(
    pg_url: str, Executor: type
) -> None:
    ex = await _executor(Executor, pg_url, retries=3)
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


async def test_a_connection_lost_before_commit_is_rerun_on_a_new_one(
    pg_url: str, Executor: type
) -> None:
    ex = await _executor(Executor, pg_url)
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


async def test_statement_and_lock_timeouts_bound_a_thread(pg_url: str, Executor: type) -> None:
    ex = await _executor(Executor, pg_url, statement_timeout_s=0.3, lock_timeout_s=0.2)
    try:
        with trio.fail_after(20):
            with pytest.raises(StoreError, match="statement timeout"):
                await ex.run(lambda tx: tx.execute("SELECT pg_sleep(60)"))
            if Executor is PgExecutor:
                # Cancelling the caller cannot abandon the thread: the server's timeout
                # ends it.
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


async def test_an_unreachable_server_is_a_clear_error(Executor: type) -> None:
    with pytest.raises(StoreError, match=r"cannot connect to the agent store .*:\*\*\*@"):
        await Executor.open("postgresql://u:pw@127.0.0.1:1/db", connect_timeout_s=1)


async def test_opening_an_executor_shortens_the_switch_interval_never_lengthens_it(
    pg_url: str,
) -> None:
    import sys

    from agentserver.agents.store.pg.executor import SWITCH_INTERVAL_S

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


async def _backends(url: str) -> list[tuple[int, str]]:
    """(pid, transaction state) of the test database's client backends, but this one."""

    def query() -> list[tuple[int, str]]:
        with psycopg.connect(url, autocommit=True) as conn:
            return conn.execute(
                "SELECT pid, state FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
            ).fetchall()

    return await trio.to_thread.run_sync(query)


@pytest.mark.parametrize("where", ["statement", "lock"])
async def test_a_cancelled_call_discards_its_connection_and_commits_nothing(
    pg_url: str, where: str
) -> None:
    """Cancelled while the server works on a statement (or waiting for a row lock):
    the call raises Cancelled at once, its connection is closed (the server ends its
    backend and rolls back), no transaction stays open, nothing was committed, and the
    next call runs on a clean connection."""
    ex = await _executor(PgTrioExecutor, pg_url, pool_size=1)
    try:
        before = await _backends(pg_url)
        assert len(before) == 1 and ex.idle_connections == 1

        def write(tx) -> None:
            tx.execute("INSERT INTO t (k, v) VALUES ('cancelled', 1)")
            if where == "statement":
                tx.execute("SELECT pg_sleep(60)")

        def wait_for_lock(tx) -> None:
            tx.execute("INSERT INTO t (k, v) VALUES ('cancelled', 1)")
            # waits for the row lock the holder keeps (inside the transaction)
            tx.execute("UPDATE t SET v = 2 WHERE k = 'held'")

        await ex.run(lambda tx: tx.execute("INSERT INTO t VALUES ('held', 0)"))
        with psycopg.connect(pg_url) as holder:
            holder.execute("SELECT * FROM t WHERE k = 'held' FOR UPDATE")
            with trio.fail_after(10):
                with trio.move_on_after(0.2) as scope:
                    await ex.run(write if where == "statement" else wait_for_lock)
                assert scope.cancelled_caught
                assert ex.idle_connections == 0  # discarded, not pooled
                # The server notices the closed socket and ends the backend (and its
                # transaction with it).
                for _ in range(1000):
                    if before[0][0] not in [b[0] for b in await _backends(pg_url)]:
                        break
                    await trio.sleep(0.01)
                else:
                    raise AssertionError("the discarded connection's backend lives on")
            holder.rollback()
        assert await ex.run(lambda tx: tx.all("SELECT k, v FROM t ORDER BY k")) == [("held", 0)]
        after = await _backends(pg_url)
        assert len(after) == 1 and after[0][1] == "idle"
        assert ex.idle_connections == 1
    finally:
        await ex.aclose()


async def test_writes_wait_for_the_next_read_or_the_commit(pg_url: str) -> None:
    """BEGIN rides with the first statement, a new statement is prepared with its first
    run, writes go out with the next statement whose result is needed (a read, a
    rowcount) or with COMMIT: round trips are the reads plus one."""
    ex = await _executor(PgTrioExecutor, pg_url)
    try:

        def writes(tx) -> int:
            tx.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("a", 1))
            tx.executemany("INSERT INTO t (k, v) VALUES (?, ?)", [("b", 2), ("c", 3), ("d", 4)])
            assert tx.rowcount == 3  # a round trip: BEGIN and four INSERTs
            assert tx.rowcount == 3  # (known: no round trip)
            n = tx.one("SELECT count(*) FROM t")[0]  # a round trip
            tx.execute("UPDATE t SET v = v + 1 WHERE k = ?", ("a",))
            tx.execute("DELETE FROM t WHERE k = ?", ("d",))
            return n  # COMMIT with the UPDATE and the DELETE: a round trip

        trips, statements = ex.round_trips, ex.statements
        assert await ex.run(writes) == 4
        # BEGIN + 7 statements + COMMIT
        assert (ex.statements - statements, ex.round_trips - trips) == (9, 3)
        assert await ex.run_single(lambda tx: tx.all("SELECT k, v FROM t ORDER BY k")) == [
            ("a", 2),
            ("b", 2),
            ("c", 3),
        ]
        # A deferred write's error fails the call at the next round trip, and nothing of
        # the transaction is committed.
        trips = ex.round_trips

        def failing(tx) -> None:
            tx.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("e", 5))
            tx.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("a", 5))  # duplicate key
            tx.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("f", 6))

        with pytest.raises(StoreError, match="duplicate key"):
            await ex.run(failing)
        assert await ex.run_single(lambda tx: tx.one("SELECT count(*) FROM t")) == (3,)
        assert ex.idle_connections >= 1  # rolled back, clean, pooled
        # A call that raises before any statement sends nothing.
        trips = ex.round_trips

        def nothing(tx) -> None:
            raise ValueError("before any statement")

        with pytest.raises(ValueError):
            await ex.run(nothing)
        assert ex.round_trips == trips
        # Autocommit: deferred writes are waited for at the end of the call.
        await ex.run_single(lambda tx: tx.execute("DELETE FROM t WHERE k = ?", ("c",)))
        assert ex.round_trips == trips + 1
        assert await ex.run_single(lambda tx: tx.one("SELECT count(*) FROM t")) == (2,)
    finally:
        await ex.aclose()


async def test_a_failed_prepare_is_not_remembered(pg_url: str) -> None:
    """A statement whose prepare failed (here: a table missing) is prepared again on its
    next use on the same connection."""
    ex = await PgTrioExecutor.open(pg_url, pool_size=1)
    try:
        with pytest.raises(StoreError, match="does not exist"):
            await ex.run(lambda tx: tx.all("SELECT v FROM later"))
        await ex.run(lambda tx: tx.execute("CREATE TABLE later (v int)"))
        assert await ex.run(lambda tx: tx.all("SELECT v FROM later")) == []
    finally:
        await ex.aclose()


async def test_a_large_batch_of_deferred_writes_goes_out_and_counts(pg_url: str) -> None:
    """Thousands of deferred statements in one transaction (more than the socket buffers
    hold): sent while results are read, every row counted."""
    ex = await _executor(PgTrioExecutor, pg_url)
    try:

        def many(tx) -> int:
            tx.executemany(
                "INSERT INTO t (k, v) VALUES (?, ?)", [(f"k{i}", i) for i in range(5000)]
            )
            return tx.rowcount

        assert await ex.run(many) == 5000
        assert await ex.run_single(lambda tx: tx.one("SELECT count(*) FROM t")) == (5000,)
    finally:
        await ex.aclose()


async def test_later_reads_and_the_last_statement_ride_with_the_commit(pg_url: str) -> None:
    """``later``: a read whose rows come back with the next round trip; ``last``: the
    call's last statement, sent with COMMIT; ``end``: COMMIT now. One round trip for a
    call written with them; an error in it commits nothing."""
    ex = await _executor(PgTrioExecutor, pg_url)
    try:

        def one_trip(tx) -> tuple:
            tx.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("a", 1))
            before = tx.later("SELECT count(*) FROM t")
            with pytest.raises(RuntimeError):
                before.rows  # noqa: B018 (not sent yet)
            tx.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("b", 2))
            rows = tx.last("SELECT k FROM t ORDER BY k")
            with pytest.raises(RuntimeError):
                tx.execute("DELETE FROM t")  # nothing after the last statement
            return before.rows, rows

        trips = ex.round_trips
        assert await ex.run(one_trip) == ([(1,)], [("a",), ("b",)])
        assert ex.round_trips == trips + 1
        assert await ex.run_single(lambda tx: tx.one("SELECT count(*) FROM t")) == (2,)

        def ended(tx) -> None:
            tx.execute("UPDATE t SET v = v + 10")
            tx.end()

        trips = ex.round_trips
        await ex.run(ended)
        assert ex.round_trips == trips + 1
        assert await ex.run_single(lambda tx: tx.all("SELECT v FROM t ORDER BY k")) == [
            (11,),
            (12,),
        ]

        def failing(tx) -> None:
            tx.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("c", 3))
            tx.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("a", 5))  # duplicate key
            tx.last("SELECT count(*) FROM t")

        with pytest.raises(StoreError, match="duplicate key"):
            await ex.run(failing)
        assert await ex.run_single(lambda tx: tx.one("SELECT count(*) FROM t")) == (2,)
        assert ex.idle_connections >= 1  # rolled back, clean, pooled
    finally:
        await ex.aclose()
