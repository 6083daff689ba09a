"""Schedules, black-box and for real on the 1-second scale (docs/runs.md): the server as a
subprocess with a schedule firing every second, a scripted model that notes when each
Turn starts. Each tick fires once: across a SIGKILL (a tick missed while down fires on
start within the catch-up window), and across two processes on one PostgreSQL store."""

from __future__ import annotations

import signal
import sqlite3
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from llm.llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import DATA, ServerProcess, subprocess_env

BOOT = DATA / "schedules-boot.xml"


class Model(FakeServer):
    """Answers at once, noting the wall time each Turn's first call arrived."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.starts: list[float] = []

    def default(self, seen: Seen) -> Script:
        self.starts.append(time.time())
        return openai_ok("it is now")


async def start(env: dict[str, str], cwd: Path) -> ServerProcess:
    return await trio.to_thread.run_sync(lambda: ServerProcess.start(BOOT, env=env, cwd=cwd))


def sqlite_rows(cwd: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(cwd / "state" / "agents.sqlite3") as db:
        return db.execute(sql).fetchall()


def pg_rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url) as conn:
        return conn.execute(sql).fetchall()


RUNS = (
    "SELECT r.tick, r.outcome, r.inbox_id, i.status FROM schedule_runs r "
    "LEFT JOIN agent_inbox i ON i.inbox_id = r.inbox_id ORDER BY r.tick"
)


#: Each run's inbox row and the start of its Turn's first step.
TURN_STARTS = (
    "SELECT i.inbox_id, min(s.started_at) FROM schedule_runs r JOIN agent_inbox i "
    "ON i.inbox_id = r.inbox_id JOIN agent_steps s ON s.agent_turn_id = i.agent_turn_id "
    "GROUP BY i.inbox_id"
)


def check_once(runs: list[tuple[Any, ...]], skipped: int) -> tuple[list[float], int]:
    """Every tick from the first to the last is accounted for once: a run (fired with its
    task, or skipped by overlap) or counted as missed; each fired run's task exists.
    ``skipped``: the schedule's counter (overlap skips and missed ticks). Returns the
    ticks and how many were missed."""
    ticks = [float(r[0]) for r in runs]
    assert ticks == sorted(set(ticks)), "a tick fired twice"
    missed = skipped - sum(1 for r in runs if r[2] is None)
    span = int(ticks[-1] - ticks[0]) + 1
    assert len(ticks) + missed == span, (ticks, skipped)
    for tick, outcome, inbox_id, status in runs:
        if outcome == "fired":
            assert inbox_id is not None and status is not None, tick  # claimed => queued
    return ticks, missed


async def test_every_second_for_real_and_across_a_sigkill(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        env = subprocess_env(SCHED_LLM_BASE_URL=model.base_url, SCHED_LLM_KEY="k")
        server = await start(env, tmp_path)
        try:
            await trio.sleep(3.2)
            killed_at = time.time()
            server.stop(signal.SIGKILL)
            await trio.sleep(1.5)  # ticks missed while down: within catchup-window (5 s)
            server = await start(env, tmp_path)
            await trio.sleep(3.2)
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
    runs = sqlite_rows(tmp_path, RUNS)
    [(skipped,)] = sqlite_rows(tmp_path, "SELECT skipped FROM schedules")
    ticks, missed = check_once(runs, int(skipped))
    assert missed == 0 and len(ticks) >= 6  # the ticks missed while down fired on start
    # A start within about a second of its time: the Turns of the ticks before the kill
    # (those after it waited for the server to start again, as they should).
    starts = dict(sqlite_rows(tmp_path, TURN_STARTS))
    before = [
        starts[r[2]] - float(r[0]) for r in runs if r[2] in starts and float(r[0]) < killed_at - 0.5
    ]
    assert before and all(0 <= d < 1.5 for d in before), before
    assert statistics.median(before) < 1.0, before


async def test_two_processes_fire_each_tick_once(request: pytest.FixtureRequest, tmp_path):
    url = request.getfixturevalue("pg_url")
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        env = subprocess_env(
            SCHED_LLM_BASE_URL=model.base_url, SCHED_LLM_KEY="k", SCHED_STORE_URL=url
        )
        for side in ("a", "b"):
            (tmp_path / side).mkdir()
        a = await start(env, tmp_path / "a")
        b = await start(env, tmp_path / "b")
        try:
            await trio.sleep(3.2)
            a.stop(signal.SIGKILL)  # one dies: the other goes on alone
            await trio.sleep(2.2)
        finally:
            for s in (a, b):
                await trio.to_thread.run_sync(s.stop)
            nursery.cancel_scope.cancel()
    runs = pg_rows(url, RUNS)
    [(skipped,)] = pg_rows(url, "SELECT skipped FROM schedules")
    ticks, _ = check_once(runs, int(skipped))
    assert len(ticks) >= 4
    for server in (a, b):
        assert "schedules:" not in server.stderr, server.stderr
