"""Benchmark: fair share between clients in front of an agent (issue 37, docs/budgets.md
"Fair share").

One agent on a real SQLite store runs Turns whose model step takes ``--step-ms``. A quiet
client sends one task every ``--every-ms``; its wait (from the durable enqueue to the
answer) is measured first alone, then while a flooding client has sent ``--flood`` tasks
at once: with ``<store fair-share="true">`` and without (first come, first served), in
the same run. The promise: with fair share the quiet client's task waits at most the
Turn running when it arrives (about one step), flood or not.

Usage: python bench/fairness.py [--flood N] [--quiet N] [--step-ms MS] [--every-ms MS]
The last line printed is one JSON object: the quiet client's wait p50/p99 (ms) per case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from lxml import etree

from agentserver.agents.clock import SystemClock
from agentserver.agents.ports import LLMCompletion, LLMRequest, LLMUsage
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.settings import StoreSettings
from agentserver.app.runtime_parts import open_runtime

NS = "urn:bench:fair"


class SteadyModel:
    """Answers every task at once after ``step_s`` (the model's time)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        await trio.sleep(self.step_s)
        return LLMCompletion("done", LLMUsage(10, 5, 15))


class NoTools:
    async def call(self, *args: Any, **kw: Any) -> str:
        raise AssertionError("the bench's agent calls no tool")

    def check_call(self, *args: Any, **kw: Any) -> None:
        raise AssertionError("the bench's agent calls no tool")

    async def self_iterate(self, *args: Any, **kw: Any) -> None:
        raise AssertionError("the bench's agent does not iterate")


class Answers:
    """When each thread was answered."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.changed = trio.Event()

    async def deliver(self, reply_ref: Any, payload: Any, *, failed: bool, turn_id: str) -> None:
        self.at.setdefault(reply_ref["thread"], time.perf_counter())
        self.changed.set()
        self.changed = trio.Event()


def task(text: str) -> bytes:
    el = etree.Element(f"{{{NS}}}task", nsmap={None: NS})
    el.text = text
    return etree.tostring(el)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def case(path: Path, fair: bool, args: argparse.Namespace) -> dict[str, Any]:
    """The quiet client's waits alone, then under the flood, in one runtime."""
    settings = StoreSettings(
        path=path,
        worker_concurrency=1,
        fair_weights=(("flood", 1.0), ("quiet", 1.0)) if fair else None,
    )
    profile = AgentProfile(name="agent", model="m", own_roots=(f"{{{NS}}}task",))
    answers = Answers()
    rt = open_runtime(
        settings,
        {"agent": profile},
        llm=SteadyModel(args.step_ms / 1000),
        tools=NoTools(),  # type: ignore[arg-type]
        replies=answers,
        clock=SystemClock(),
    )
    waits: dict[str, list[float]] = {"alone": [], "flooded": []}
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.run)

        async def quiet(phase: str) -> None:
            sent: dict[str, float] = {}
            for i in range(args.quiet):
                thread = f"q-{phase}-{i}"
                sent[thread] = time.perf_counter()
                await rt.enqueue("agent", task(thread), {"thread": thread, "client": "quiet"})
                await trio.sleep(args.every_ms / 1000)
            while any(t not in answers.at for t in sent):
                await answers.changed.wait()
            waits[phase] = [(answers.at[t] - s) * 1000 for t, s in sent.items()]

        await quiet("alone")
        flood = [f"f-{i}" for i in range(args.flood)]
        for thread in flood:
            await rt.enqueue("agent", task(thread), {"thread": thread, "client": "flood"})
        await quiet("flooded")
        with trio.fail_after(600):
            while any(t not in answers.at for t in flood):
                await answers.changed.wait()
        nursery.cancel_scope.cancel()
    await rt.aclose()
    out: dict[str, Any] = {}
    for phase, values in waits.items():
        out[f"{phase}_p50_ms"] = round(statistics.median(values), 1)
        out[f"{phase}_p99_ms"] = round(percentile(values, 0.99), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood", type=int, default=300, help="the flooding client's tasks")
    ap.add_argument("--quiet", type=int, default=20, help="the quiet client's tasks per phase")
    ap.add_argument("--step-ms", type=float, default=5.0, help="the model's time per Turn")
    ap.add_argument("--every-ms", type=float, default=20.0, help="between quiet tasks")
    args = ap.parse_args()
    figures: dict[str, Any] = {"flood": args.flood, "quiet": args.quiet, "step_ms": args.step_ms}
    for fair in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            got = trio.run(case, Path(tmp) / "fair.sqlite3", fair, args)
        name = "fair_share" if fair else "first_come"
        print(f"{name}: {json.dumps(got)}")
        figures[name] = got
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
