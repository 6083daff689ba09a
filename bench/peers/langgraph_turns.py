"""The peer: bench/turns.py's Turn on LangGraph, for a ratio measured in the same run.

The same Turn: a task, one tool call (``add(1, 2)``), an answer ("The sum is 3."), on
LangGraph's prebuilt ReAct agent (``create_react_agent``) with an instant scripted chat
model (step 1 calls the tool, step 2 answers with the tool's result) and a checkpointer:
``AsyncSqliteSaver`` on a file (WAL, ``synchronous=NORMAL``), or with ``--store URL``
also ``AsyncPostgresSaver`` on that database (a pool of ``--pool`` connections, as the
agentserver store's). Each Turn its own ``thread_id``; ``--concurrency`` Turns in flight
(default 16, one per agent of bench/turns.py); every answer is checked (a wrong one fails
the run after the JSON line).

Figures per case: Turns/s, the process's CPU per Turn (all its threads: aiosqlite runs
SQLite in one), and with PostgreSQL on this machine the database server's CPU per Turn
(bench/support/pgcpu.py).

Needs the ``peers`` extra (``pip install -e '.[peers]'``).
Usage: python bench/peers/langgraph_turns.py [--turns N] [--concurrency C] [--store URL]
The last line printed is one JSON object: ``{"sqlite": {...}, "postgresql": {...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))  # pgcpu.py

import pgcpu
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.prebuilt import create_react_agent

FINAL = "The sum is 3."


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class InstantModel(BaseChatModel):
    """Calls ``add(1, 2)``, then answers with the sum once the tool's result is in."""

    @property
    def _llm_type(self) -> str:
        return "instant"

    def bind_tools(self, tools: Any, **kwargs: Any) -> InstantModel:
        return self

    def _reply(self, messages: list[BaseMessage]) -> ChatResult:
        last = messages[-1]
        if isinstance(last, ToolMessage):
            text = "The sum is 3." if last.content == "3" else f"unexpected {last.content!r}"
            msg = AIMessage(content=text)
        else:
            msg = AIMessage(
                content="I will ask the calculator.",
                tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": uuid.uuid4().hex}],
            )
        return ChatResult(generations=[ChatGeneration(message=msg)])

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        return self._reply(messages)

    async def _agenerate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        return self._reply(messages)


async def turns(checkpointer: Any, n: int, concurrency: int, postmaster: int | None) -> dict:
    agent = create_react_agent(InstantModel(), [add], checkpointer=checkpointer)
    # One Turn first (outside the clock): imports and first-use caches warm up.
    await agent.ainvoke(
        {"messages": [("user", "warm up")]}, {"configurable": {"thread_id": "warm"}}
    )
    todo = iter(range(n))
    ok = failed = 0
    first_failure = ""

    async def runner() -> None:
        nonlocal ok, failed, first_failure
        for i in todo:
            out = await agent.ainvoke(
                {"messages": [("user", f"task {i}: add 1 and 2")]},
                {"configurable": {"thread_id": f"t{i}-{uuid.uuid4().hex[:8]}"}},
            )
            answer = out["messages"][-1]
            if isinstance(answer, AIMessage) and answer.content == FINAL:
                ok += 1
            else:
                failed += 1
                first_failure = first_failure or repr(answer)[:300]

    db0 = pgcpu.server_cpu_s(postmaster)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(runner() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    db1 = pgcpu.server_cpu_s(postmaster)
    done = max(ok + failed, 1)
    return {
        "turns": n,
        "succeeded": ok,
        "failed": failed,
        "first_failure": first_failure,
        "seconds": round(elapsed, 3),
        "turns_per_s": round(ok / elapsed, 1),
        "cpu_ms_per_turn": round(cpu * 1000 / done, 2),
        "db_cpu_ms_per_turn": round((db1 - db0) * 1000 / done, 2)
        if db0 is not None and db1 is not None
        else None,
    }


async def on_sqlite(n: int, concurrency: int) -> dict:
    import aiosqlite
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    with tempfile.TemporaryDirectory() as tmp:
        async with aiosqlite.connect(Path(tmp) / "langgraph.sqlite3") as conn:
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute("PRAGMA synchronous=NORMAL")
            saver = AsyncSqliteSaver(conn)
            await saver.setup()
            return await turns(saver, n, concurrency, None)


async def on_postgresql(url: str, n: int, concurrency: int, pool: int) -> dict:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    kwargs = {"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}
    async with AsyncConnectionPool(
        url, min_size=pool, max_size=pool, kwargs=kwargs, open=False
    ) as conns:
        await conns.wait()
        saver = AsyncPostgresSaver(conns)
        await saver.setup()
        return await turns(saver, n, concurrency, pgcpu.postmaster_pid(url))


def empty(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--store", metavar="URL", help="also on this PostgreSQL database (emptied)")
    ap.add_argument("--pool", type=int, default=8, help="PostgreSQL connections (default 8)")
    ap.add_argument("--only", choices=("sqlite", "postgresql"), help="run one case only")
    args = ap.parse_args()
    out: dict[str, dict] = {}
    if args.only != "postgresql":
        out["sqlite"] = asyncio.run(on_sqlite(args.turns, args.concurrency))
    if args.store and args.only != "sqlite":
        empty(args.store)
        out["postgresql"] = asyncio.run(
            on_postgresql(args.store, args.turns, args.concurrency, args.pool)
        )
    for name, case in out.items():
        print(
            f"-- LangGraph, {name}: {case['succeeded']} of {case['turns']} turns in "
            f"{case['seconds']} s: {case['turns_per_s']} Turns/s, "
            f"{case['cpu_ms_per_turn']} ms CPU per Turn"
            + (
                f", database {case['db_cpu_ms_per_turn']} ms"
                if case["db_cpu_ms_per_turn"] is not None
                else ""
            )
        )
    print(json.dumps(out))
    if any(c["failed"] or c["succeeded"] < c["turns"] for c in out.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
