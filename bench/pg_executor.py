"""Benchmark: the PostgreSQL store's two executors on the same calls, per call.

Each call pair is the shape of a Turn's hot store calls: a transaction (a
compare-and-set ``UPDATE … RETURNING`` whose answer is needed, two ``INSERT``s and an
``UPDATE`` nobody asks the row count of) and an autocommit read. ``--concurrency`` trio
tasks (default 4, the runners of one process) share one executor of 8 connections. The
thread executor (``agents/store/pg/executor.py``: a worker thread per call, one round trip per
statement) and the trio one (``agents/store/pg/trio_executor.py``: the trio thread, writes
deferred to the next read or ``COMMIT``) run alternately, ``--rounds`` times each, in one
invocation against one database.

Figures per executor (the median over its rounds): calls/s; the application's CPU per call
(this process, all its threads); the database server's CPU per call (every process of
the server, from /proc: bench/support/pgcpu.py; null if the server is not on this machine); round
trips per call (the trio executor counts them; the thread one sends one per statement,
``BEGIN`` and ``COMMIT`` included: 7 per pair, counted here by construction).

Usage: python bench/pg_executor.py --store URL [--calls N] [--concurrency C] [--rounds R]
The last line printed is one JSON object with both executors and the trio/thread ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import trio

from agentserver.agents.store.pg.executor import PgExecutor
from agentserver.agents.store.pg.trio_executor import PgTrioExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))  # pgcpu.py
import pgcpu

EXECUTORS = {"thread": PgExecutor, "trio": PgTrioExecutor}
#: The thread executor's round trips per call pair: BEGIN, 4 statements, COMMIT; the read.
THREAD_TRIPS_PER_PAIR = 7


def setup(tx) -> None:
    tx.execute("DROP TABLE IF EXISTS bench_heads")
    tx.execute("DROP TABLE IF EXISTS bench_cards")
    tx.execute("CREATE TABLE bench_heads (id int PRIMARY KEY, epoch int, n int)")
    tx.execute(
        "CREATE TABLE bench_cards (id bigserial PRIMARY KEY, head int, body text, meta text)"
    )
    tx.execute("CREATE INDEX ON bench_cards (head, id)")
    tx.executemany("INSERT INTO bench_heads VALUES (?, 0, 0)", [(i,) for i in range(16)])


def write(tx, i: int) -> tuple:
    head = i % 16
    row = tx.one(
        "UPDATE bench_heads SET n = n + 1, epoch = epoch + 1 WHERE id = ? RETURNING epoch, n",
        (head,),
    )
    for body, meta in (("x" * 200, '{"a": 1}'), ("y" * 200, '{"b": 2}')):
        tx.execute(
            "INSERT INTO bench_cards (head, body, meta) VALUES (?, ?, ?)", (head, body, meta)
        )
    tx.execute("UPDATE bench_heads SET n = n WHERE id = ?", (head,))
    return row


def read(tx, i: int) -> list:
    return tx.all(
        "SELECT id, body FROM bench_cards WHERE head = ? ORDER BY id DESC LIMIT 5", (i % 16,)
    )


async def one_round(kind: str, url: str, calls: int, concurrency: int) -> dict:
    ex = await EXECUTORS[kind].open(url, pool_size=8)
    try:
        await ex.run(setup)
        postmaster = pgcpu.postmaster_pid(url)
        todo = iter(range(calls // 2))
        trips0 = getattr(ex, "round_trips", 0)

        async def worker() -> None:
            for i in todo:
                await ex.run(write, i)
                await ex.run_single(read, i)

        db0 = pgcpu.server_cpu_s(postmaster)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        db1 = pgcpu.server_cpu_s(postmaster)
        done = 2 * (calls // 2)
        trips = ex.round_trips - trips0 if kind == "trio" else THREAD_TRIPS_PER_PAIR * done // 2
        return {
            "calls_per_s": done / elapsed,
            "app_us_per_call": cpu * 1e6 / done,
            "db_us_per_call": (db1 - db0) * 1e6 / done if db0 is not None else None,
            "round_trips_per_call": trips / done,
        }
    finally:
        await ex.aclose()


def median(rounds: list[dict], key: str) -> float | None:
    values = [r[key] for r in rounds if r[key] is not None]
    return round(statistics.median(values), 1) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", metavar="URL", required=True, help="a database of its own")
    ap.add_argument("--calls", type=int, default=4000, help="calls per round (default 4000)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per executor (default 3)")
    args = ap.parse_args()
    rounds: dict[str, list[dict]] = {k: [] for k in EXECUTORS}
    for _ in range(args.rounds):
        for kind in EXECUTORS:  # alternating: the machine's load hits both alike
            got = trio.run(one_round, kind, args.store, args.calls, args.concurrency)
            rounds[kind].append(got)
            print(kind, json.dumps({k: round(v, 1) for k, v in got.items() if v is not None}))
    keys = ("calls_per_s", "app_us_per_call", "db_us_per_call", "round_trips_per_call")
    out: dict[str, object] = {k: {key: median(v, key) for key in keys} for k, v in rounds.items()}
    for key in keys:
        a, b = out["trio"][key], out["thread"][key]  # type: ignore[index]
        out[f"ratio_{key}"] = round(a / b, 2) if a is not None and b else None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
