"""Schedules, black-box and for real on the 1-second scale (docs/runs.md): the server as a
subprocess with a schedule firing every second, a scripted model that notes when each
Turn starts. Each tick fires once: across a SIGKILL (a tick missed while down fires on
start within the catch-up window), and across two processes on one PostgreSQL store."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from llm_fakes import FakeServer, Script, Seen, openai_ok
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


async def wait_for_starts(model: Model, n: int, within: float = 60.0) -> None:
    """Until the model has seen ``n`` Turns start (a bound: a loaded machine only waits
    longer; no test here checks how long anything took)."""
    with trio.fail_after(within):
        while True:
            if len(model.starts) >= n:
                return
            await trio.sleep(0.05)


def boot_in(tmp_path: Path) -> Path:
    """The schedules boot with a catch-up window of a minute: a restart slowed by a loaded
    machine still finds the ticks it missed inside it (what is checked is that they fire
    on start, not how fast the server starts)."""
    text = BOOT.read_text().replace('catchup-window="5"', 'catchup-window="60"')
    assert 'catchup-window="60"' in text
    (tmp_path / BOOT.name).write_text(text)
    return tmp_path / BOOT.name


async def test_every_second_for_real_and_across_a_sigkill(tmp_path: Path) -> None:
    boot = boot_in(tmp_path)
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        env = subprocess_env(SCHED_LLM_BASE_URL=model.base_url, SCHED_LLM_KEY="k")
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(boot, env=env, cwd=tmp_path)
        )
        try:
            await wait_for_starts(model, 3)
            killed_at = time.time()
            server.stop(signal.SIGKILL)
            # Down at least this long: at least one tick falls while it is down.
            await trio.sleep(1.5)
            restarted_at = time.time()
            server = await trio.to_thread.run_sync(
                lambda: ServerProcess.start(boot, env=env, cwd=tmp_path)
            )
            await wait_for_starts(model, len(model.starts) + 3)
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
    runs = sqlite_rows(tmp_path, RUNS)
    [(skipped,)] = sqlite_rows(tmp_path, "SELECT skipped FROM schedules")
    ticks, missed = check_once(runs, int(skipped))
    assert missed == 0 and len(ticks) >= 6, (runs, skipped)
    # The ticks missed while down: within the catch-up window, the first fired on start.
    down = [r for r in runs if killed_at < float(r[0]) < restarted_at]
    assert down and down[0][1] == "fired", (down, killed_at, restarted_at)
    # Each fired run's Turn started (the store's own times), never before its tick, and
    # the Turns started in the order of their ticks.
    starts = dict(sqlite_rows(tmp_path, TURN_STARTS))
    fired = [r for r in runs if r[1] == "fired"]
    assert all(r[2] in starts for r in fired if r[3] == "consumed"), (fired, starts)
    began = [(float(r[0]), starts[r[2]]) for r in fired if r[2] in starts]
    assert len(began) >= 5 and all(start >= tick for tick, start in began), began
    assert [s for _, s in began] == sorted(s for _, s in began), began


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
            await wait_for_starts(model, 3)
            a.stop(signal.SIGKILL)  # one dies: the other goes on alone
            await wait_for_starts(model, len(model.starts) + 2)
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
