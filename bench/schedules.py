"""Benchmark: how late a scheduled run starts (docs/runs.md, "Schedules").

The real runtime, scheduler, worker and store (SQLite by default; ``--store URL`` for
PostgreSQL), an instant scripted model, no pump (a run's answer goes nowhere). K agents
each have one schedule firing every second (cronsim's seconds field: ``* * * * * *``),
so the run collects ``--ticks`` ticks in ``ticks / K`` seconds of real time: no clock is
faked. For each tick, the delay is from the scheduled second (the tick) to its Turn's
start: the ``started_at`` of the Turn's first model step in the store (the scheduler's
claim, the lease, the worker's claim and the step's start all included). Every tick must
have fired exactly once with its Turn run: the bench fails otherwise.

Usage: python bench/schedules.py [--ticks 200] [--agents 4] [--store URL]
The last line printed is one JSON object: p50/p99/max delay (ms) and the tick count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
from lxml import etree

from agentserver.agents.clock import SystemClock
from agentserver.agents.ports import LLMCompletion, LLMRequest, LLMUsage
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.schedule import ScheduleSpec
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.runtime import AgentRuntime, open_agent_store
from agentserver.agents.store.sql import schedules as sql_schedules
from agentserver.app.runtime_parts import runtime_parts

GOAL_P99_MS = 1000.0


class InstantLLM:
    async def complete(self, request: LLMRequest) -> LLMCompletion:
        return LLMCompletion("it is time", LLMUsage(10, 5, 15), cost=0.0, model="m", backend="b")


class NoTools:
    async def call(self, agent: str, turn_thread: Any, payload: Any, to: Any, *, key=None) -> str:
        raise RuntimeError("no tools in this bench")

    def check_call(self, agent: str, payload: Any, to: Any) -> None:
        raise RuntimeError("no tools in this bench")

    async def self_iterate(self, agent: str, turn_thread: Any, payload: Any) -> None:
        raise RuntimeError("no tools in this bench")


class Nowhere:
    async def deliver(self, reply_ref: Any, payload: etree._Element, *, failed: bool, turn_id: str):
        return None


def task(i: int) -> bytes:
    el = etree.Element(f"{{urn:bench:agent{i}}}task", nsmap={None: f"urn:bench:agent{i}"})
    el.text = "what time is it?"
    return etree.tostring(el)


async def measure(path: Path, url: str | None, ticks: int, agents: int) -> dict[str, Any]:
    names = [f"agent{i}" for i in range(agents)]
    profiles = {
        n: AgentProfile(name=n, model="m", own_roots=(f"{{urn:bench:agent{i}}}task",))
        for i, n in enumerate(names)
    }
    schedules = [
        ScheduleSpec(f"s{i}", n, "* * * * * *", task(i), overlap="allow", catchup_window_s=1)
        for i, n in enumerate(names)
    ]
    settings = StoreSettings(path=path, url=url, worker_concurrency=max(2, agents))
    clock = SystemClock()
    store = open_agent_store(settings, profiles, clock=clock)
    if url:
        await store.run(
            sql_schedules.drop_boot_schedules, []
        )  # a reused database: start from no schedules
    rt = AgentRuntime(
        runtime_parts(
            store=store,
            profiles=profiles,
            settings=settings,
            clock=clock,
            llm=InstantLLM(),
            tools=NoTools(),
            replies=Nowhere(),
            schedules=schedules,
        )
    )
    seconds = ticks / agents
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(rt.run)
            await trio.sleep(seconds + 1.5)
            nursery.cancel_scope.cancel()
        runs = await store.read(sql_schedules.runs)
    finally:
        await rt.aclose()
    starts = turn_starts(path, url)
    delays = []
    for name, tick, inbox_id, outcome in runs:
        if outcome != "fired" or inbox_id not in starts:
            raise SystemExit(f"tick {tick:.0f} of {name}: {outcome}, no Turn ran")
        delays.append((starts[inbox_id] - tick) * 1000)
    by = {}
    for name, tick, _, _ in runs:
        by.setdefault(name, []).append(tick)
    for name, got in by.items():
        if got != sorted(set(got)) or got[-1] - got[0] + 1 != len(got):
            raise SystemExit(f"{name}: a tick fired twice or not at all: {got}")
    delays.sort()
    return {
        "bench": "schedules",
        "store": "postgresql" if url else "sqlite",
        "ticks": len(delays),
        "agents": agents,
        "delay_ms_p50": round(statistics.median(delays), 1),
        "delay_ms_p99": round(delays[min(len(delays) - 1, int(len(delays) * 0.99))], 1),
        "delay_ms_max": round(delays[-1], 1),
        "goal_p99_ms": GOAL_P99_MS,
    }


TURN_STARTS = (
    "SELECT i.inbox_id, min(s.started_at) FROM schedule_runs r JOIN agent_inbox i "
    "ON i.inbox_id = r.inbox_id JOIN agent_steps s ON s.agent_turn_id = i.agent_turn_id "
    "GROUP BY i.inbox_id"
)


def turn_starts(path: Path, url: str | None) -> dict[str, float]:
    """inbox id of each run -> the started_at of its Turn's first step (read directly)."""
    if url:
        import psycopg

        with psycopg.connect(url) as conn:
            rows = conn.execute(TURN_STARTS).fetchall()
    else:
        import sqlite3

        with sqlite3.connect(path) as db:
            rows = db.execute(TURN_STARTS).fetchall()
    return {r[0]: float(r[1]) for r in rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ticks", type=int, default=200, help="ticks in all (default: 200)")
    p.add_argument("--agents", type=int, default=4, help="agents, one schedule each")
    p.add_argument("--store", metavar="URL", help="a PostgreSQL database of its own")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = trio.run(
            measure, Path(tmp) / "agents.sqlite3", args.store, args.ticks, args.agents
        )
    print(json.dumps(result))
    return 0 if result["delay_ms_p99"] < GOAL_P99_MS else 1


if __name__ == "__main__":
    sys.exit(main())
