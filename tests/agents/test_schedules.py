"""Schedules (docs/runs.md) on the real stores with the real scheduler, worker and fake
ports; time is trio's mock clock, and the store's wall clock follows it
(:class:`TrioWall`), so minutes of ticks pass in milliseconds."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
from agents_fakes import FakeTools, ScriptedLLM, profile, task
from test_agents_stop import HangingLLM, Replies

from agentserver.agents.profile.schedule import (
    ScheduleInvalid,
    ScheduleSpec,
    missed,
)
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.runtime import AgentRuntime
from agentserver.agents.store.base import AgentStore
from agentserver.agents.store.sql import inbox, views
from agentserver.agents.store.sql import schedules as sql_schedules
from agentserver.agents.turn.scheduler import run_ref
from agentserver.app.runtime_parts import runtime_parts

START = 1_800_000_000.0  # a whole second


class TrioWall:
    """A wall clock that is trio's clock plus an offset (moved by MockClock)."""

    def __init__(self, start: float = START) -> None:
        self.base = start - trio.current_time()

    def now(self) -> float:
        return self.base + trio.current_time()


@pytest.fixture
def mock_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.05)


def spec(name: str = "tick", cron: str = "* * * * * *", **kw) -> ScheduleSpec:
    return ScheduleSpec(name=name, agent="assistant", cron=cron, payload=task(name), **kw)


async def open_store(kind: str, request, tmp_path, clock) -> AgentStore:
    settings = StoreSettings(path=tmp_path / "agents.sqlite3")
    if kind == "sqlite":
        from agentserver.agents.store.sqlite_store import SqliteAgentStore

        return SqliteAgentStore.open(settings.path, clock=clock, settings=settings)
    from agentserver.agents.store.pg.store import PostgresAgentStore

    url = request.getfixturevalue("pg_url")
    opened = PostgresAgentStore.open(url, clock=clock, settings=StoreSettings(url=url))
    return await opened if inspect.isawaitable(opened) else opened


def make(store: AgentStore, clock, llm=None, schedules=(), tmp_path=None) -> AgentRuntime:
    return AgentRuntime(
        runtime_parts(
            store=store,
            profiles={"assistant": profile()},
            llm=llm or ScriptedLLM(lambda r: "done"),
            tools=FakeTools(),
            replies=Replies(),
            settings=StoreSettings(path=tmp_path / "agents.sqlite3")
            if tmp_path
            else StoreSettings(),
            clock=clock,
            schedules=schedules,
        )
    )


@pytest.fixture(params=["sqlite", "postgresql"])
async def kind(request) -> AsyncIterator[str]:
    yield request.param


async def run_for(rts: list[AgentRuntime], seconds: float) -> None:
    async with trio.open_nursery() as nursery:
        for rt in rts:
            await nursery.start(rt.run)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()


async def test_each_second_fires_once_and_each_run_is_a_task(
    kind: str, request, tmp_path, mock_clock
) -> None:
    clock = TrioWall()
    store = await open_store(kind, request, tmp_path, clock)
    rt = make(store, clock, schedules=[spec()], tmp_path=tmp_path)
    try:
        await run_for([rt], 10.5)
        runs = await store.read(sql_schedules.runs, "tick")
        ticks = [t for _, t, _, _ in runs]
        assert ticks == sorted(set(ticks)) and 9 <= len(ticks) <= 11
        assert all(t == int(t) and t > START for t in ticks)
        assert {o for *_, o in runs} == {"fired"}
        [row] = await store.read(sql_schedules.list_schedules)
        assert row.fired == len(ticks) and row.last_outcome == "fired"
        # each run a task like any other: its Turn ran and ended
        assert [t["status"] for t in await tasks(store)] == ["consumed"] * len(ticks)
        late = [at - tick for name, tick, _, at in rt.scheduler.fired]
        assert max(late) < 0.2
    finally:
        await rt.aclose()


async def tasks(store: AgentStore) -> list[dict]:
    """The agent's tasks (its inbox rows), newest first, on either store."""
    return await store.read(views.recent_tasks, "assistant", 1000)


async def test_two_processes_fire_each_tick_once(request, tmp_path, mock_clock, caplog) -> None:
    clock = TrioWall()
    stores = [await open_store("postgresql", request, tmp_path, clock) for _ in range(2)]
    rts = [make(s, clock, schedules=[spec()], tmp_path=tmp_path) for s in stores]
    try:
        await run_for(rts, 10.5)
        runs = await stores[0].read(sql_schedules.runs, "tick")
        ticks = [t for _, t, _, _ in runs]
        assert len(ticks) == len(set(ticks)) and 9 <= len(ticks) <= 11
        by = [len(rt.scheduler.fired) for rt in rts]
        assert sum(by) == len(ticks)
        # The loser of each tick was told by the claim, not by a duplicate key.
        warned = [
            r.getMessage()
            for r in caplog.records
            if r.name == "agentserver.agents.turn.scheduler" and r.levelno >= logging.WARNING
        ]
        assert warned == []
    finally:
        for rt in rts:
            await rt.aclose()


async def claim(store: AgentStore, tick: float, next_tick: float, name: str = "tick"):
    """One claim of ``tick`` as the scheduler makes it (agents/turn/scheduler.py)."""
    return await store.run(
        sql_schedules.fire,
        name,
        tick,
        next_tick,
        run_ref(name, "assistant", tick),
        None,
        b"<cancelled/>",
    )


async def test_a_tick_is_claimed_only_while_it_is_the_schedules_next(
    kind: str, request, tmp_path, mock_clock
) -> None:
    """The claim's own condition (``next_tick`` = this tick), with no run of the tick
    recorded yet, so the primary key on ``schedule_runs`` cannot be what refuses it."""
    clock = TrioWall()
    store = await open_store(kind, request, tmp_path, clock)
    try:
        await store.run(inbox.ensure_agents, ["assistant"])
        tick = START + 60
        await store.run(sql_schedules.put_schedule, spec(), "api", tick, new=True)
        # A tick that is not the schedule's next (ahead of it, or one it moved past
        # without a run: skipped, paused): not claimed, nothing moved.
        assert await claim(store, tick + 1, tick + 2) is None
        assert await claim(store, tick - 1, tick) is None
        [row] = await store.read(sql_schedules.list_schedules)
        assert (row.next_tick, row.fired, row.skipped) == (tick, 0, 0)
        assert await store.read(sql_schedules.runs, "tick") == []
        # Its next tick is claimed once, and moves the schedule on.
        fired = await claim(store, tick, tick + 1)
        assert fired is not None and (fired.tick, fired.outcome) == (tick, "fired")
        [row] = await store.read(sql_schedules.list_schedules)
        assert (row.next_tick, row.fired) == (tick + 1, 1)
    finally:
        await store.aclose()


async def test_two_claimers_of_one_tick_one_wins_and_no_duplicate_is_attempted(
    kind: str, request, tmp_path, mock_clock, caplog
) -> None:
    """Two claimers of the same tick at once (on PostgreSQL two processes' connections
    to one store, on SQLite one store's): one run, and the loser is told None, not a
    duplicate key (the primary key on ``schedule_runs`` is a backstop, never the
    claim)."""
    clock = TrioWall()
    first = await open_store(kind, request, tmp_path, clock)
    second = await open_store(kind, request, tmp_path, clock) if kind == "postgresql" else first
    try:
        await first.run(inbox.ensure_agents, ["assistant"])
        tick = START + 60
        # overlap allow: every tick won starts a run (the runs never end here)
        await first.run(sql_schedules.put_schedule, spec(overlap="allow"), "api", tick, new=True)

        async def race(store: AgentStore, t: float, got: list[object]) -> None:
            got.append(await claim(store, t, t + 1))

        for n in range(5):  # five ticks in a row, each raced by both
            got: list[object] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(race, first, tick + n, got)
                nursery.start_soon(race, second, tick + n, got)
            assert sorted(f is None for f in got) == [False, True], got
        runs = await first.read(sql_schedules.runs, "tick")
        assert [t for _, t, _, _ in runs] == [tick + n for n in range(5)]
        [row] = await first.read(sql_schedules.list_schedules)
        assert (row.next_tick, row.fired) == (tick + 5, 5)
        noise = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not [m for m in noise if "duplicate" in m.lower() or "unique" in m.lower()]
    finally:
        await first.aclose()
        if second is not first:
            await second.aclose()


async def test_a_restart_catches_up_within_the_window_and_skips_beyond(
    kind: str, request, tmp_path, mock_clock
) -> None:
    clock = TrioWall()
    store = await open_store(kind, request, tmp_path, clock)
    minutely = [
        spec("near", "* * * * *", catchup_window_s=600),
        spec("far", "* * * * *", catchup_window_s=30),
    ]
    try:
        rt = make(store, clock, schedules=minutely, tmp_path=tmp_path)
        await run_for([rt], 1)  # registered; first ticks at the next minute
        before = {r.spec.name: r.next_tick for r in await store.read(sql_schedules.list_schedules)}
        await trio.sleep(60 * 5 + 1)  # "down" for five minutes and a second
        rt = make(store, clock, schedules=minutely, tmp_path=tmp_path)
        await run_for([rt], 0.5)
        rows = {r.spec.name: r for r in await store.read(sql_schedules.list_schedules)}
        near = await store.read(sql_schedules.runs, "near")
        assert [t for _, t, _, _ in near][:1] == [before["near"]]
        assert rows["near"].skipped + rows["near"].fired == 5 + 0
        # the five missed ticks: the first fires, the others meet it unfinished (skip)
        assert rows["near"].fired >= 1
        # far: the four ticks older than its 30 s window are counted skipped; the fifth
        # (a second ago) is within it and fires
        assert rows["far"].skipped == 4 and rows["far"].fired == 1
        [(_, far_tick, _, _)] = await store.read(sql_schedules.runs, "far")
        assert far_tick == before["far"] + 240
    finally:
        await rt.aclose()


@pytest.mark.parametrize(
    ("overlap", "queued_runs"),
    [("skip", 0), ("buffer-one", 1), ("buffer-all", 4), ("allow", 4), ("cancel-other", 0)],
)
async def test_overlap_with_a_run_that_does_not_end(
    kind: str, request, tmp_path, mock_clock, overlap: str, queued_runs: int
) -> None:
    """Each run hangs in its model call: what the next four ticks do."""
    clock = TrioWall()
    store = await open_store(kind, request, tmp_path, clock)
    llm = HangingLLM()
    hung = spec("hang", overlap=overlap)  # its task says "hang"
    rt = make(store, clock, llm=llm, schedules=[hung], tmp_path=tmp_path)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(rt.run)
            await llm.hanging.wait()
            await trio.sleep(4.2)
            nursery.cancel_scope.cancel()
        runs = await store.read(sql_schedules.runs, "hang")
        outcomes = [o for *_, o in runs]
        assert outcomes[0] == "fired"
        fired_later = [o for o in outcomes[1:] if o == "fired"]
        assert len(outcomes) == 5, outcomes
        if overlap == "skip":
            assert not fired_later
        elif overlap == "buffer-one":
            assert len(fired_later) == 1
        elif overlap == "cancel-other":
            assert len(fired_later) == 4
            # each new run cancelled the one before; the last, the test's end
            assert len(llm.cancelled) == 5
        else:
            assert len(fired_later) == 4
        queued = [t for t in await tasks(store) if t["status"] == "queued"]
        assert len(queued) == queued_runs
    finally:
        await rt.aclose()


async def test_pause_resume_trigger_delete(kind: str, request, tmp_path, mock_clock) -> None:
    clock = TrioWall()
    store = await open_store(kind, request, tmp_path, clock)
    rt = make(store, clock, tmp_path=tmp_path)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(rt.run)
            await rt.scheduler.add(spec("api"))
            await trio.sleep(3.5)
            await rt.scheduler.pause("api", True)
            n = len(await store.read(sql_schedules.runs, "api"))
            await trio.sleep(5)
            assert len(await store.read(sql_schedules.runs, "api")) == n
            fired = await rt.scheduler.trigger("api")
            assert fired is not None and fired.outcome == "triggered"
            await rt.scheduler.pause("api", False)
            await trio.sleep(2.2)
            assert len(await store.read(sql_schedules.runs, "api")) >= n + 3
            await rt.scheduler.delete("api")
            assert await store.read(sql_schedules.list_schedules) == []
            nursery.cancel_scope.cancel()
    finally:
        await rt.aclose()


def test_settings_are_checked() -> None:
    for bad in (
        dict(cron="not cron"),
        dict(timezone="Mars/Base"),
        dict(overlap="sometimes"),
        dict(name="no spaces"),
        dict(jitter_s=-1),
    ):
        with pytest.raises(ScheduleInvalid):
            ScheduleSpec(**{**dict(name="x", agent="a", cron="* * * * *", payload=b"<x/>"), **bad})


def test_daylight_saving_is_cronsim_s() -> None:
    s = ScheduleSpec("dst", "a", "30 2 * * *", b"<x/>", timezone="Europe/Berlin")
    import datetime

    t = datetime.datetime(2026, 3, 28, 12, tzinfo=datetime.UTC).timestamp()
    ticks = s.ticks_after(t)
    first = datetime.datetime.fromtimestamp(next(ticks), datetime.UTC)
    assert first == datetime.datetime(2026, 3, 29, 1, 0, tzinfo=datetime.UTC)  # 03:00 CEST


def test_missed_counts_and_moves_on() -> None:
    s = ScheduleSpec("m", "a", "* * * * * *", b"<x/>")
    assert missed(s, 100, 110) == (11, 111.0)
    j = ScheduleSpec("j", "a", "* * * * * *", b"<x/>", jitter_s=0.5)
    assert 0 <= j.offset(100.0) < 0.5 and j.offset(100.0) == j.offset(100.0)
