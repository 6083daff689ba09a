"""Benchmark: how the store grows with a conversation (issue 38), against LangGraph's.

One conversation of ``--turns`` Turns (default 1,000) through the real pump, store and
worker (bench/turns.py's Turn: the task, one calculator call, the answer), with memory on
(``memory="client"``: every task continues the same conversation) and compaction at a
small window (``--window`` tokens, default 2,000: the conversation is folded into a
rolling summary every few Turns). The model is an instant scripted LLM port. After Turns
10, 100 and the last, the store's size is taken:

- SQLite: the file plus its WAL after a ``TRUNCATE`` checkpoint, and each table's bytes
  (``dbstat``, indexes counted with their table);
- PostgreSQL (``--store URL``, a database of its own: emptied first):
  ``pg_total_relation_size`` of every table, summed.

With ``--peers`` the same conversation runs on LangGraph 1.x (bench/peers/
langgraph_growth.py, the ``peers`` extra, in its own process: it is asyncio) with its
SQLite checkpointer and, with ``--store``, its PostgreSQL one, measured the same way.
Figures: bytes per Turn at each mark (size / Turns), the per-table split at the last mark,
and the ratio of LangGraph's bytes per Turn to ours at the last mark.

Usage: python bench/store_growth.py [--turns N] [--window TOKENS] [--store URL] [--peers]
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from lxml import etree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turns as bench_turns  # the Turn of bench/turns.py

from agentserver.agents.clock import SystemClock
from agentserver.agents.edge.bridge import PumpPorts, agent_handler
from agentserver.agents.ports import LLMCompletion, LLMRequest
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.runtime import AgentRuntime, open_agent_store
from agentserver.agents.service import LateHandler
from agentserver.agents.store.sql.stats import TABLES
from agentserver.agents.turn.compaction import SUMMARY_SYSTEM
from agentserver.app.runtime_parts import runtime_parts
from agentserver.core.envelope import build_envelope
from agentserver.core.listener import Listener
from agentserver.listeners.calculator import Add, Sum
from agentserver.pump.pump import PumpConfig, open_pump

MARKS = (10, 100, 1000)


class ConversationLLM(bench_turns.InstantLLM):
    """bench/turns.py's model, plus a short summary when asked to compact."""

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        if request.messages and request.messages[0].content == SUMMARY_SYSTEM:
            self.calls += 1
            return LLMCompletion("The user asks for 1 + 2 each time; the answer is 3.")
        return await super().complete(request)


def sqlite_size(path: Path) -> tuple[int, dict[str, int]]:
    """File plus WAL after a TRUNCATE checkpoint, and bytes per table (with its indexes)."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA busy_timeout = 5000")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        rows = db.execute(
            "SELECT coalesce(m.tbl_name, d.name), sum(d.pgsize) FROM dbstat d "
            "LEFT JOIN sqlite_master m ON m.name = d.name GROUP BY 1"
        ).fetchall()
    finally:
        db.close()
    total = sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())
    return total, {str(n): int(b) for n, b in rows if b}


def pg_size(url: str, tables: list[str] | None = None) -> tuple[int, dict[str, int]]:
    """``pg_total_relation_size`` of every table of the public schema (or ``tables``)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        names = tables or [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
            ).fetchall()
        ]
        sizes = {
            n: int(conn.execute("SELECT pg_total_relation_size(%s::regclass)", (n,)).fetchone()[0])
            for n in names
        }
    return sum(sizes.values()), sizes


async def conversation(
    n: int, window: int, path: Path, url: str | None, marks: tuple[int, ...]
) -> dict:
    """Run the conversation; the size at each mark."""
    task_model, answer_model = bench_turns.agent_models(0)
    late = LateHandler("agent0")
    listeners = [
        Listener(
            "agent0",
            (task_model,),
            late,
            peers=("calculator",),
            responses=(answer_model,),
            agent=True,
            raw=True,
        ),
        Listener("calculator", (Add,), bench_turns.calculator, responses=(Sum,)),
    ]
    llm = ConversationLLM()
    out: dict = {"turns": n, "marks": {}}
    async with open_pump(listeners, config=PumpConfig()) as pump:
        profile = AgentProfile(
            name="agent0",
            model="instant",
            own_roots=("{urn:bench:agent0}task",),
            peers={f"{{{bench_turns.CALC}}}add": "calculator"},
            usage_instructions=pump.usage_instructions("agent0"),
            memory="client",
            context_window=window,
            context_reserve=window // 8,
            keep_recent=window // 4,
            max_tokens=window // 8,
        )
        settings = StoreSettings(path=path, url=url, worker_concurrency=1)
        clock = SystemClock()
        store = open_agent_store(settings, {"agent0": profile}, clock=clock)
        ports = PumpPorts(pump, store=store)
        rt = AgentRuntime(
            runtime_parts(
                store=store,
                profiles={"agent0": profile},
                settings=settings,
                clock=clock,
                llm=llm,
                tools=ports,
                replies=ports,
            )
        )
        late.bind(agent_handler(rt, pump, "agent0"))
        client = pump.open_endpoint("bench")
        failed = 0
        async with trio.open_nursery() as nursery:
            await nursery.start(rt.run)
            t0 = time.perf_counter()
            for i in range(1, n + 1):
                task = task_model(text=f"task {i}: add 1 and 2").to_xml_tree()
                await client.send(etree.tostring(build_envelope("bench", "agent0", "t", task)))
                if not bench_turns.succeeded(etree.fromstring(await client.receive())):
                    failed += 1
                if i in marks:
                    total, tables = sqlite_size(path) if url is None else pg_size(url, list(TABLES))
                    out["marks"][i] = {"bytes": total, "bytes_per_turn": round(total / i)}
                    out["tables"] = {
                        k: round(v / i) for k, v in sorted(tables.items(), key=lambda kv: -kv[1])
                    }
            out["seconds"] = round(time.perf_counter() - t0, 2)
            nursery.cancel_scope.cancel()
        await rt.aclose()
    out["failed"] = failed
    out["model_calls"] = llm.calls
    return out


def run_peer(args: argparse.Namespace, marks: tuple[int, ...]) -> dict:
    """LangGraph's conversation in its own process (asyncio)."""
    cmd = [
        sys.executable,
        str(Path(__file__).parent / "peers" / "langgraph_growth.py"),
        "--turns",
        str(args.peer_turns),
        "--marks",
        ",".join(map(str, marks)),
    ]
    if args.store:
        cmd += ["--store", args.store]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    sys.stderr.write(done.stdout[: -len(done.stdout.splitlines()[-1]) - 1] if done.stdout else "")
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout)[-800:]}
    return json.loads(done.stdout.splitlines()[-1])


def _empty(url: str) -> None:
    bench_turns.empty_pg_store(url)


def report(name: str, case: dict) -> None:
    marks = ", ".join(f"Turn {k}: {v['bytes_per_turn']} B/Turn" for k, v in case["marks"].items())
    print(f"-- {name}: {marks}")
    if "tables" in case:
        print(
            "   per Turn at the last mark: "
            + ", ".join(f"{k} {v}" for k, v in case["tables"].items())
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=1000)
    ap.add_argument("--window", type=int, default=2000, help="context window (tokens)")
    ap.add_argument("--store", metavar="URL", help="also on this PostgreSQL database (emptied)")
    ap.add_argument("--peers", action="store_true", help="also LangGraph (the peers extra)")
    ap.add_argument(
        "--peer-turns",
        type=int,
        default=300,
        help="LangGraph's conversation length (default 300: its growth is quadratic, 1,000 "
        "Turns take minutes and gigabytes; the ratio is taken at its last mark)",
    )
    args = ap.parse_args()
    marks = (*(m for m in MARKS if m < args.turns), args.turns)
    peer_marks = (*(m for m in MARKS if m < args.peer_turns), args.peer_turns)
    if args.peers:  # ours is also measured where the peer's last mark is
        marks = tuple(sorted(set(marks) | {m for m in peer_marks if m <= args.turns}))
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        figures["sqlite"] = trio.run(
            conversation, args.turns, args.window, Path(tmp) / "growth.sqlite3", None, marks
        )
    report("agentserver, SQLite", figures["sqlite"])
    if args.store:
        _empty(args.store)
        figures["postgresql"] = trio.run(
            conversation, args.turns, args.window, Path("unused"), args.store, marks
        )
        report("agentserver, PostgreSQL", figures["postgresql"])
    if args.peers:
        peer = run_peer(args, peer_marks)
        for name, case in peer.items():
            if isinstance(case, dict) and "marks" in case:
                figures[f"langgraph_{name}"] = case
                report(f"LangGraph, {name}", case)
            else:
                figures[f"langgraph_{name}"] = case
        at = min(args.turns, args.peer_turns)
        for ours, theirs in (
            ("sqlite", "langgraph_sqlite"),
            ("postgresql", "langgraph_postgresql"),
        ):
            a, b = figures.get(ours), figures.get(theirs)
            if a and isinstance(b, dict) and "marks" in b and str(at) in b["marks"]:
                mine = a["marks"][at]["bytes_per_turn"]
                peer_bpt = b["marks"][str(at)]["bytes_per_turn"]
                key = f"ratio_{ours}_langgraph_vs_ours_at_{at}"
                figures[key] = round(peer_bpt / max(mine, 1), 1)
                print(f"{key}: {figures[key]}x")
    # JSON keys are strings.
    print(json.dumps(figures, default=str))
    raise SystemExit(
        1 if any(c.get("failed") for c in figures.values() if isinstance(c, dict)) else 0
    )


if __name__ == "__main__":
    main()
