"""The peer of bench/store_growth.py: one LangGraph conversation, its checkpointer's size.

bench/peers/langgraph_turns.py's Turn (a task, one ``add(1, 2)`` tool call, the answer, on
``create_react_agent`` with an instant scripted model), ``--turns`` times on ONE
``thread_id``: a conversation, whose state (every message so far) LangGraph checkpoints
at every step. LangGraph's prebuilt agent has no compaction; the state grows with the
conversation. Sizes after the Turns of ``--marks``: ``AsyncSqliteSaver``'s file plus WAL
after a ``TRUNCATE`` checkpoint; with ``--store URL`` also ``AsyncPostgresSaver``'s tables
(``pg_total_relation_size``, summed; the database is emptied first).

Needs the ``peers`` extra. Usage: python bench/peers/langgraph_growth.py [--turns N]
[--marks 10,100,1000] [--store URL]. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))  # pgcpu.py
from langgraph.prebuilt import create_react_agent
from langgraph_turns import FINAL, InstantModel, add, empty


async def conversation(saver: Any, n: int, marks: list[int], size: Any) -> dict[str, Any]:
    agent = create_react_agent(InstantModel(), [add], checkpointer=saver)
    config = {"configurable": {"thread_id": "conversation"}}
    out: dict[str, Any] = {"turns": n, "marks": {}}
    failed = 0
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        got = await agent.ainvoke({"messages": [("user", f"task {i}: add 1 and 2")]}, config)
        if got["messages"][-1].content != FINAL:
            failed += 1
        if i in marks:
            total, tables = await size()
            out["marks"][str(i)] = {"bytes": total, "bytes_per_turn": round(total / i)}
            out["tables"] = {k: round(v / i) for k, v in tables.items()}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["failed"] = failed
    return out


async def on_sqlite(n: int, marks: list[int]) -> dict[str, Any]:
    import aiosqlite
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "langgraph.sqlite3"
        async with aiosqlite.connect(path) as conn:
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute("PRAGMA synchronous=NORMAL")
            saver = AsyncSqliteSaver(conn)
            await saver.setup()

            async def size() -> tuple[int, dict[str, int]]:
                await conn.commit()
                db = sqlite3.connect(path, isolation_level=None)
                try:
                    db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                    rows = db.execute(
                        "SELECT coalesce(m.tbl_name, d.name), sum(d.pgsize) FROM dbstat d "
                        "LEFT JOIN sqlite_master m ON m.name = d.name GROUP BY 1"
                    ).fetchall()
                finally:
                    db.close()
                wal = path.with_name(path.name + "-wal")
                total = path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
                return total, {str(k): int(v) for k, v in rows if v}

            return await conversation(saver, n, marks, size)


async def on_postgresql(url: str, n: int, marks: list[int]) -> dict[str, Any]:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg import AsyncConnection
    from psycopg.rows import dict_row

    async with await AsyncConnection.connect(
        url, autocommit=True, prepare_threshold=0, row_factory=dict_row
    ) as conn:
        saver = AsyncPostgresSaver(conn)
        await saver.setup()

        async def size() -> tuple[int, dict[str, int]]:
            rows = await (
                await conn.execute(
                    "SELECT tablename AS t, pg_total_relation_size(tablename::regclass) AS b "
                    "FROM pg_tables WHERE schemaname = 'public'"
                )
            ).fetchall()
            tables = {r["t"]: int(r["b"]) for r in rows}
            return sum(tables.values()), tables

        return await conversation(saver, n, marks, size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=1000)
    ap.add_argument("--marks", default="10,100,1000")
    ap.add_argument("--store", metavar="URL", help="also on this PostgreSQL database (emptied)")
    args = ap.parse_args()
    marks = [int(m) for m in args.marks.split(",") if m]
    out: dict[str, Any] = {"sqlite": asyncio.run(on_sqlite(args.turns, marks))}
    if args.store:
        empty(args.store)
        out["postgresql"] = asyncio.run(on_postgresql(args.store, args.turns, marks))
    for name, case in out.items():
        marks_text = ", ".join(
            f"Turn {k}: {v['bytes_per_turn']} B/Turn" for k, v in case["marks"].items()
        )
        print(f"-- LangGraph, {name}: {marks_text} ({case['seconds']} s)")
    print(json.dumps(out))
    if any(c["failed"] for c in out.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
