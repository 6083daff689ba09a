"""Step decisions and the hub's retry schedule, without sockets (MockClock)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from lxml import etree

from agentserver.agents.errors import IllegalTransition
from agentserver.agents.store.states import (
    FINAL_STEP,
    STEP_TRANSITIONS,
    StepEvent,
    StepStatus,
    step_transition,
)
from agentserver.core.envelope import encode
from agentserver.core.errors import DeliveryRefused, InputRefused
from agentserver.core.listener import HandlerMetadata
from agentserver.core.namespaces import CORE_NS
from agentserver.core.threads import new_thread_id
from agentserver.remote.hub import RunnerHub
from agentserver.steps.retry import StepPolicy, backoff, should_retry

S = StepStatus


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


def test_backoff_doubles_from_one_second_and_is_capped_at_thirty():
    assert [backoff(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff(10_000) == 30
    with pytest.raises(ValueError):
        backoff(0)


def test_only_idempotent_steps_retry_except_a_job_never_started():
    idem, plain = StepPolicy(5, True, 2), StepPolicy(5, False, 2)
    assert should_retry(idem, S.TIMED_OUT, started=True, retries_done=0)
    assert should_retry(idem, S.FAILED, started=True, retries_done=1)
    assert not should_retry(idem, S.FAILED, started=True, retries_done=2)
    assert not should_retry(plain, S.TIMED_OUT, started=True, retries_done=0)
    assert not should_retry(plain, S.TIMED_OUT, started=False, retries_done=0)
    assert not should_retry(plain, S.FAILED, started=True, retries_done=0)
    # Lost before it began: it had no effect, any listener moves it to another runner.
    assert should_retry(plain, S.FAILED, started=False, retries_done=0)
    assert not should_retry(idem, S.CANCELLED, started=True, retries_done=0)


@given(st.lists(st.sampled_from(list(StepEvent)), max_size=8))
def test_step_machine_only_walks_its_table_and_final_states_are_final(events):
    state = S.PENDING
    for event in events:
        if (state, event) in STEP_TRANSITIONS:
            assert state not in FINAL_STEP
            state = StepStatus(step_transition(state, event).target)
        else:
            with pytest.raises(IllegalTransition):
                step_transition(state, event)
    assert state in S


class FakeRunner:
    """The runner side of a link, in memory: records what the hub sends it."""

    def __init__(self, hub: RunnerHub, listener: str = "search", concurrency: int = 1) -> None:
        self.hub = hub
        self.sent: list[etree._Element] = []
        self.times: list[float] = []
        self.link = hub.attach("runner", "runner", self.push)
        serve = etree.Element(f"{{{CORE_NS}}}serve", listener=listener)
        serve.set("concurrency", str(concurrency))
        hub.frame(self.link, encode("runner", None, new_thread_id(), serve))

    def push(self, body: bytes) -> bool:
        self.sent.append(etree.fromstring(body))
        self.times.append(trio.current_time())
        return True

    def jobs(self) -> list[etree._Element]:
        return [m for m in self.sent if m[1].tag == "{urn:q}q"]

    def reply(self, job: etree._Element, text: str) -> None:
        thread = job[0][-1].text
        self.hub.frame(self.link, encode("runner", None, thread, etree.Element("{urn:q}" + text)))


def meta() -> HandlerMetadata:
    return HandlerMetadata(new_thread_id(), "agent", "search", False, "")


async def test_retries_wait_one_two_four_seconds_after_each_timeout(autojump_clock):
    hub = RunnerHub(
        {"search": StepPolicy(10, True, 3)},
        {"runner": frozenset({"search"})},
        max_message_bytes=65536,
    )
    fake = FakeRunner(hub)
    start = trio.current_time()
    with pytest.raises(DeliveryRefused):
        await hub.run_step("search", hub.policies["search"], etree.Element("{urn:q}q"), meta())
    offsets = [
        round(t - start, 6)
        for t in (fake.times[i] for i, m in enumerate(fake.sent) if m[1].tag == "{urn:q}q")
    ]
    # Attempt n+1 starts step-timeout + backoff(n) after attempt n.
    assert offsets == [0, 11, 23, 37]
    cancels = [m for m in fake.sent if m[1].tag == f"{{{CORE_NS}}}cancel"]
    assert len(cancels) == 4  # every timed-out attempt was cancelled at the runner
    events = [r.event for r in hub.step_log if r.event != "step.dispatched"]
    assert events == ["step.retried"] * 3 + ["step.timed_out"]


async def test_a_superseded_attempts_late_result_is_ignored(autojump_clock):
    hub = RunnerHub(
        {"search": StepPolicy(1, True, 3)},
        {"runner": frozenset({"search"})},
        max_message_bytes=65536,
    )
    fake = FakeRunner(hub, concurrency=2)
    result: list[object] = []

    async def step() -> None:
        result.append(
            await hub.run_step("search", hub.policies["search"], etree.Element("{urn:q}q"), meta())
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(step)
        await trio.sleep(1.5)  # the first attempt timed out; the retry waits 1 s
        first = fake.jobs()[0]
        fake.reply(first, "late")  # superseded: ignored
        assert hub.counters["ignored"] == 1
        await trio.sleep(1)
        [_, second] = fake.jobs()
        fake.reply(second, "fresh")
    [outputs] = result
    assert [o.payload.tag for o in outputs] == ["{urn:q}fresh"]


async def test_a_lost_runner_that_had_started_fails_a_non_idempotent_step(autojump_clock):
    hub = RunnerHub(
        {"search": StepPolicy(5, False, 3)},
        {"runner": frozenset({"search"})},
        max_message_bytes=65536,
    )
    fake = FakeRunner(hub)
    raised: list[BaseException] = []

    async def lose() -> None:
        await trio.sleep(0.1)
        thread = fake.jobs()[0][0][-1].text
        started = etree.Element(f"{{{CORE_NS}}}started")
        hub.frame(fake.link, encode("runner", None, thread, started))
        hub.detach(fake.link)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lose)
        try:
            await hub.run_step("search", hub.policies["search"], etree.Element("{urn:q}q"), meta())
        except InputRefused as exc:
            raised.append(exc)
    assert len(raised) == 1
    assert [r.event for r in hub.step_log][-1] == "step.failed"


async def test_a_job_lost_before_it_started_goes_to_another_runner(autojump_clock):
    hub = RunnerHub(
        {"search": StepPolicy(5, False, 3)},
        {"runner": frozenset({"search"})},
        max_message_bytes=65536,
    )
    first = FakeRunner(hub)
    result: list[object] = []

    async def step() -> None:
        result.append(
            await hub.run_step("search", hub.policies["search"], etree.Element("{urn:q}q"), meta())
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(step)
        await trio.sleep(0.1)
        assert len(first.jobs()) == 1
        hub.detach(first.link)  # gone before it said <started/>: no effect was possible
        second = FakeRunner(hub)
        await trio.sleep(0.1)
        [job] = second.jobs()
        second.reply(job, "answer")
    [outputs] = result
    assert [o.payload.tag for o in outputs] == ["{urn:q}answer"]
    assert [r.event for r in hub.step_log if r.event != "step.dispatched"] == [
        "step.retried",
        "step.succeeded",
    ]


def test_boot_checks_remote_listeners_and_runner_clients():
    from agentserver.config import loader as boot

    def problems(listeners: str, clients: str) -> list[str]:
        xml = f"""<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="x">
  <clients>{clients}</clients><listeners>{listeners}</listeners></organism>"""
        result = boot.load_bytes(xml.encode(), environ={"T": "t"})
        return [p.message for p in result.problems]

    remote = (
        '<listener name="search" remote="true" step-timeout="2" idempotent="true" retries="5">'
        '<accepts type="echo.ping"/></listener>'
    )
    ok = problems(remote, '<client name="r" token-env="T" serves="search"/>')
    assert ok == []
    assert any(
        "no client serves it" in p for p in problems(remote, '<client name="a" token-env="T"/>')
    )
    # Steps apply to in-process tool listeners too (issue 26), not to agents.
    some_client = '<client name="a" token-env="T"/>'
    ok = problems(
        '<listener name="echo" handler="echo" idempotent="true" step-timeout="2"/>', some_client
    )
    assert ok == []
    bad = problems(
        '<listener name="assistant" handler="assistant" agent="true" idempotent="true"/>',
        some_client,
    )
    assert any("tool listeners only" in p for p in bad)
    runner_client = '<client name="r" token-env="T" serves="search"/>'
    bad = problems(remote.replace('remote="true"', 'remote="true" handler="echo"'), runner_client)
    assert any("has no handler" in p for p in bad)
    bad = problems(
        '<listener name="echo" handler="echo"/>', '<client name="r" token-env="T" serves="echo"/>'
    )
    assert any("not a remote listener" in p for p in bad)


async def test_cancelling_a_callers_steps_tells_the_runner_and_fails_the_step(autojump_clock):
    hub = RunnerHub(
        {"search": StepPolicy(60, True, 3)},
        {"runner": frozenset({"search"})},
        max_message_bytes=65536,
    )
    fake = FakeRunner(hub)
    raised: list[BaseException] = []

    async def step() -> None:
        try:
            await hub.run_step("search", hub.policies["search"], etree.Element("{urn:q}q"), meta())
        except DeliveryRefused as exc:
            raised.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(step)
        await trio.sleep(1)
        assert hub.cancel_caller("someone-else") == 0
        assert hub.cancel_caller("agent") == 1
    [job] = fake.jobs()
    cancels = [m for m in fake.sent if m[1].tag == f"{{{CORE_NS}}}cancel"]
    assert [c[0][-1].text for c in cancels] == [job[0][-1].text]
    assert len(raised) == 1 and "step.retried" not in [r.event for r in hub.step_log]
    assert list(hub.step_log)[-1].event == "step.cancelled"
    fake.reply(job, "late")  # after the cancel: ignored
    assert hub.counters["ignored"] == 1


def test_console_operator_lines():
    from agentserver.console.commands import OperatorLine, parse_line

    thread = new_thread_id()
    assert parse_line("/stop assistant", default_agent="assistant") == OperatorLine(
        "stop", "assistant"
    )
    assert parse_line(f"/cancel {thread}", default_agent="a") == OperatorLine("cancel", "a", thread)
    assert parse_line("/stop", default_agent="a") == "error: write /stop AGENT"
    assert parse_line("/cancel nope", default_agent="a").startswith("error:")
    assert parse_line("hello /stop", default_agent="a") is None
    assert parse_line("/help", default_agent="a") is None
