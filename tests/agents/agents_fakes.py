"""In-memory fakes of the agent ports, for the agents tests (the benchmarks run the real\nserver and the LLM fakes of ``tests/llm_fakes.py`` instead)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from lxml import etree

from agentserver.agents.clock import ManualClock
from agentserver.agents.errors import LLMUnavailable, PumpRefused
from agentserver.agents.events import Subscription, TaskEvent
from agentserver.agents.ports import LLMCompletion, LLMRequest, LLMUsage
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.reading.parsing import make_huh
from agentserver.agents.runtime import AgentRuntime
from agentserver.app.runtime_parts import open_runtime
from agentserver.core.errors import HuhReason

ASSISTANT_NS = "urn:agentserver:assistant"
CALC = "{urn:calc}add"
SEARCH = "{urn:search}query"


def profile(**kw: Any) -> AgentProfile:
    base: dict[str, Any] = dict(
        name="assistant",
        model="m",
        own_roots=(f"{{{ASSISTANT_NS}}}task",),
        peers={CALC: "calculator", SEARCH: "search"},
        quotable=("{urn:calc}sum", "{urn:search}hits"),  # the peers' answers
        max_steps=6,
        resume_deadline_s=30.0,
    )
    base.update(kw)
    return AgentProfile(**base)


def task(text: str) -> bytes:
    el = etree.Element(f"{{{ASSISTANT_NS}}}task", nsmap={None: ASSISTANT_NS})
    etree.SubElement(el, f"{{{ASSISTANT_NS}}}text").text = text
    return etree.tostring(el)


def result(value: str) -> bytes:
    el = etree.Element("{urn:calc}sum", nsmap={None: "urn:calc"})
    el.text = value
    return etree.tostring(el)


Script = Callable[[LLMRequest], str]


class ScriptedLLM:
    """Answers with ``script(request)``; can raise, block, or count calls."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[LLMRequest] = []
        self.gate: trio.Event | None = None
        self.entered = trio.Event()
        self.fail: str | None = None

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        self.requests.append(request)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise LLMUnavailable(self.fail, kind="connect")
        return LLMCompletion(
            self.script(request), LLMUsage(10, 5, 15), cost=0.001, model="m", backend="fake"
        )


def last_user(request: LLMRequest) -> str:
    return request.messages[-1].content


@dataclass
class FakeTools:
    calls: list[tuple[str, str | None, str]] = field(default_factory=list)
    #: The idempotency key of each call, in order.
    keys: list[str | None] = field(default_factory=list)
    self_calls: list[str] = field(default_factory=list)
    refuse: set[str] = field(default_factory=set)
    #: Peers whose sends are refused for room (after the check passed).
    full: set[str] = field(default_factory=set)
    on_call: Callable[[str, str], Any] | None = None  # (sub_thread, to) -> awaitable|None

    async def call(
        self,
        agent: str,
        turn_thread: Any,
        payload: etree._Element,
        to: str | None,
        *,
        key: str | None = None,
        thread: str | None = None,
    ) -> str:
        self.check_call(agent, payload, to)
        if to in self.full:
            raise PumpRefused(make_huh(HuhReason.INVALID_PAYLOAD, "no room"))
        sub = thread or uuid.uuid4().hex
        self.calls.append((sub, to, etree.tostring(payload, encoding="unicode")))
        self.keys.append(key)
        if self.on_call is not None:
            maybe = self.on_call(sub, to or "")
            if maybe is not None:
                await maybe
        return sub

    def check_call(self, agent: str, payload: etree._Element, to: str | None) -> None:
        if payload.tag in self.refuse:
            raise PumpRefused(make_huh(HuhReason.INVALID_PAYLOAD, "x"))

    async def self_iterate(self, agent: str, turn_thread: Any, payload: etree._Element) -> None:
        if payload.tag in self.refuse:
            raise PumpRefused(make_huh(HuhReason.INVALID_PAYLOAD, "x"))
        self.self_calls.append(etree.tostring(payload, encoding="unicode"))


@dataclass
class FakeReplies:
    sent: list[tuple[Any, str, bool, str]] = field(default_factory=list)
    #: the ``status`` attribute of each reply's root, in the order of ``sent``
    statuses: list[str | None] = field(default_factory=list)
    broken: bool = False

    async def deliver(
        self, reply_ref: Any, payload: etree._Element, *, failed: bool, turn_id: str
    ) -> None:
        if self.broken:
            raise ConnectionError("caller away")
        text = "".join(payload.itertext())
        self.sent.append((reply_ref, text, failed, turn_id))
        self.statuses.append(payload.get("status"))


@dataclass
class Harness:
    rt: AgentRuntime
    llm: ScriptedLLM
    tools: FakeTools
    replies: FakeReplies
    clock: ManualClock
    events: Subscription

    async def pump(self, agent: str = "assistant") -> int:
        return await self.rt.worker.process_agent(agent)

    def task_events(self) -> list[TaskEvent]:
        return [e for e in self.events.drain() if isinstance(e, TaskEvent)]

    def sql(self, query: str, *args: Any) -> list[tuple[Any, ...]]:
        return self.rt.store._db.execute(query, args).fetchall()  # type: ignore[attr-defined]


def make_harness(
    path: Path,
    script: Script,
    *,
    profiles: dict[str, AgentProfile] | None = None,
    clock: ManualClock | None = None,
    retryable_tools: tuple[str, ...] = (),
    **settings: Any,
) -> Harness:
    clock = clock or ManualClock()
    llm = ScriptedLLM(script)
    tools = FakeTools()
    replies = FakeReplies()
    profiles = profiles or {"assistant": profile()}
    cfg = StoreSettings(path=path / "agents.sqlite3", **settings)
    rt = open_runtime(
        cfg,
        profiles,
        llm=llm,
        tools=tools,
        replies=replies,
        clock=clock,
        retryable_tools=retryable_tools,
    )
    return Harness(rt, llm, tools, replies, clock, rt.events.subscribe())
