"""Spend budgets on a real store (SQLite file; PostgreSQL when configured): reservation
all-or-nothing, the race of many concurrent callers (two stores on one PostgreSQL
database stand for two processes), settle and release, the watchdog's release of a dead
caller's holds, a period rollover, the soft mark once per period, and streaming without
usage settled at the worst case (docs/budgets.md)."""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio

from agentserver.agents.clock import ManualClock
from agentserver.agents.events import BudgetEvent, EventBus
from agentserver.agents.governance.budgets import Budgets, BudgetSpent, WorstPrice
from agentserver.agents.policy.budget import (
    BudgetSpec,
    Need,
    applicable,
    parse_soft,
    period_bounds,
)
from agentserver.agents.ports import LLMCompletion, LLMMessage, LLMRequest, LLMUsage
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store import outbox as store_outbox
from agentserver.agents.store.sql import budgets as sql_budgets
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.sql import inbox, turn_end, turns
from agentserver.agents.store.sql_store import SqlAgentStore

# 2026-11-27 12:00 UTC, a Friday
NOON = 1_795_780_800.0


async def open_store(kind: str, request: pytest.FixtureRequest, tmp_path, clock) -> SqlAgentStore:
    settings = StoreSettings(path=tmp_path / "agents.sqlite3")
    if kind == "sqlite":
        from agentserver.agents.store.sqlite_store import SqliteAgentStore

        return SqliteAgentStore.open(settings.path, clock=clock, settings=settings)
    from agentserver.agents.store.pg.store import PostgresAgentStore

    url = request.getfixturevalue("pg_url")
    opened = PostgresAgentStore.open(url, clock=clock, settings=settings)
    return await opened if inspect.isawaitable(opened) else opened


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
async def store(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[SqlAgentStore]:
    s = await open_store(request.param, request, tmp_path, ManualClock(NOON))
    try:
        yield s
    finally:
        await s.aclose()


def clock_of(store: SqlAgentStore) -> ManualClock:
    clock = store.env.clock
    assert isinstance(clock, ManualClock)
    return clock


def test_periods_start_at_local_midnight_monday_and_the_first():
    day = period_bounds("day", "UTC", NOON)
    assert day == (NOON - 12 * 3600, NOON + 12 * 3600)
    week = period_bounds("week", "UTC", NOON)  # Friday: the week began on Monday the 23rd
    assert week[0] == NOON - 4 * 86400 - 12 * 3600 and week[1] - week[0] == 7 * 86400
    month = period_bounds("month", "UTC", NOON)
    assert month[1] - month[0] == 30 * 86400  # November
    assert period_bounds("total", "UTC", NOON) == (0.0, math.inf)
    paris = period_bounds("day", "Europe/Paris", NOON)
    assert paris[0] == day[0] - 3600  # midnight in Paris is 23:00 UTC in November
    assert parse_soft("80%") == 0.8
    with pytest.raises(ValueError):
        parse_soft("0.8")
    with pytest.raises(ValueError):
        BudgetSpec("agent:a", period="year", tokens=1)
    with pytest.raises(ValueError):
        BudgetSpec("agent:a", timezone="Mars/Olympus", tokens=1)
    assert applicable({"organism", "agent:a", "client:c@agent:a"}, "a", "c") == [
        "agent:a",
        "client:c@agent:a",
        "organism",
    ]
    assert applicable({"agent:b"}, "a", "c") == []


async def test_a_reservation_is_taken_in_every_budget_or_in_none(store):
    budgets = Budgets(
        store,
        clock_of(store),
        [BudgetSpec("agent:a", tokens=1000, period="day"), BudgetSpec("client:c", tokens=150)],
    )
    hold = await budgets.reserve("a", "c", Need(100, 0.0), 60)
    assert hold is not None and len(hold.keys) == 2
    # 100 more would pass agent:a but not client:c: refused, nothing held anywhere
    with pytest.raises(BudgetSpent) as refused:
        await budgets.reserve("a", "c", Need(100, 0.0), 60)
    # (issue 45: a budget with room left, but less than the worst case, says so)
    assert str(refused.value) == (
        "budget exhausted: this call needs up to 100 tokens; 50 remain of client:c (month);"
        " it resets at 2026-12-01T00:00:00Z"
    )
    rows = {r.budget: r for r in await budgets.rows()}
    assert rows["agent:a"].reserved_tokens == 100 and rows["client:c"].reserved_tokens == 100
    assert rows["client:c"].refusals == 1 and rows["agent:a"].refusals == 0
    # once nothing is left, the budget "is spent" (the old text)
    rest = await budgets.reserve("a", "c", Need(50, 0.0), 60)
    assert rest is not None
    with pytest.raises(BudgetSpent) as refused:
        await budgets.reserve("a", "c", Need(1, 0.0), 60)
    assert str(refused.value) == (
        "budget exhausted: client:c (month) is spent; it resets at 2026-12-01T00:00:00Z"
    )
    await budgets.release(rest)
    # another client pays only into agent:a
    other = await budgets.reserve("a", "d", Need(100, 0.0), 60)
    assert other is not None and len(other.keys) == 1
    await budgets.release(other)
    # settled to the reported usage, the hold released
    done = LLMCompletion("ok", LLMUsage(30, 10, 40), cost=0.0)
    await budgets.settle(hold, done, agent="a", turn=None)
    rows = {r.budget: r for r in await budgets.rows()}
    assert (rows["agent:a"].spent_tokens, rows["agent:a"].reserved_tokens) == (40, 0)
    assert (rows["client:c"].spent_tokens, rows["client:c"].reserved_tokens) == (40, 0)
    assert rows["client:c"].remaining() == (110, None)


async def test_a_refusal_for_cost_gives_the_cost_figures(store):
    """Issue 45: tokens fit but the cost does not: the cost's figures are given."""
    budgets = Budgets(
        store, clock_of(store), [BudgetSpec("agent:a", tokens=1000, cost=1.0, period="total")]
    )
    assert await budgets.reserve("a", None, Need(10, 0.75), 60) is not None
    with pytest.raises(BudgetSpent) as refused:
        await budgets.reserve("a", None, Need(10, 0.5), 60)
    assert str(refused.value) == (
        "budget exhausted: this call needs up to 0.5 in cost; 0.25 remain of agent:a (total);"
        " it never resets (period total)"
    )
    # the budget's token limit is the one without room: tokens are named first
    with pytest.raises(BudgetSpent) as refused:
        await budgets.reserve("a", None, Need(1405, 0.5), 60)
    assert "this call needs up to 1,405 tokens; 990 remain of agent:a (total)" in str(refused.value)


async def race(budgets: list[Budgets], callers: int, need: Need) -> tuple[int, int]:
    """``callers`` concurrent reserve-then-settle-at-worst-case calls spread over the
    ``budgets`` objects; returns (admitted, refused)."""
    admitted = refused = 0

    async def one(i: int) -> None:
        nonlocal admitted, refused
        b = budgets[i % len(budgets)]
        try:
            hold = await b.reserve("a", f"c{i % 4}", need, 60)
        except BudgetSpent as exc:
            assert exc.budget == "agent:a"
            refused += 1
            return
        assert hold is not None
        admitted += 1
        await trio.sleep(0.001 * (i % 7))
        await b.settle(hold, None, agent="a", turn=None)  # no usage: the worst case

    async with trio.open_nursery() as n:
        for i in range(callers):
            n.start_soon(one, i)
    return admitted, refused


async def test_one_hundred_concurrent_callers_never_overspend(store):
    worst = Need(500, 0.005)
    spec = BudgetSpec("agent:a", tokens=10 * 500, cost=1.0, period="day")
    budgets = Budgets(store, clock_of(store), [spec], price=WorstPrice(1, 1))
    admitted, refused = await race([budgets], 100, worst)
    assert (admitted, refused) == (10, 90)
    [row] = await budgets.rows()
    assert row.spent_tokens == 5000 <= spec.tokens and row.reserved_tokens == 0
    assert row.refusals == 90


@pytest.mark.postgresql
async def test_two_stores_on_one_database_share_the_budget(request, tmp_path):
    """Two stores, each its own connection pool (as two processes have), race for one
    budget: the reservation is one statement, so together they never overspend."""
    clock = ManualClock(NOON)
    a = await open_store("postgresql", request, tmp_path, clock)
    b = await open_store("postgresql", request, tmp_path, clock)
    try:
        spec = BudgetSpec("agent:a", tokens=10 * 300, period="day")
        both = [Budgets(a, clock, [spec]), Budgets(b, clock, [spec])]
        admitted, refused = await race(both, 100, Need(300, 0.0))
        assert (admitted, refused) == (10, 90)
        [row] = await both[0].rows()
        assert (row.spent_tokens, row.reserved_tokens) == (3000, 0)
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.postgresql
async def test_a_hold_released_by_two_processes_at_once_is_released_once(request, tmp_path):
    """Issue 43: a hold's settle (its caller) and another process's release of it (its
    watchdog) may run at once: ``reserved`` is lowered once (the release deletes the
    hold and reads what it held in one statement)."""
    clock = ManualClock(NOON)
    a = await open_store("postgresql", request, tmp_path, clock)
    b = await open_store("postgresql", request, tmp_path, clock)
    try:
        spec = BudgetSpec("agent:a", tokens=10**6, period="day")
        mine, other = Budgets(a, clock, [spec]), Budgets(b, clock, [spec])
        holds = [await mine.reserve("a", None, Need(100, 0.0), 10) for _ in range(40)]
        clock.advance(10 + 10 + 1)  # all expired: the other's watchdog may take them
        async with trio.open_nursery() as nursery:
            for hold in holds:
                assert hold is not None
                nursery.start_soon(partial(mine.settle, hold, None, agent="a", turn=None))
                nursery.start_soon(other.release, hold)
                nursery.start_soon(other.release_expired)
        [row] = await mine.rows()
        assert (row.spent_tokens, row.reserved_tokens) == (40 * 100, 0)
    finally:
        await a.aclose()
        await b.aclose()


async def test_the_watchdog_releases_a_dead_callers_holds(store):
    budgets = Budgets(store, clock_of(store), [BudgetSpec("organism", tokens=1000)])
    hold = await budgets.reserve("a", None, Need(600, 0.0), 10)
    assert hold is not None
    with pytest.raises(BudgetSpent):
        await budgets.reserve("a", None, Need(600, 0.0), 10)
    # the caller dies: nothing settles. Before the hold's expiry nothing is released
    assert await budgets.release_expired() == 0
    clock_of(store).advance(10 + 10 + 1)
    assert await budgets.release_expired() == 1
    [row] = await budgets.rows()
    assert row.reserved_tokens == 0 and row.spent_tokens == 0
    assert await budgets.reserve("a", None, Need(600, 0.0), 10) is not None
    # a late settle of the released hold still counts what was spent
    await budgets.settle(hold, None, agent="a", turn=None)
    [row] = await budgets.rows()
    assert (row.spent_tokens, row.reserved_tokens) == (600, 600)


async def test_a_new_period_starts_with_nothing_spent(store):
    clock = clock_of(store)
    budgets = Budgets(store, clock, [BudgetSpec("agent:a", tokens=100, period="day")])
    hold = await budgets.reserve("a", None, Need(100, 0.0), 10)
    assert hold is not None
    await budgets.settle(hold, None, agent="a", turn=None)
    with pytest.raises(BudgetSpent) as refused:
        await budgets.reserve("a", None, Need(1, 0.0), 10)
    assert "it resets at 2026-11-28T00:00:00Z" in str(refused.value)
    clock.set(NOON + 12 * 3600 + 1)  # one second past midnight
    assert await budgets.reserve("a", None, Need(100, 0.0), 10) is not None
    [row] = await budgets.rows()
    assert row.period_start == NOON + 12 * 3600 and row.reserved_tokens == 100


async def test_soft_fires_once_per_period(store):
    bus = EventBus()
    clock = clock_of(store)
    spec = BudgetSpec("agent:a", tokens=1000, period="day", soft=0.5)
    budgets = Budgets(store, clock, [spec], events=bus)
    seen: list[BudgetEvent] = []
    bus.observe(lambda e: seen.append(e) if isinstance(e, BudgetEvent) else None)
    for _ in range(4):
        hold = await budgets.reserve("a", None, Need(200, 0.0), 10)
        assert hold is not None
        await budgets.settle(hold, None, agent="a", turn="t")
    assert [(e.kind, e.budget, e.spent_tokens) for e in seen] == [("budget.soft", "agent:a", 600)]
    clock.advance(86400)
    hold = await budgets.reserve("a", None, Need(600, 0.0), 10)
    assert hold is not None
    await budgets.settle(hold, None, agent="a", turn="t")
    assert len(seen) == 2


async def test_budget_soft_is_in_the_outbox_with_its_mark(store):
    """A webhook wants ``budget.soft``: its outbox row commits in the settle that marks the
    crossing (a process killed right after the commit loses no event), and the bus's
    durable observer is not handed it again (docs/webhooks.md)."""
    from agentserver.agents.edge.hooksign import new_secret
    from agentserver.agents.edge.outbox import Outbox
    from agentserver.agents.edge.webhooks import WebhookDirectory, Webhooks
    from agentserver.agents.profile.webhooks import WebhookSpec

    bus = EventBus()
    clock = clock_of(store)
    hook = WebhookSpec("w", "http://127.0.0.1:9/h", ("budget.soft",), new_secret())
    hook_bus = EventBus()
    directory = WebhookDirectory(store, hook_bus)
    outbox = Outbox(store, clock.now, directory=directory)
    hooks = Webhooks(store, directory, outbox, hook_bus, clock.now, (hook,))
    offered: list[object] = []
    bus.observe_durably(offered.append, hooks.render_durable)
    spec = BudgetSpec("agent:a", tokens=1000, period="day", soft=0.5)
    budgets = Budgets(store, clock, [spec], events=bus)
    seen: list[BudgetEvent] = []
    bus.observe(lambda e: seen.append(e) if isinstance(e, BudgetEvent) else None)
    for _ in range(3):
        hold = await budgets.reserve("a", None, Need(200, 0.0), 10)
        assert hold is not None
        await budgets.settle(hold, None, agent="a", turn="t")
    [event] = seen  # still published to the bus's other observers, once
    assert offered == []  # written already: the durable observer skips it
    [row] = await store.read(store_outbox.deliveries, "webhook:w", 10)
    assert row["status"] == "pending"
    rows = await store.run(store_outbox.claim, "test", 30.0, 10)
    assert [r.dedupe_key for r in rows] == [f"w:{event.dedupe_key}"]
    assert json.loads(rows[0].body)["data"]["budget"] == "agent:a"


class StreamingModel:
    """A port whose stream ends without a final completion carrying usage."""

    def __init__(self, usage: LLMUsage, fail: bool = False) -> None:
        self.usage = usage
        self.fail = fail

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        raise AssertionError("streams only")

    @asynccontextmanager
    async def stream(self, request: LLMRequest) -> AsyncIterator[Any]:
        async def items() -> AsyncIterator[str | LLMCompletion]:
            yield "hello"
            if self.fail:
                raise RuntimeError("cut")
            yield LLMCompletion("hello", self.usage)

        yield items()


async def test_a_stream_without_usage_settles_at_the_worst_case(store):
    budgets = Budgets(store, clock_of(store), [BudgetSpec("agent:a", tokens=100_000)])
    request = LLMRequest("a", "m", [LLMMessage("user", "x" * 300)], max_tokens=200)
    worst = budgets.need(request)
    assert worst.tokens == 3 + 4 + 100 + 200
    port = budgets.port(StreamingModel(LLMUsage()), "a", None, "t", 10)
    async with port.stream(request) as items:  # type: ignore[attr-defined]
        got = [i async for i in items]
    assert got[0] == "hello"
    [row] = await budgets.rows()
    assert (row.spent_tokens, row.reserved_tokens) == (worst.tokens, 0)
    # with usage reported: that usage
    port = budgets.port(StreamingModel(LLMUsage(5, 6, 11)), "a", None, "t", 10)
    async with port.stream(request) as items:  # type: ignore[attr-defined]
        [_ async for _ in items]
    [row] = await budgets.rows()
    assert row.spent_tokens == worst.tokens + 11
    # the router's estimate of an unreported usage is not a report: the worst case again
    port = budgets.port(StreamingModel(LLMUsage(5, 6, 11, estimated=True)), "a", None, "t", 10)
    async with port.stream(request) as items:  # type: ignore[attr-defined]
        [_ async for _ in items]
    [row] = await budgets.rows()
    assert row.spent_tokens == 2 * worst.tokens + 11
    # a stream that fails releases its hold and spends nothing
    port = budgets.port(StreamingModel(LLMUsage(), fail=True), "a", None, "t", 10)
    with pytest.raises(RuntimeError):
        async with port.stream(request) as items:  # type: ignore[attr-defined]
            [_ async for _ in items]
    [row] = await budgets.rows()
    assert (row.spent_tokens, row.reserved_tokens) == (2 * worst.tokens + 11, 0)


class HangingModel:
    """A port without ``stream`` (the non-streamed path): each call fails with
    ``fail`` if given, else waits until cancelled (``started`` set once it waits)."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.started = trio.Event()

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        if self.fail is not None:
            raise self.fail
        self.started.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def held(store: SqlAgentStore) -> tuple[int, int, int]:
    """``agent:a``'s reserved and spent tokens, and the hold rows left."""
    [row] = [
        r
        for r in await store.read(sql_budgets.rows_of, await _keys(store))
        if r.budget == "agent:a"
    ]
    holds = await store.read(lambda tx, env: tx.one("SELECT count(*) FROM budget_holds")[0])
    return row.reserved_tokens, row.spent_tokens, int(holds)


async def _keys(store: SqlAgentStore) -> list[str]:
    return [
        str(r[0]) for r in await store.read(lambda tx, env: tx.all("SELECT bkey FROM budget_spend"))
    ]


async def test_a_non_streamed_calls_hold_is_released_when_it_fails_times_out_or_is_cancelled(
    store,
):
    """Issue 43: BudgetedLLM.complete gives its hold back (nothing spent) whichever way
    the call ends without an answer."""
    from agentserver.agents.errors import LLMUnavailable

    budgets = Budgets(store, clock_of(store), [BudgetSpec("agent:a", tokens=100_000)])
    request = LLMRequest("a", "m", [LLMMessage("user", "x" * 300)], max_tokens=200)
    # fails
    port = budgets.port(HangingModel(LLMUnavailable("down", kind="server")), "a", None, "t", 10)
    assert getattr(port, "stream", None) is None  # the non-streamed path
    with pytest.raises(LLMUnavailable):
        await port.complete(request)
    assert await held(store) == (0, 0, 0)
    # times out (the model step's bound is a deadline around the call)
    for how in ("deadline", "cancel"):
        model = HangingModel()
        port = budgets.port(model, "a", None, "t", 10)
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def call(scope: trio.CancelScope = scope, port: Any = port) -> None:
                with scope:
                    await port.complete(request)

            nursery.start_soon(call)
            await model.started.wait()
            reserved, spent, holds = await held(store)
            assert reserved == budgets.need(request).tokens and holds == 1 and spent == 0
            if how == "deadline":
                scope.deadline = trio.current_time()
            else:
                scope.cancel()
        assert scope.cancelled_caught
        assert await held(store) == (0, 0, 0), how


class HoldsSeen:
    """A port that answers at once, noting the hold ids in the store as it is called."""

    def __init__(self, store: SqlAgentStore) -> None:
        self.store = store
        self.seen: list[set[str]] = []

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        rows = await self.store.read(lambda tx, env: tx.all("SELECT hold_id FROM budget_holds"))
        self.seen.append({str(r[0]) for r in rows})
        return LLMCompletion("done", LLMUsage(50, 10, 60))


async def test_a_steps_own_hold_is_used_only_if_it_covers_the_call(store):
    """Issue 48: the hold a step's transaction took for its first call is that call's
    when it covers the call's worst case; a smaller one is given back and the call
    reserves by itself. Either way one hold is settled, and nothing stays reserved."""
    from agentserver.agents.store.sql.budgets import HoldOwner, StepHold

    budgets = Budgets(store, clock_of(store), [BudgetSpec("agent:a", tokens=100_000)])
    await budgets.rows()  # the period opened (a step's hold needs it open)
    request = LLMRequest("a", "m", [LLMMessage("user", "x" * 300)], max_tokens=200)
    need = budgets.need(request)
    owner = HoldOwner("a", "t", 1, "s")
    spent = 0
    for tokens, covers in ((need.tokens - 1, False), (need.tokens, True)):
        req = budgets.hold_request("a", None, Need(tokens, need.cost), 10, owner)
        assert req is not None
        assert await store.run(
            sql_budgets.reserve,
            req.keys,
            req.tokens,
            req.cost,
            req.hold_id,
            req.expires_at,
            req.owner,
        )
        model = HoldsSeen(store)
        port = budgets.port(model, "a", None, "t", 10, owner, first=StepHold(req, True))
        await port.complete(request)
        [holds] = model.seen
        assert len(holds) == 1 and (req.hold_id in holds) is covers
        spent += 60
        assert await held(store) == (0, spent, 0)


async def test_a_hold_belongs_to_its_turns_run_not_to_a_process(store):
    """Issue 43: a hold names the Turn's step that made its call. When that run is
    fenced out (a restart's recovery; on PostgreSQL another process's takeover, the same
    ``recover_turn``), its holds are released with the fence; a hold whose Turn ended
    meanwhile is released by the watchdog's next pass, without waiting for its expiry."""
    from agentserver.agents.governance.budgets import HoldOwner
    from agentserver.agents.store.base import TaskStatus

    await store.run(inbox.ensure_agents, ["a"])
    budgets = Budgets(store, clock_of(store), [BudgetSpec("agent:a", tokens=1000)])
    await store.run(inbox.enqueue_turn, "a", b"<task/>", {"caller_thread": "t1"})
    [row] = await store.run1(inbox.claim_due, "a", 5)
    started = await store.run(turns.start_turn_step, row, 10)
    token = started.head.token
    assert token is not None and started.step_id is not None
    owner = HoldOwner(token.agent_id, token.agent_turn_id, token.turn_epoch, started.step_id)
    # a one-hour bound: the expiry cannot be what releases these holds
    hold = await budgets.reserve("a", None, Need(600, 0.0), 3600, owner)
    assert hold is not None
    assert await budgets.release_expired() == 0  # its run is under way
    assert await held(store) == (600, 0, 1)
    # the process dies; the restart (or another process) fences the Turn's run
    [again] = await store.recover_running()
    assert again.turn_epoch == token.turn_epoch + 1
    assert await held(store) == (0, 0, 0)
    # the resumed run reserves afresh: the dead run's 600 no longer count
    owner2 = HoldOwner(again.agent_id, again.agent_turn_id, again.turn_epoch, started.step_id)
    hold2 = await budgets.reserve("a", None, Need(900, 0.0), 3600, owner2)
    assert hold2 is not None
    assert await budgets.release_expired() == 0
    # the Turn is ended from outside while its call is under way (and that call's
    # process is gone): the watchdog's pass releases the hold at once
    ended = await store.run(
        turn_end.force_end,
        "a",
        TaskStatus.FAILED,
        "stopped",
        None,
        agent_turn_id=again.agent_turn_id,
    )
    assert ended is not None
    assert await budgets.release_expired() == 1
    assert await held(store) == (0, 0, 0)
    # a late settle of a released hold still counts its spend, once
    await budgets.settle(hold, None, agent="a", turn=None)
    await budgets.release(hold)
    assert await held(store) == (0, 600, 0)


# -- the Turn's side: refused before any model call, ended at the next step --------------


class CostlyLLM:
    """Step 1 calls the calculator, step 2 answers; each call reports 600 tokens."""

    def __init__(self) -> None:
        self.requests: list[LLMRequest] = []

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        self.requests.append(request)
        text = request.messages[-1].content
        if "Result from" in text:
            return LLMCompletion("The answer is 3.", LLMUsage(500, 100, 600))
        return LLMCompletion(
            'Let me compute. <add xmlns="urn:calc"><a>1</a><b>2</b></add>',
            LLMUsage(500, 100, 600),
        )


def budgeted_runtime(tmp_path, limit: int):
    from agents_fakes import FakeReplies, FakeTools, profile

    from agentserver.agents.runtime import AgentRuntime, open_agent_store
    from agentserver.app.runtime_parts import runtime_parts

    clock = ManualClock(NOON)
    settings = StoreSettings(path=tmp_path / "agents.sqlite3")
    profiles = {"assistant": profile(max_tokens=200)}
    store = open_agent_store(settings, profiles, clock=clock)
    events = EventBus()
    budgets = Budgets(
        store, clock, [BudgetSpec("client:alice@agent:assistant", tokens=limit)], events=events
    )
    llm, tools, replies = CostlyLLM(), FakeTools(), FakeReplies()
    rt = AgentRuntime(
        runtime_parts(
            store=store,
            profiles=profiles,
            llm=llm,
            tools=tools,
            replies=replies,
            settings=settings,
            clock=clock,
            events=events,
            budgets=budgets,
        )
    )
    return rt, llm, tools, replies


async def test_a_turn_whose_budget_runs_out_ends_failed_at_its_next_step(tmp_path):
    from agents_fakes import result, task

    rt, llm, tools, replies = budgeted_runtime(tmp_path, limit=1000)
    ref = {"thread": "t1", "client": "alice"}
    await rt.enqueue("assistant", task("1+2"), ref)
    await rt.worker.process_agent("assistant")
    [(sub, _to, _)] = tools.calls  # step 1 fit and called
    assert rt.budgets is not None
    first = rt.budgets.need(llm.requests[0]).tokens
    assert first <= 1000 < 600 + first  # step 2's (larger) does not fit what is left
    await rt.report_tool_result("assistant", sub, result("3"))
    await rt.worker.process_agent("assistant")
    # no call made for step 2: the Turn failed
    assert len(llm.requests) == 1
    [(sent_ref, text, failed)] = [(r[0], r[1], r[2]) for r in replies.sent]
    assert failed and sent_ref == ref
    # 400 of 1000 remain, less than step 2's worst case: the reason gives both figures
    assert text.startswith("budget exhausted: this call needs up to ")
    assert text.endswith(
        " tokens; 400 remain of client:alice@agent:assistant (month);"
        " it resets at 2026-12-01T00:00:00Z"
    )
    needed = int(text.split("needs up to ")[1].split(" ")[0].replace(",", ""))
    assert needed > 400 and needed > first
    # a new task of alice is refused before any model call; bob's is not limited
    await rt.enqueue("assistant", task("2+2"), {"thread": "t2", "client": "alice"})
    await rt.worker.process_agent("assistant")
    assert len(llm.requests) == 1 and replies.sent[-1][2]
    await rt.enqueue("assistant", task("2+2"), {"thread": "t3", "client": "bob"})
    await rt.worker.process_agent("assistant")
    assert len(llm.requests) == 2
    await rt.store.aclose()


def spend_row(rt) -> tuple[int, int]:
    """(spent, reserved) tokens of alice's budget, read from the store file."""
    import sqlite3

    with sqlite3.connect(rt.store.settings.path) as db:
        [(spent, reserved)] = db.execute(
            "SELECT spent_tokens, reserved_tokens FROM budget_spend"
        ).fetchall()
    return int(spent), int(reserved)


async def test_a_steps_reservation_and_spend_ride_in_the_steps_transactions(tmp_path):
    """Issue 48: a step's first model call is reserved in the transaction that opens the
    step (the claim that starts the Turn; the report that resumes it), and its spend is
    settled in the one that writes the step's results (the suspend; the Turn's end):
    once a budget's period is open, a one-tool Turn makes no budget call of its own."""
    from agents_fakes import result, task

    rt, _llm, tools, replies = budgeted_runtime(tmp_path, limit=100_000)
    alone: list[str] = []
    store = rt.store
    run_alone = store.run

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn in (sql_budgets.reserve, sql_budgets.settle):
            alone.append(fn.__name__)
        return await run_alone(fn, *args, **kwargs)

    store.run = counted  # type: ignore[method-assign]
    for n in (1, 2):
        await rt.enqueue("assistant", task("1+2"), {"thread": f"t{n}", "client": "alice"})
        await rt.worker.process_agent("assistant")
        (sub, _to, _) = tools.calls[-1]
        head = await store.read(sql_head.read, "assistant")
        assert head.status == "suspended"
        # step 1's spend was written with the suspend; step 2's hold not taken yet
        assert spend_row(rt) == ((2 * n - 1) * 600, 0)
        await rt.report_tool_result("assistant", sub, result("3"))
        # the report's transaction opened step 2 and reserved its call
        assert spend_row(rt)[1] > 0
        await rt.worker.process_agent("assistant")
        assert len(replies.sent) == n and not replies.sent[-1][2]
        assert spend_row(rt) == (2 * n * 600, 0)  # and the second with the Turn's end
        if n == 1:
            # the first call of the period reserves by itself (it opens the period)
            assert alone == ["reserve"]
            alone.clear()
    assert alone == []
    await rt.store.aclose()


class EndedDuringTheCall(CostlyLLM):
    """The Turn is ended by someone else (as a stop on another process would) while its
    first call runs; the call still returns."""

    def __init__(self) -> None:
        super().__init__()
        self.store: SqlAgentStore | None = None

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        done = await super().complete(request)
        assert self.store is not None
        await self.store.run(turn_end.force_end, "assistant", "failed", "stopped", None)
        # A prompt counted below the estimate: the step adds no correction to the head,
        # so the first write fenced out is the step's own.
        return LLMCompletion(done.content, LLMUsage(5, 100, 105))


async def test_a_spend_whose_step_was_fenced_out_is_settled_by_itself(tmp_path):
    """The step's write is fenced out (StaleTurn: nothing written), so its call's spend,
    which was to ride with it, is settled by itself: spent, nothing left reserved."""
    from agents_fakes import task

    rt, _llm, tools, _replies = budgeted_runtime(tmp_path, limit=10_000)
    llm = EndedDuringTheCall()
    llm.store = rt.store
    rt.worker.llm = llm
    await rt.enqueue("assistant", task("1+2"), {"thread": "t1", "client": "alice"})
    await rt.worker.process_agent("assistant")
    assert len(llm.requests) == 1 and tools.calls == []
    assert spend_row(rt) == (105, 0)
    await rt.store.aclose()


async def test_without_budgets_a_turn_adds_no_statement(tmp_path):
    """No <budget>: no Budgets object, no port wrapper (the model step's llm is the
    runtime's own)."""
    from agents_fakes import make_harness

    h = make_harness(tmp_path, lambda req: "done")
    assert h.rt.budgets is None and h.rt.worker.model.budgets is None
    assert h.rt.watchdog.budgets is None
    await h.rt.store.aclose()


async def test_the_turns_span_carries_the_reservation(store):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agentserver.observability.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    budgets = Budgets(store, clock_of(store), [BudgetSpec("agent:a", tokens=1000)])
    with tracing.invoke_agent("a", "turn-1", None, None):
        hold = await budgets.reserve("a", None, Need(600, 0.25), 10)
        assert hold is not None
        with pytest.raises(BudgetSpent):
            await budgets.reserve("a", None, Need(600, 0.0), 10)
    [span] = exporter.get_finished_spans()
    assert span.attributes["agentserver.budget.hold"] == hold.hold_id
    assert span.attributes["agentserver.budget.names"] == "agent:a"
    assert span.attributes["agentserver.budget.reserved_tokens"] == 600
    assert span.attributes["agentserver.budget.refused"] == "agent:a"


# -- a run-time change holds across processes and periods ------------------------------


@pytest.mark.parametrize(
    "kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)]
)
async def test_a_run_time_change_holds_across_processes_and_periods(kind, request, tmp_path):
    """Two stores on one database stand for two processes (on SQLite, which one process
    holds, two ``Budgets`` on one store: each keeps its own budgets and periods), both
    booted with the same boot.xml budget; one changes it at run time (``PUT
    /v1/budgets``). The other opens its next period with the change, and so does a third
    started afterwards."""
    clock = ManualClock(NOON)
    a = await open_store(kind, request, tmp_path, clock)
    b = a if kind == "sqlite" else await open_store(kind, request, tmp_path, clock)
    c = None
    try:
        boot = BudgetSpec("agent:a", tokens=100, period="day")
        here, there = Budgets(a, clock, [boot]), Budgets(b, clock, [boot])
        assert await there.reserve("a", None, Need(50, 0.0), 10) is not None
        await here.set(here.with_spec("agent:a", tokens=1000))
        # at once, in the current period, for both
        hold = await there.reserve("a", None, Need(500, 0.0), 10)
        assert hold is not None
        await there.settle(hold, None, agent="a", turn=None)
        # the next period: the other process opens it with the change, not boot.xml's
        clock.set(NOON + 12 * 3600 + 1)
        hold = await there.reserve("a", None, Need(600, 0.0), 10)
        assert hold is not None
        [row] = await there.rows()
        assert row.period_start == NOON + 12 * 3600 and row.limit_tokens == 1000
        assert there.specs["agent:a"].tokens == 1000
        # a process started now (a restart) opens it with the change too
        if kind != "sqlite":
            c = await open_store(kind, request, tmp_path, clock)
        later = Budgets(c or a, clock, [boot])
        [row] = await later.rows()
        assert row.limit_tokens == 1000 and row.reserved_tokens == 600
        # a change of period: the other process moves to it at its next period
        await here.set(here.with_spec("agent:a", period="week"))
        week = period_bounds("week", "UTC", clock.now())
        clock.set(NOON + 36 * 3600 + 1)  # Sunday 00:00:01, still the same week
        assert await there.reserve("a", None, Need(10, 0.0), 10) is not None
        [row] = await here.rows()
        assert (row.period, row.period_start) == ("week", week[0])
        assert row.reserved_tokens == 10 and there.specs["agent:a"].period == "week"
    finally:
        for s in {id(x): x for x in (a, b, c) if x is not None}.values():
            await s.aclose()
