"""Benchmark: many short Turns through the real pump, SQLite store and worker.

Each Turn: a client's task enters the pump → the agent listener enqueues it (durable) →
step 1: the model calls the calculator → the tool call is forwarded through the pump, the
calculator listener answers on the call's sub-thread → the result is recorded in the inbox
→ resume → step 2: the model answers → deliverable card → the answer is routed through the
pump back to the client's thread. The model is an instant scripted LLM port, so the figures
are the protocol's own cost (store transactions, parsing, routing). Step retry and the
context budget checks (issue 12) are part of that cost: every step checks the budget
against the running token count on the head, every card's token estimate is written with
it.

Only successful answers count: an ``<answer>`` carrying the model's final text ("The sum is
3.") and not marked failed. Any other reply (a failed Turn's answer, a refusal) fails the
run after the JSON line. ``amortized_step_ms`` is the run's wall time divided by all model
steps of all agents and workers together: the inverse of the step throughput, not the
latency of one step (steps run concurrently, so each takes longer than that).

With ``--store postgresql://...`` the same Turns run, in one invocation, on SQLite, then on
that PostgreSQL database with one process, then with ``--processes N`` (default 2) processes
sharing it (its tables are emptied before each, so use a database of its own). Each of the
N processes is a real OS process (this script with ``--worker``): its own pump, runtime and
store connections, its own anonymous client sending its share of the Turns to all the
agents, so the Turns run on either process and their answers come back through the store
(docs/deploy.md). The processes start sending together; their figure is all the answers
over the time from that start to the last answer, in any process.

Every case also prints the application's CPU per Turn (``cpu_ms_per_turn``: the
process's CPU time, all its threads, over the timed part; with N processes all of
theirs), and on PostgreSQL the database server's CPU per Turn (``db_cpu_ms_per_turn``:
every process of the server, from /proc, bench/support/pgcpu.py; null if the server is not on
this machine) and the statements and round trips to it per Turn (``statements_per_turn``,
``round_trips_per_turn``, ``BEGIN``/``COMMIT`` included; counted by the trio executor,
null with ``--pg-executor thread``).

With ``--peers`` the same invocation runs the peer, LangGraph (bench/peers/
langgraph_turns.py, the ``peers`` extra), on SQLite and with ``--store`` on the same
PostgreSQL database, at its best: at 16 and at 64 Turns in flight (``--peer-concurrency``),
with its default durability and its SQLite saver in WAL mode, each case's best run
counting. The JSON gets ``ratio_sqlite_vs_langgraph`` and
``ratio_postgresql_vs_langgraph`` (our Turns/s over the peer's, one process) and
``cpu_ratio_postgresql_vs_sqlite`` (our application CPU per Turn, PostgreSQL one process
over SQLite).

Every case also prints what a Turn writes (bench/support/writes.py): on SQLite its commits
(``commits_per_turn``: each transaction and each autocommit write) and rows written
(``rows_written_per_turn``), and with ``--count-statements`` the index entries written
too, by statement and table (``writes_per_turn_by_table``); on PostgreSQL the rows and
index entries written, from the server's table counters.

Every case also prints its store calls per Turn, by store function (each call one
transaction or one autocommit statement; on PostgreSQL one thread hop), counted from the
runtime's start to the last answer (``store_calls_per_turn`` in the JSON).

With ``--fair-share`` the same Turns run with fair share off and on (alternated, best
of two each; one client: the bench's anonymous one), on SQLite and with ``--store`` on
PostgreSQL, one process: fair share's cost per Turn (docs/budgets.md, "Fair share").

Usage: python bench/turns.py [--turns N] [--agents K] [--concurrency C] [--count-statements]
                             [--store URL [--processes N] [--pg-executor trio|thread]]
                             [--budget | --fair-share]
                             [--peers [--peer-concurrency C,C]]
The last line printed is one JSON object (with a store: every case, and the ratio of N
processes to one).
"""

from __future__ import annotations

import argparse
import collections
import contextvars
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from pathlib import Path

import trio
from lxml import etree
from pydantic_xml import BaseXmlModel, element

from agentserver.agents.clock import SystemClock
from agentserver.agents.edge.bridge import PumpPorts, agent_handler
from agentserver.agents.governance.budgets import Budgets
from agentserver.agents.policy.budget import BudgetSpec
from agentserver.agents.ports import LLMCompletion, LLMRequest
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.retention import AgentRetention, RetentionSettings
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.runtime import AgentRuntime, open_agent_store
from agentserver.agents.service import LateHandler
from agentserver.app.runtime_parts import runtime_parts
from agentserver.core.envelope import build_envelope
from agentserver.core.listener import HandlerResponse, Listener
from agentserver.listeners.calculator import Add, Sum
from agentserver.pump.pump import PumpConfig, open_pump

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
import pgcpu
from writes import SqliteWrites, Writes, pg_table_writes, pg_writes_between

CALC = "urn:agentserver:calculator"
ADD = f'<add xmlns="{CALC}"><a>1</a><b>2</b></add>'
FINAL = "The sum is 3."

#: ``--retention``: finished tasks go after 0.2 s, the pruner runs every 0.25 s.
RETENTION = RetentionSettings(
    defaults=AgentRetention(finished_tasks_s=0.2, keep_last=0, events_s=0.2),
    step_log_s=0.2,
    acknowledged_replies_s=0.2,
    interval_s=0.25,
)


def agent_models(i: int) -> tuple[type[BaseXmlModel], type[BaseXmlModel]]:
    """Each agent needs its own root tag (only broadcast listeners may share one)."""
    ns = f"urn:bench:agent{i}"

    class Task(BaseXmlModel, tag="task", nsmap={"": ns}):
        text: str = element()

    class Answer(BaseXmlModel, tag="answer", nsmap={"": ns}):
        text: str = element()

    return Task, Answer


class InstantLLM:
    def __init__(self) -> None:
        self.calls = 0

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        self.calls += 1
        if "<value>3</value>" in request.messages[-1].content:
            return LLMCompletion(FINAL)
        return LLMCompletion(f"I will ask the calculator. {ADD}")


async def calculator(p: Add, meta) -> HandlerResponse:
    return HandlerResponse.respond(Sum(value=p.a + p.b))


def succeeded(reply: etree._Element) -> bool:
    """The reply is an agent's answer with the model's final text, not a failed Turn's."""
    payload = reply[1]
    return (
        etree.QName(payload).localname == "answer"
        and payload.get("status", "succeeded") != "failed"
        and payload.findtext("{*}text") == FINAL
    )


_COUNTED = contextvars.ContextVar("_COUNTED", default=False)


def count_store_calls(
    store: object, calls: collections.Counter, kinds: collections.Counter | None = None
) -> None:
    """Count the store's calls (one transaction or one autocommit statement each; on
    PostgreSQL, one thread hop each) by the store function they run, in ``calls``, and
    by kind (``run`` a transaction, ``run1`` one autocommit statement, ``read`` a
    read) in ``kinds``."""

    def wrap(name: str, method: Callable) -> Callable:
        async def counted(fn: Callable, *args: object, **kwargs: object) -> object:
            if _COUNTED.get():  # a call that delegates to another (PostgreSQL's run1)
                return await method(fn, *args, **kwargs)
            calls[fn.__name__] += 1
            if kinds is not None:
                kinds[name] += 1
            _COUNTED.set(True)
            try:
                return await method(fn, *args, **kwargs)
            finally:
                _COUNTED.set(False)

        return counted

    for name in ("run", "read", "run1"):
        setattr(store, name, wrap(name, getattr(store, name)))


def empty_pg_store(url: str) -> None:
    """Drop the store's tables in ``url`` (a bench database), so each run starts empty."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")


async def run(
    turns: int,
    agents: int,
    concurrency: int,
    path: Path,
    count_statements: bool = False,
    url: str | None = None,
    gate: Callable[[], Awaitable[None]] | None = None,
    hold: Callable[[dict], Awaitable[None]] | None = None,
    pg_executor: str = "trio",
    retention: bool = False,
    budget: bool = False,
    fair_share: bool = False,
) -> dict[str, float]:
    """Run ``turns`` Turns (``budget``: with an organism budget too large to refuse, so
    every model call reserves and settles; ``fair_share``: with fair share between
    clients on, as boot.xml's ``<store>`` has it by default, the one anonymous client's
    Turns leased through agents/store/sql/fair.py); with ``gate``, wait for it once everything is running, just
    before the first task is sent (the start of the clock); with ``hold``, pass it the
    figures once every answer is in, and keep running until it returns (the Turns this
    process runs for other processes' callers go on)."""
    names = [f"agent{i}" for i in range(agents)]
    models = [agent_models(i) for i in range(agents)]
    late = {n: LateHandler(n) for n in names}
    listeners = [
        Listener(
            n, (task,), late[n], peers=("calculator",), responses=(answer,), agent=True, raw=True
        )
        for n, (task, answer) in zip(names, models, strict=True)
    ]
    listeners.append(Listener("calculator", (Add,), calculator, responses=(Sum,), concurrency=8))
    llm = InstantLLM()
    # The one "bench" endpoint stands for many clients sending every task at once: its
    # share of the registry (max_threads_per_endpoint) must hold all their threads.
    config = PumpConfig(endpoint_buffer=turns + 16, max_threads_per_endpoint=4 * turns + 64)
    async with open_pump(listeners, config=config) as pump:
        profiles = {
            n: AgentProfile(
                name=n,
                model="instant",
                own_roots=(f"{{urn:bench:agent{i}}}task",),
                peers={f"{{{CALC}}}add": "calculator"},
                usage_instructions=pump.usage_instructions(n),
            )
            for i, n in enumerate(names)
        }
        settings = StoreSettings(
            path=path,
            url=url,
            worker_concurrency=concurrency,
            pg_executor=pg_executor,
            retention=RETENTION if retention else None,  # SQLite: auto_vacuum INCREMENTAL
            fair_weights=() if fair_share else None,
        )
        clock = SystemClock()
        store = open_agent_store(settings, profiles, clock=clock)
        ports = PumpPorts(pump, store=store)
        spend = None
        if budget:
            spend = Budgets(store, clock, [BudgetSpec("organism", tokens=10**15)])
        rt = AgentRuntime(
            runtime_parts(
                store=store,
                profiles=profiles,
                settings=settings,
                clock=clock,
                llm=llm,
                tools=ports,
                replies=ports,
                budgets=spend,
            )
        )
        calls: collections.Counter = collections.Counter()
        kinds: collections.Counter = collections.Counter()
        count_store_calls(rt.store, calls, kinds)
        per_call: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        if hasattr(getattr(rt.store, "executor", None), "on_call"):

            def on_call(fn: Callable, args: tuple, statements: int, trips: int) -> None:
                # The store's NOTIFY wrapper names the function it runs in its arguments.
                name = args[2].__name__ if fn.__name__ == "_notifying" else fn.__name__
                figures = per_call[name]
                figures[0] += 1
                figures[1] += statements
                figures[2] += trips

            rt.store.executor.on_call = on_call
        statements = [0]
        # SQLite: its commits, rows and index entries written (bench/support/writes.py);
        # every statement traced only with count_statements (the trace costs a little).
        sqlite_db = getattr(rt.store, "_db", None) if url is None else None
        traced = SqliteWrites(sqlite_db, str(path)) if count_statements and sqlite_db else None
        for n in names:
            late[n].bind(agent_handler(rt, pump, n))
        client = pump.open_endpoint("bench")
        requests = [
            etree.tostring(
                build_envelope(
                    "bench",
                    names[i % agents],
                    "t",
                    models[i % agents][0](text=f"task {i}").to_xml_tree(),
                )
            )
            for i in range(turns)
        ]
        async with trio.open_nursery() as nursery:
            await nursery.start(rt.run)
            pruner = None
            if retention:
                # The pruner against the same store, short windows so it deletes during
                # the run (issue 38): what it costs the Turns.
                from agentserver.agents.store.pruner import Pruner

                pruner = Pruner(rt.store, RETENTION, names)
                nursery.start_soon(pruner.run)
            if gate is not None:
                await gate()
            executor = getattr(rt.store, "executor", None)
            sent0 = _sent(executor)
            per_call.clear()
            kinds.clear()
            changes0 = sqlite_db.total_changes if sqlite_db is not None else 0
            if traced is not None:
                traced.start()
            started_at = time.time()
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            for data in requests:
                await client.send(data)
            ok, failed, first_failure = 0, 0, ""
            while ok + failed < turns:
                reply = etree.fromstring(await client.receive())
                if succeeded(reply):
                    ok += 1
                else:
                    failed += 1
                    first_failure = first_failure or etree.tostring(reply).decode()[:600]
            elapsed = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            ended_at = time.time()
            sent1 = _sent(executor)
            if traced is not None:
                writes = traced.stop()
                statements[0] = traced.statements
            elif sqlite_db is not None:
                # A transaction (run) or an autocommit statement (run1) is one commit.
                writes = Writes(
                    commits=kinds["run"] + kinds["run1"],
                    rows=sqlite_db.total_changes - changes0,
                )
            else:
                writes = None
            out = figures(
                turns, agents, ok, failed, first_failure, elapsed, llm, statements[0], calls
            )
            done = max(ok + failed, 1)
            out.update(
                started_at=started_at,
                ended_at=ended_at,
                cpu_s=cpu,
                cpu_ms_per_turn=round(cpu * 1000 / done, 2),
                pg_statements=None if sent0 is None else sent1[0] - sent0[0],
                pg_round_trips=None if sent0 is None else sent1[1] - sent0[1],
                # store function -> [calls, statements, round trips] (trio executor)
                pg_per_call={k: list(v) for k, v in per_call.items()},
            )
            if writes is not None:
                out.update(writes.per_turn(done))
                if traced is None:
                    out["index_entries_written_per_turn"] = None  # traced only
            if pruner is not None:
                out["pruned_tasks"] = pruner.tasks_pruned
                out["prune_runs"] = pruner.runs
            if hold is not None:
                await hold(out)
            nursery.cancel_scope.cancel()
        await rt.aclose()
    return out


def _sent(executor: object) -> tuple[int, int] | None:
    """The statements and round trips the store's executor sent so far (the trio one
    counts them; None for SQLite or the thread executor)."""
    if executor is None or not hasattr(executor, "round_trips"):
        return None
    return executor.statements, executor.round_trips


def figures(
    turns: int,
    agents: int,
    ok: int,
    failed: int,
    first_failure: str,
    elapsed: float,
    llm: InstantLLM,
    statements: int,
    calls: collections.Counter,
) -> dict:
    done = max(ok + failed, 1)
    return {
        "turns": turns,
        "agents": agents,
        "succeeded": ok,
        "failed": failed,
        "first_failure": first_failure,
        "seconds": round(elapsed, 3),
        "turns_per_s": round(ok / elapsed, 1),
        "steps": llm.calls,
        "amortized_step_ms": round(elapsed * 1000 / llm.calls, 3),
        "statements_per_turn": round(statements / done, 1),
        # Counted from the start of the runtime to the last answer, start-up included.
        "store_calls_per_turn": round(sum(calls.values()) / done, 2),
        "store_calls": dict(calls.most_common()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, help="Turns per case (default 2000; 400 with --store)")
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument(
        "--count-statements",
        action="store_true",
        help="count the SQL statements per Turn (a trace callback: slows the run a little)",
    )
    ap.add_argument(
        "--store",
        metavar="URL",
        help="a PostgreSQL database: run SQLite, then it with 1 and with N processes",
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=2,
        metavar="N",
        help="with --store: the processes of the last case (default 2; 1 skips it)",
    )
    ap.add_argument(
        "--pg-executor",
        choices=("trio", "thread"),
        default="trio",
        help="with --store: the store's executor (StoreSettings.pg_executor; default trio)",
    )
    ap.add_argument(
        "--peers",
        action="store_true",
        help="also run LangGraph on the same Turn (bench/peers/langgraph_turns.py) and "
        "print the ratios",
    )
    ap.add_argument(
        "--peer-concurrency",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=PEER_CONCURRENCY,
        metavar="C,C",
        help="with --peers: the peer's Turns in flight, each tried; its best counts "
        "(default 16,64)",
    )
    ap.add_argument(
        "--retention",
        action="store_true",
        help="also run with the pruner against the same store (short windows) and print "
        "both Turns/s (SQLite)",
    )
    ap.add_argument(
        "--budget",
        action="store_true",
        help="measure the spend budgets' reservation: the same Turns without and with an "
        "organism <budget>, on SQLite and (with --store) PostgreSQL, one process each",
    )
    ap.add_argument(
        "--fair-share",
        action="store_true",
        help="measure fair share's cost: the same Turns (one client) with <store "
        'fair-share="false"> and with fair share on (the default), alternated, best of '
        "two each, on SQLite and (with --store) PostgreSQL, one process each",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.turns is None:
        # With a store there are three cases, PostgreSQL's several times slower: under
        # a minute in all.
        args.turns = 400 if args.store else 2000
    if args.worker:
        return worker(args)
    if args.count_statements and args.store:
        ap.error("--count-statements counts SQLite statements only")
    if args.processes < 1:
        ap.error("--processes must be at least 1")
    if args.budget:
        return budget_cost(args)
    if args.fair_share:
        return fair_share_cost(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = trio.run(
            run,
            args.turns,
            args.agents,
            args.concurrency,
            Path(tmp) / "bench.sqlite3",
            args.count_statements,
        )
    report(out, args.count_statements, "SQLite")
    if args.retention:
        # Alternated, best of each: the machine's drift (and the order) between two runs
        # is of the size of the difference measured.
        runs: dict[bool, list[dict[str, object]]] = {False: [out], True: []}
        for pruning in (True, False, True):
            with tempfile.TemporaryDirectory() as tmp:
                got = trio.run(
                    partial(
                        run,
                        args.turns,
                        args.agents,
                        args.concurrency,
                        Path(tmp) / "bench.sqlite3",
                        retention=pruning,
                    )
                )
            runs[pruning].append(got)
            report(got, False, "SQLite, the pruner running" if pruning else "SQLite")
        out = max(runs[False], key=lambda r: r["turns_per_s"])
        kept = max(runs[True], key=lambda r: r["turns_per_s"])
        ratio = round(kept["turns_per_s"] / max(out["turns_per_s"], 0.1), 3)
        print(
            f"retention: {kept['turns_per_s']} vs {out['turns_per_s']} Turns/s ({ratio}x; "
            f"best of {len(runs[True])} runs each, alternated)"
        )
        failed = sum(r["failed"] for rs in runs.values() for r in rs)
        print(
            json.dumps(
                {
                    "store": "SQLite",
                    "turns_per_s": out["turns_per_s"],
                    "turns_per_s_with_pruner": kept["turns_per_s"],
                    "ratio_with_pruner": ratio,
                    "prune_runs": kept.get("prune_runs"),
                    "pruned_tasks": kept.get("pruned_tasks"),
                    "runs_each": len(runs[True]),
                    "failed": failed,
                }
            )
        )
        raise SystemExit(1 if failed else 0)
    peers = run_peers(args) if args.peers else {}
    if not args.store:
        figures = {"store": "SQLite", **summary(out, args.count_statements)}
        if peers:
            figures["langgraph_sqlite"] = peers["sqlite"]
            figures["ratio_sqlite_vs_langgraph"] = _ratio(out, peers["sqlite"])
        print(json.dumps(figures))
        raise SystemExit(1 if out["failed"] or peers.get("failed") else 0)
    cases = {"sqlite": out}
    counts = [1] if args.processes == 1 else [1, args.processes]
    for n in counts:
        empty_pg_store(args.store)
        got = processes(args, n)
        report(got, False, f"PostgreSQL, {n} process{'es' if n > 1 else ''}")
        cases[f"postgresql_{n}p"] = got
    figures: dict[str, object] = {k: summary(v, False) for k, v in cases.items()}
    one = cases["postgresql_1p"]
    if one["cpu_ms_per_turn"] and out["cpu_ms_per_turn"]:
        figures["cpu_ratio_postgresql_vs_sqlite"] = round(
            one["cpu_ms_per_turn"] / out["cpu_ms_per_turn"], 2
        )
    if peers:
        figures["langgraph_sqlite"] = peers["sqlite"]
        figures["langgraph_postgresql"] = peers["postgresql"]
        figures["ratio_sqlite_vs_langgraph"] = _ratio(out, peers["sqlite"])
        figures["ratio_postgresql_vs_langgraph"] = _ratio(one, peers["postgresql"])
        for key in ("ratio_sqlite_vs_langgraph", "ratio_postgresql_vs_langgraph"):
            print(f"{key}: {figures[key]}x")
    if len(counts) > 1:
        one = cases["postgresql_1p"]["turns_per_s"]
        many = cases[f"postgresql_{args.processes}p"]["turns_per_s"]
        figures[f"ratio_{args.processes}p_1p"] = round(many / one, 2) if one else None
        print(f"{args.processes} processes / 1 process: {figures[f'ratio_{args.processes}p_1p']}x")
    print(json.dumps(figures))
    if peers.get("failed") or any(
        c["failed"] or c["succeeded"] < c["turns"] for c in cases.values()
    ):
        raise SystemExit(1)


def budget_cost(args: argparse.Namespace) -> None:
    """``--budget``: each store without and with a budget; the reservation's cost per Turn
    (its store calls, and the difference in wall and CPU time per Turn)."""
    stores: list[tuple[str, str | None]] = [("sqlite", None)]
    if args.store:
        stores.append(("postgresql", args.store))
    figures: dict[str, object] = {}
    failed = False
    for name, url in stores:
        case: dict[str, dict] = {}
        for budget in (False, True):
            if url is not None:
                empty_pg_store(url)
            with tempfile.TemporaryDirectory() as tmp:
                case["with" if budget else "without"] = got = trio.run(
                    functools.partial(
                        run,
                        args.turns,
                        args.agents,
                        args.concurrency,
                        Path(tmp) / "bench.sqlite3",
                        url=url,
                        budget=budget,
                    )
                )
            failed = failed or bool(got["failed"]) or got["succeeded"] < got["turns"]
            report(got, False, f"{name}, {'with' if budget else 'without'} a budget")
        off, on = case["without"], case["with"]
        per_turn = 1000 / max(on["turns_per_s"], 1e-9) - 1000 / max(off["turns_per_s"], 1e-9)
        budget_calls = {
            k: v for k, v in on["store_calls"].items() if k.startswith(("reserve", "settle"))
        }
        figures[name] = {
            "turns_per_s_without": off["turns_per_s"],
            "turns_per_s_with": on["turns_per_s"],
            "ms_per_turn_added": round(per_turn, 3),
            "cpu_ms_per_turn_added": round(on["cpu_ms_per_turn"] - off["cpu_ms_per_turn"], 3),
            "store_calls_per_turn_without": off["store_calls_per_turn"],
            "store_calls_per_turn_with": on["store_calls_per_turn"],
            "budget_calls_per_turn": round(sum(budget_calls.values()) / max(on["succeeded"], 1), 2),
        }
        print(f"{name}: {json.dumps(figures[name])}")
    print(json.dumps({"budget": figures}))
    raise SystemExit(1 if failed else 0)


def fair_share_cost(args: argparse.Namespace) -> None:
    """``--fair-share``: each store with fair share off and on, alternated (off, on, on,
    off: the machine's drift is of the size of the difference), the best run of each
    counting; the cost per Turn and the ratio of Turns/s (on over off)."""
    stores: list[tuple[str, str | None]] = [("sqlite", None)]
    if args.store:
        stores.append(("postgresql", args.store))
    figures: dict[str, object] = {}
    failed = False
    for name, url in stores:
        runs: dict[bool, list[dict]] = {False: [], True: []}
        # ABBA (off, on, on, off): a drift along the run (a first run on a fresh
        # cluster was the fastest of four, every time) weighs on both sides alike.
        for fair in (False, True, True, False):
            if url is not None:
                empty_pg_store(url)
            with tempfile.TemporaryDirectory() as tmp:
                got = trio.run(
                    functools.partial(
                        run,
                        args.turns,
                        args.agents,
                        args.concurrency,
                        Path(tmp) / "bench.sqlite3",
                        url=url,
                        fair_share=fair,
                    )
                )
            runs[fair].append(got)
            failed = failed or bool(got["failed"]) or got["succeeded"] < got["turns"]
            report(got, False, f"{name}, fair share {'on' if fair else 'off'}")
        off = max(runs[False], key=lambda r: r["turns_per_s"])
        on = max(runs[True], key=lambda r: r["turns_per_s"])
        figures[name] = {
            "turns_per_s_off": [r["turns_per_s"] for r in runs[False]],
            "turns_per_s_on": [r["turns_per_s"] for r in runs[True]],
            "ratio_on_vs_off": _ratio(on, off),
            "ms_per_turn_added": round(
                1000 / max(on["turns_per_s"], 1e-9) - 1000 / max(off["turns_per_s"], 1e-9), 3
            ),
            "cpu_ms_per_turn_added": round(on["cpu_ms_per_turn"] - off["cpu_ms_per_turn"], 3),
            "store_calls_per_turn_off": off["store_calls_per_turn"],
            "store_calls_per_turn_on": on["store_calls_per_turn"],
        }
        print(f"{name}: {json.dumps(figures[name])}")
    print(json.dumps({"fair_share": figures}))
    raise SystemExit(1 if failed else 0)


def _ratio(ours: dict, theirs: dict) -> float | None:
    return round(ours["turns_per_s"] / theirs["turns_per_s"], 2) if theirs["turns_per_s"] else None


#: The peer's concurrencies tried (``--peer-concurrency``); its best figure per case counts.
PEER_CONCURRENCY = (16, 64)


def run_peers(args: argparse.Namespace) -> dict:
    """LangGraph on the same Turn (its own process: asyncio), at its best: run at each
    of ``args.peer_concurrency`` Turns in flight, with its default durability (``async``)
    and its SQLite saver in WAL mode; each case's figures are those of its best run
    (``concurrency`` says which; ``runs`` has every run's Turns/s). ``failed`` if any
    answer of any run was wrong, or the peer's script broke."""
    best: dict = {}
    runs: dict[str, dict[int, float]] = {}
    failed = False
    for concurrency in args.peer_concurrency:
        cmd = [
            sys.executable,
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "langgraph_turns.py"),
            "--turns",
            str(args.turns),
            "--concurrency",
            str(concurrency),
        ]
        if args.store:
            empty_pg_store(args.store)
            cmd += ["--store", args.store]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
        lines = done.stdout.strip().splitlines()
        for line in lines[:-1]:
            print(f"{line} (concurrency {concurrency})")
        try:
            peers = json.loads(lines[-1])
        except (IndexError, ValueError):
            raise SystemExit(
                f"the peer bench failed ({done.returncode}): {done.stdout[-600:]}"
            ) from None
        failed = failed or bool(done.returncode)
        for case, figures in peers.items():
            runs.setdefault(case, {})[concurrency] = figures["turns_per_s"]
            if case not in best or figures["turns_per_s"] > best[case]["turns_per_s"]:
                best[case] = {**figures, "concurrency": concurrency}
    for case, figures in best.items():
        figures["runs"] = runs[case]
        figures["durability"] = "async (LangGraph's default)"
        print(
            f"-- LangGraph at its best, {case}: {figures['turns_per_s']} Turns/s at "
            f"concurrency {figures['concurrency']} (all runs: {runs[case]})"
        )
    if failed:
        best["failed"] = True
    return best


def worker(args: argparse.Namespace) -> None:
    """One of N processes: say "ready" once running, start on a line from stdin, print
    the figures as one JSON line."""

    async def gate() -> None:
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)

    async def hold(out: dict) -> None:
        print(json.dumps(out), flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)  # every process is done

    with tempfile.TemporaryDirectory() as tmp:
        trio.run(
            run,
            args.turns,
            args.agents,
            args.concurrency,
            Path(tmp) / "unused.sqlite3",
            False,
            args.store,
            gate,
            hold,
            args.pg_executor,
        )


def processes(args: argparse.Namespace, n: int) -> dict:
    """Run the Turns in ``n`` worker processes on the store ``args.store`` (each sends
    its share); the figures over all of them."""
    shares = [args.turns // n + (1 if i < args.turns % n else 0) for i in range(n)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--store",
                args.store,
                "--turns",
                str(share),
                "--agents",
                str(args.agents),
                "--concurrency",
                str(args.concurrency),
                "--pg-executor",
                args.pg_executor,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for share in shares
    ]
    postmaster = pgcpu.postmaster_pid(args.store)
    try:
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise SystemExit(f"a bench process did not start: {line!r}")
        db0 = pgcpu.server_cpu_s(postmaster)
        tables0 = pg_table_writes(args.store)
        for p in procs:  # every process is running: start them together
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [json.loads(p.stdout.readline()) for p in procs]
        db1 = pgcpu.server_cpu_s(postmaster)
    finally:
        for p in procs:  # stop (or, after an error, end) them all
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
        for p in procs:
            if p.wait(timeout=60) != 0:
                raise SystemExit(f"a bench process failed ({p.returncode})")
    # Read once every process has ended: a backend flushes its counters as it exits.
    writes = pg_writes_between(tables0, pg_table_writes(args.store))
    elapsed = max(o["ended_at"] for o in outs) - min(o["started_at"] for o in outs)
    ok = sum(o["succeeded"] for o in outs)
    done = max(ok + sum(o["failed"] for o in outs), 1)
    counted = all(o["pg_round_trips"] is not None for o in outs)
    steps = sum(o["steps"] for o in outs)
    return {
        "turns": args.turns,
        "agents": args.agents,
        "succeeded": ok,
        "failed": sum(o["failed"] for o in outs),
        "first_failure": next((o["first_failure"] for o in outs if o["first_failure"]), ""),
        "seconds": round(elapsed, 3),
        "turns_per_s": round(ok / elapsed, 1),
        "steps": steps,
        "amortized_step_ms": round(elapsed * 1000 / max(steps, 1), 3),
        "statements_per_turn": round(sum(o["pg_statements"] for o in outs) / done, 1)
        if counted
        else None,
        "round_trips_per_turn": round(sum(o["pg_round_trips"] for o in outs) / done, 1)
        if counted
        else None,
        "cpu_ms_per_turn": round(sum(o["cpu_s"] for o in outs) * 1000 / done, 2),
        # The processes' windows differ a little; the database's is from the start
        # signal to the last answer read here.
        "db_cpu_ms_per_turn": round((db1 - db0) * 1000 / done, 2)
        if db0 is not None and db1 is not None
        else None,
        "store_calls_per_turn": round(sum(sum(o["store_calls"].values()) for o in outs) / ok, 2)
        if ok
        else 0.0,
        "store_calls": dict(
            sum(
                (collections.Counter(o["store_calls"]) for o in outs), start=collections.Counter()
            ).most_common()
        ),
        "pg_per_call": _merge_per_call(o["pg_per_call"] for o in outs),
        **{k: v for k, v in writes.per_turn(done).items() if k != "commits_per_turn"},
    }


def _merge_per_call(parts: Iterable[dict[str, list[int]]]) -> dict[str, list[int]]:
    merged: dict[str, list[int]] = {}
    for part in parts:
        for name, figures in part.items():
            got = merged.setdefault(name, [0, 0, 0])
            for i, v in enumerate(figures):
                got[i] += v
    return merged


def summary(out: dict, count_statements: bool) -> dict:
    keys = [
        "turns_per_s",
        "amortized_step_ms",
        "cpu_ms_per_turn",
        "store_calls_per_turn",
        "succeeded",
        "failed",
    ]
    if count_statements:
        keys.append("statements_per_turn")
    for key in (
        "db_cpu_ms_per_turn",
        "statements_per_turn",
        "round_trips_per_turn",
        "commits_per_turn",
        "rows_written_per_turn",
        "index_entries_written_per_turn",
    ):
        if out.get(key) and key not in keys:  # measured (PostgreSQL, trio executor)
            keys.append(key)
    got = {k: out[k] for k in keys}
    if out.get("pg_per_call"):
        got["round_trips_per_call"] = {
            name: round(trips / n, 2)
            for name, (n, _, trips) in sorted(out["pg_per_call"].items())
            if n and n >= out["turns"] / 4  # the Turn's own calls, not the watchdog's
        }
    return got


def report(out: dict, count_statements: bool, backend: str) -> None:
    print(f"-- store: {backend}")
    print(
        f"{out['succeeded']} of {out['turns']} turns answered ({out['steps']} model steps) "
        f"over {out['agents']} agents in {out['seconds']} s, through the pump"
    )
    print(
        f"{out['turns_per_s']} answered Turns/s (target >= 200), {out['amortized_step_ms']} ms "
        "wall time per model step over all workers (protocol only; target < 5 ms)"
    )
    if out["failed"]:
        print(f"FAILED: {out['failed']} answers were not successful, e.g. {out['first_failure']}")
    done = max(out["succeeded"] + out["failed"], 1)
    per = ", ".join(f"{k} {v / done:.2f}" for k, v in out["store_calls"].items())
    print(f"{out['store_calls_per_turn']} store calls per Turn: {per}")
    if count_statements:
        print(f"{out['statements_per_turn']} SQL statements per Turn")
    line = f"CPU per Turn: {out['cpu_ms_per_turn']} ms in the application"
    if out.get("db_cpu_ms_per_turn") is not None:
        line += f", {out['db_cpu_ms_per_turn']} ms in the database server"
    if out.get("round_trips_per_turn") is not None:
        line += (
            f"; {out['statements_per_turn']} statements and "
            f"{out['round_trips_per_turn']} round trips to it per Turn"
        )
    print(line)
    written = [
        f"{out[key]} {label}"
        for key, label in (
            ("commits_per_turn", "commits"),
            ("rows_written_per_turn", "rows written"),
            ("index_entries_written_per_turn", "index entries written"),
        )
        if out.get(key) is not None
    ]
    if written:
        print("per Turn: " + ", ".join(written))
    by_table = out.get("writes_per_turn_by_table")
    if by_table:
        print(
            "  by statement and table (rows, index entries): "
            + "; ".join(f"{k} {r}, {e}" for k, (r, e) in by_table.items())
        )
    per_call = out.get("pg_per_call")
    if per_call:
        print("per store call (calls per Turn: statements, round trips per call):")
        ranked = sorted(per_call.items(), key=lambda kv: -kv[1][2])
        print(
            "  "
            + "; ".join(
                f"{name} {n / done:.2f}: {st / n:.1f}, {rt / n:.1f}"
                for name, (n, st, rt) in ranked
                if n
            )
        )


if __name__ == "__main__":
    main()
