"""A stop (``agentserver stop``, or a cancel of the active task) cancels the Turn's run in
flight: its hung model call or its tool call is abandoned at once, and the agent's next
queued task starts then, not when the model call would have returned (``llm-timeout``).

The real stores (SQLite, PostgreSQL), the real worker dispatcher and operator, fake ports.
Time is trio's mock clock: "at once" is measured in trio time, never on the wall clock.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing
from agents_fakes import FakeReplies, FakeTools, last_user, profile, task
from lxml import etree

from agentserver.agents.clock import ManualClock
from agentserver.agents.ports import LLMCompletion, LLMRequest, LLMUsage
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.runtime import AgentRuntime
from agentserver.agents.store.base import AgentStore
from agentserver.agents.store.sql import head as sql_head
from agentserver.app.runtime_parts import runtime_parts
from agentserver.console.operator import Operator

LLM_TIMEOUT = 300.0
#: How soon (trio time) the next task starts after a stop: at once, give or take a
#: dispatcher wake-up or a head poll (1 s each) should the mock clock jump during a query;
#: far below LLM_TIMEOUT, which is what an uncancelled model call costs.
PROMPTLY = 3.0
ADD = '<add xmlns="urn:calc"><a>1</a><b>2</b></add>'


class HangingLLM:
    """Hangs on a task saying "hang" until cancelled (and records that it was), asks for
    a tool on one saying "tool", answers any other at once."""

    def __init__(self) -> None:
        #: (the last message, trio time) of each call, in order
        self.started: list[tuple[str, float]] = []
        self.cancelled: list[str] = []
        self.hanging = trio.Event()

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        text = last_user(request)
        self.started.append((text, trio.current_time()))
        if "hang" in text:
            self.hanging.set()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                self.cancelled.append(text)
                raise
        answer = f"Let me compute. {ADD}" if "tool" in text else "all done"
        return LLMCompletion(answer, LLMUsage(10, 5, 15), cost=0.0, model="m", backend="fake")


@dataclass
class Replies(FakeReplies):
    """The fake reply port, with a wait for the n-th reply."""

    arrived: trio.Event = field(default_factory=trio.Event)

    async def deliver(
        self, reply_ref: Any, payload: etree._Element, *, failed: bool, turn_id: str
    ) -> None:
        await super().deliver(reply_ref, payload, failed=failed, turn_id=turn_id)
        self.arrived.set()
        self.arrived = trio.Event()

    async def wait_for(self, n: int) -> None:
        while len(self.sent) < n:
            await self.arrived.wait()


@dataclass
class Parts:
    rt: AgentRuntime
    llm: HangingLLM
    tools: FakeTools
    replies: Replies


@pytest.fixture
def idle_clock() -> trio.testing.MockClock:
    """Trio time jumps to the next deadline only once every task has waited 0.5 s of real
    time, so a PostgreSQL query (a worker thread) is hardly ever taken for idleness."""
    return trio.testing.MockClock(autojump_threshold=0.5)


@pytest.fixture(params=["sqlite", "postgresql"])
async def parts(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[Parts]:
    clock = ManualClock()
    settings = StoreSettings(path=tmp_path / "agents.sqlite3")
    store: AgentStore
    if request.param == "sqlite":
        from agentserver.agents.store.sqlite_store import SqliteAgentStore

        store = SqliteAgentStore.open(settings.path, clock=clock, settings=settings)
    else:
        from agentserver.agents.store.pg.store import PostgresAgentStore

        url = request.getfixturevalue("pg_url")  # skips when no server is reachable
        opened = PostgresAgentStore.open(url, clock=clock, settings=settings)
        store = await opened if inspect.isawaitable(opened) else opened
    llm, tools, replies = HangingLLM(), FakeTools(), Replies()
    rt = AgentRuntime(
        runtime_parts(
            store=store,
            profiles={"assistant": profile(llm_timeout_s=LLM_TIMEOUT)},
            llm=llm,
            tools=tools,
            replies=replies,
            settings=settings,
            clock=clock,
        )
    )
    try:
        await rt.recover()
        yield Parts(rt, llm, tools, replies)
    finally:
        await rt.aclose()


async def end_active(how: str, rt: AgentRuntime) -> int:
    """End the active task (sent on thread t1) as an operator would."""
    operator = Operator(rt, None, max_message_bytes=1 << 20)
    if how == "stop":
        return await operator.stop(rt, "assistant", None)
    if how == "stop thread":
        return await operator.stop(rt, "assistant", "t1")
    return await operator.cancel(rt, "assistant", "t1")


def threads(replies: Replies) -> list[tuple[str, bool]]:
    return [(ref["caller_thread"], failed) for ref, _, failed, _ in replies.sent]


@pytest.mark.parametrize("how", ["stop", "stop thread", "cancel"])
async def test_a_stop_cancels_the_hung_model_call_and_the_next_task_starts_at_once(
    parts: Parts, idle_clock: trio.testing.MockClock, how: str
) -> None:
    rt, llm, replies = parts.rt, parts.llm, parts.replies
    await rt.enqueue("assistant", task("hang"), {"caller_thread": "t1"})
    await rt.enqueue("assistant", task("next"), {"caller_thread": "t2"})
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.worker.run)
        await llm.hanging.wait()
        stopped_at = trio.current_time()
        assert await end_active(how, rt) == 1
        # Bounded in trio time, so a run that waits out llm-timeout fails here.
        with trio.move_on_after(LLM_TIMEOUT / 2):
            await replies.wait_for(2)
        nursery.cancel_scope.cancel()
    [(_, next_at)] = [(text, at) for text, at in llm.started if "next" in text]
    assert next_at - stopped_at < PROMPTLY, "the next task waited for the stopped model call"
    assert threads(replies) == [("t1", True), ("t2", False)]
    [hung] = llm.cancelled  # the model call itself saw the cancellation
    assert "hang" in hung


async def test_a_stop_cancels_a_tool_call_in_flight_and_the_next_task_starts(
    parts: Parts, idle_clock: trio.testing.MockClock
) -> None:
    rt, tools, replies = parts.rt, parts.tools, parts.replies
    forwarding = trio.Event()
    abandoned: list[str] = []

    async def stuck(sub: str, to: str) -> None:
        # The pump's forward of the call does not come back (e.g. a full peer queue).
        forwarding.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            abandoned.append(to)
            raise

    tools.on_call = stuck
    await rt.enqueue("assistant", task("tool"), {"caller_thread": "t1"})
    await rt.enqueue("assistant", task("next"), {"caller_thread": "t2"})
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.worker.run)
        await forwarding.wait()
        assert await rt.stop("assistant")
        with trio.move_on_after(LLM_TIMEOUT / 2):
            await replies.wait_for(2)
        nursery.cancel_scope.cancel()
    assert abandoned == ["calculator"]
    assert threads(replies) == [("t1", True), ("t2", False)]


async def test_a_stop_leaves_the_run_of_the_next_turn_alone(
    parts: Parts, idle_clock: trio.testing.MockClock
) -> None:
    """The runner moved on to the next Turn: a late interrupt of the stopped one does not
    touch it (it names the Turn, not the agent)."""
    rt, llm, replies = parts.rt, parts.llm, parts.replies
    await rt.enqueue("assistant", task("hang"), {"caller_thread": "t1"})
    await rt.enqueue("assistant", task("hang again"), {"caller_thread": "t2"})
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.worker.run)
        await llm.hanging.wait()
        llm.hanging = trio.Event()
        head = await rt.store.read(sql_head.read, "assistant")
        assert head.agent_turn_id is not None
        first = head.agent_turn_id
        assert await rt.stop("assistant")
        await llm.hanging.wait()  # the second Turn's call
        assert not rt.worker.interrupt("assistant", first)
        assert len(llm.cancelled) == 1
        assert await rt.stop("assistant")
        with trio.move_on_after(LLM_TIMEOUT / 2):
            await replies.wait_for(2)
        nursery.cancel_scope.cancel()
    assert threads(replies) == [("t1", True), ("t2", True)]
    assert len(llm.cancelled) == 2


async def test_a_stop_taken_by_another_process_cancels_the_model_call_here(
    request: pytest.FixtureRequest, tmp_path, idle_clock: trio.testing.MockClock
) -> None:
    """Two processes on one PostgreSQL store: the stop reaches the one not running the
    Turn; the one running it sees its Turn end (it reads the head during the call while
    another process is there), abandons the call and runs the next task."""
    from agentserver.agents.store.pg.store import PostgresAgentStore

    url = request.getfixturevalue("pg_url")  # skips when no server is reachable
    settings = StoreSettings(url=url)
    profiles = {"assistant": profile(llm_timeout_s=LLM_TIMEOUT)}
    runtimes: list[AgentRuntime] = []
    sides: list[Parts] = []
    try:
        # "there" (taking the stop) opens first, so "here" sees it alive at its start.
        for _ in range(2):
            clock = ManualClock()
            store = PostgresAgentStore.open(url, clock=clock, settings=settings)
            llm, tools, replies = HangingLLM(), FakeTools(), Replies()
            rt = AgentRuntime(
                runtime_parts(
                    store=store,
                    profiles=profiles,
                    llm=llm,
                    tools=tools,
                    replies=replies,
                    settings=settings,
                    clock=clock,
                )
            )
            runtimes.append(rt)
            sides.append(Parts(rt, llm, tools, replies))
        there, here = sides
        await here.rt.recover()
        await here.rt.enqueue("assistant", task("hang"), {"caller_thread": "t1"})
        await here.rt.enqueue("assistant", task("next"), {"caller_thread": "t2"})
        async with trio.open_nursery() as nursery:
            await nursery.start(here.rt.worker.run)
            await here.llm.hanging.wait()
            stopped_at = trio.current_time()
            assert await there.rt.stop("assistant")
            with trio.move_on_after(LLM_TIMEOUT / 2):
                await here.replies.wait_for(1)
            nursery.cancel_scope.cancel()
    finally:
        for rt in runtimes:
            await rt.aclose()
    [(_, next_at)] = [(text, at) for text, at in here.llm.started if "next" in text]
    assert next_at - stopped_at < PROMPTLY, "the next task waited for the stopped model call"
    assert threads(there.replies) == [("t1", True)]
    assert threads(here.replies) == [("t2", False)]
    [hung] = here.llm.cancelled
    assert "hang" in hung
