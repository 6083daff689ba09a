"""Benchmark: many short Turns through the real SQLite store and worker.

Each Turn: Enqueue → step 1 (the model calls one tool) → suspend → the tool's result →
resume → step 2 (the model answers) → deliverable + reply. The model is an instant
scripted LLM port and the tool an instant in-memory port that reports its result from a
separate task, so the numbers are the protocol's own cost: store transactions, parsing,
routing through the ports. ``step_ms`` is wall time per model step with the model's own
time (zero here) excluded.

Usage: python bench/turns.py [--turns N] [--agents K] [--concurrency C]
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import trio
from lxml import etree

from agentserver.agents.events import TaskEvent
from agentserver.agents.ports import LLMCompletion, LLMRequest
from agentserver.agents.profile import AgentProfile
from agentserver.agents.runtime import AgentRuntime
from agentserver.agents.settings import StoreSettings

NS = "urn:agentserver:assistant"
ADD = "<add xmlns='urn:calc'><a>1</a><b>2</b></add>"


class InstantLLM:
    def __init__(self) -> None:
        self.calls = 0

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        self.calls += 1
        if request.messages[-1].content.startswith("Result from"):
            return LLMCompletion("The sum is 3.")
        return LLMCompletion(f"I will ask the calculator. {ADD}")


class InstantTools:
    def __init__(self) -> None:
        self.runtime: AgentRuntime | None = None
        self.nursery: trio.Nursery | None = None

    async def call(
        self, agent: str, turn_thread: Any, payload: etree._Element, to: str | None
    ) -> str:
        sub = uuid.uuid4().hex
        assert self.nursery is not None and self.runtime is not None
        result = etree.Element("{urn:calc}sum", nsmap={None: "urn:calc"})
        result.text = "3"
        self.nursery.start_soon(self.runtime.report_tool_result, agent, sub, result)
        return sub

    async def self_iterate(self, agent: str, turn_thread: Any, payload: etree._Element) -> None:
        return None


class CountingReplies:
    def __init__(self) -> None:
        self.count = 0

    async def deliver(
        self, reply_ref: Any, payload: etree._Element, *, failed: bool, turn_id: str
    ) -> None:
        self.count += 1


def task(i: int) -> bytes:
    el = etree.Element(f"{{{NS}}}task", nsmap={None: NS})
    etree.SubElement(el, f"{{{NS}}}text").text = f"task {i}"
    return etree.tostring(el)


async def run(turns: int, agents: int, concurrency: int, path: Path) -> dict[str, float]:
    names = [f"agent{i}" for i in range(agents)]
    profiles = {
        n: AgentProfile(
            name=n,
            model="instant",
            own_roots=(f"{{{NS}}}task",),
            peers={"{urn:calc}add": "calculator"},
        )
        for n in names
    }
    llm, tools, replies = InstantLLM(), InstantTools(), CountingReplies()
    settings = StoreSettings(path=path, worker_concurrency=concurrency)
    rt = AgentRuntime.open(settings, profiles, llm=llm, tools=tools, replies=replies)
    sub = rt.events.subscribe(capacity=turns * 16)
    done = 0
    async with trio.open_nursery() as nursery:
        tools.runtime, tools.nursery = rt, nursery
        await nursery.start(rt.run)
        t0 = time.perf_counter()
        for i in range(turns):
            await rt.enqueue(names[i % agents], task(i), {"i": i})
        while done < turns:
            if isinstance(await sub.receive(), TaskEvent):
                done += 1
        elapsed = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    await rt.aclose()
    assert replies.count == turns, (replies.count, turns)
    return {
        "turns": turns,
        "agents": agents,
        "seconds": round(elapsed, 3),
        "turns_per_s": round(turns / elapsed, 1),
        "steps": llm.calls,
        "step_ms": round(elapsed * 1000 / llm.calls, 3),
        "dropped_events": sub.dropped,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=2000)
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = trio.run(run, args.turns, args.agents, args.concurrency, Path(tmp) / "bench.sqlite3")
    print(
        f"{out['turns']} turns ({out['steps']} model steps) over {out['agents']} agents "
        f"in {out['seconds']} s"
    )
    print(f"{out['turns_per_s']} Turns/s, {out['step_ms']} ms per step (protocol only)")
    print(json.dumps({"turns_per_s": out["turns_per_s"], "step_ms": out["step_ms"]}))


if __name__ == "__main__":
    main()
