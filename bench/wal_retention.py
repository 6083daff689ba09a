"""Benchmark: the SQLite WAL's peak under a steady load, with and without retention (issue 43).

A steady ``--rate`` tasks per second (default 15) for ``--seconds`` (default 100) through
the real pump, store and worker (bench/turns.py's Turn: the task, one calculator call,
the answer; an instant scripted model), spread over ``--agents`` agents, twice on a new
SQLite store each: without retention, and with the chaos bench's short windows
(bench/support/chaos_retention.py: finished tasks after 20 s, ``keep-last="1"``, events
and acknowledged replies after 10 s, the pruner every 2 s), the pruner running beside the
Turns as the server runs it. The ``-wal`` file's size is sampled every 50 ms; the figures
are bytes (its peak, its size at the end, the database file's peak), never speed: the
machine may be shared.

Usage: python bench/wal_retention.py [--rate N] [--seconds S] [--agents N]
The last line printed is one JSON object: ``wal_peak_bytes`` with and without retention
and ``wal_peak_ratio`` (with / without; issue 43's bound is 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import trio
from lxml import etree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turns as bench_turns  # the Turn of bench/turns.py

from agentserver.agents.clock import SystemClock
from agentserver.agents.edge.bridge import PumpPorts, agent_handler
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.retention import AgentRetention, RetentionSettings
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.runtime import AgentRuntime, open_agent_store
from agentserver.agents.service import LateHandler
from agentserver.agents.store.pruner import Pruner
from agentserver.app.runtime_parts import runtime_parts
from agentserver.core.envelope import build_envelope
from agentserver.core.listener import Listener
from agentserver.listeners.calculator import Add, Sum
from agentserver.pump.pump import PumpConfig, open_pump

#: bench/support/chaos_retention.py's RETENTION, as settings.
RETENTION = RetentionSettings(
    defaults=AgentRetention(finished_tasks_s=20.0, keep_last=1, events_s=10.0),
    step_log_s=20.0,
    acknowledged_replies_s=10.0,
    tombstones_s=60.0,
    deliveries_s=20.0,
    interval_s=2.0,
)
SAMPLE_S = 0.05


def size(path: Path) -> int:
    """A file's size in bytes (0: none)."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


async def steady(
    path: Path, rate: float, seconds: float, agents: int, retention: bool
) -> dict[str, object]:
    """Run the load on a new store at ``path``; the WAL's and the file's figures."""
    names = [f"agent{i}" for i in range(agents)]
    models = [bench_turns.agent_models(i) for i in range(agents)]
    late = {n: LateHandler(n) for n in names}
    listeners = [
        Listener(
            n, (task,), late[n], peers=("calculator",), responses=(answer,), agent=True, raw=True
        )
        for n, (task, answer) in zip(names, models, strict=True)
    ]
    listeners.append(
        Listener("calculator", (Add,), bench_turns.calculator, responses=(Sum,), concurrency=8)
    )
    total = int(rate * seconds)
    config = PumpConfig(endpoint_buffer=total + 16, max_threads_per_endpoint=4 * total + 64)
    wal = path.with_name(path.name + "-wal")
    figures: dict[str, object] = {}
    async with open_pump(listeners, config=config) as pump:
        profiles = {
            n: AgentProfile(
                name=n,
                model="instant",
                own_roots=(f"{{urn:bench:agent{i}}}task",),
                peers={f"{{{bench_turns.CALC}}}add": "calculator"},
                usage_instructions=pump.usage_instructions(n),
            )
            for i, n in enumerate(names)
        }
        settings = StoreSettings(
            path=path, worker_concurrency=4, retention=RETENTION if retention else None
        )
        clock = SystemClock()
        store = open_agent_store(settings, profiles, clock=clock)
        ports = PumpPorts(pump, store=store)
        rt = AgentRuntime(
            runtime_parts(
                store=store,
                profiles=profiles,
                settings=settings,
                clock=clock,
                llm=bench_turns.InstantLLM(),
                tools=ports,
                replies=ports,
            )
        )
        for n in names:
            late[n].bind(agent_handler(rt, pump, n))
        client = pump.open_endpoint("bench")
        wal_peak = file_peak = 0
        done = trio.Event()

        async def sample() -> None:
            nonlocal wal_peak, file_peak
            while not done.is_set():
                wal_peak = max(wal_peak, size(wal))
                file_peak = max(file_peak, size(path))
                await trio.sleep(SAMPLE_S)

        ok = failed = 0

        async def receive() -> None:
            nonlocal ok, failed
            while ok + failed < total:
                reply = etree.fromstring(await client.receive())
                if bench_turns.succeeded(reply):
                    ok += 1
                else:
                    failed += 1

        pruner = Pruner(rt.store, RETENTION, names) if retention else None
        async with trio.open_nursery() as nursery:
            await nursery.start(rt.run)
            if pruner is not None:
                nursery.start_soon(pruner.run)
            nursery.start_soon(sample)
            receiving = trio.Event()

            async def receive_all() -> None:
                await receive()
                receiving.set()

            nursery.start_soon(receive_all)
            start = trio.current_time()
            for i in range(total):
                # A steady rate: task i leaves at start + i / rate, however long sends take.
                await trio.sleep_until(start + i / rate)
                task = models[i % agents][0](text=f"task {i}").to_xml_tree()
                await client.send(
                    etree.tostring(build_envelope("bench", names[i % agents], "t", task))
                )
            with trio.move_on_after(60):
                await receiving.wait()
            done.set()
            figures = {
                "tasks": total,
                "answered": ok,
                "failed": failed,
                "wal_peak_bytes": wal_peak,
                "wal_end_bytes": size(wal),
                "file_peak_bytes": file_peak,
                "file_end_bytes": size(path),
                "pruned_tasks": pruner.tasks_pruned if pruner is not None else 0,
                "prune_runs": pruner.runs if pruner is not None else 0,
            }
            nursery.cancel_scope.cancel()
        await rt.aclose()
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=15.0, help="tasks per second (default 15)")
    ap.add_argument("--seconds", type=float, default=100.0, help="how long (default 100)")
    ap.add_argument("--agents", type=int, default=4)
    args = ap.parse_args()
    out: dict[str, object] = {"rate": args.rate, "seconds": args.seconds}
    for retention in (False, True):
        with tempfile.TemporaryDirectory(prefix="wal-bench-") as tmp:
            fig = trio.run(
                steady,
                Path(tmp) / "agents.sqlite3",
                args.rate,
                args.seconds,
                args.agents,
                retention,
            )
        case = "with_retention" if retention else "without_retention"
        print(
            f"{case}: WAL peak {fig['wal_peak_bytes'] / 2**20:.2f} MiB "
            f"(end {fig['wal_end_bytes'] / 2**20:.2f} MiB), file peak "
            f"{fig['file_peak_bytes'] / 2**20:.2f} MiB; {fig['answered']}/{fig['tasks']} answered, "
            f"{fig['pruned_tasks']} pruned in {fig['prune_runs']} runs",
            file=sys.stderr,
            flush=True,
        )
        out[case] = fig
    without = out["without_retention"]["wal_peak_bytes"]  # type: ignore[index]
    with_ = out["with_retention"]["wal_peak_bytes"]  # type: ignore[index]
    out["wal_peak_ratio"] = round(with_ / without, 2) if without else None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
