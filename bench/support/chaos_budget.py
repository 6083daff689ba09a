"""The chaos bench's budget part (issue 37): an organism ``<budget>`` every model call
reserves in (``--budget-tokens``; small enough, it refuses tasks under the faults), the
worst case of every request the model saw, and the check after the drain: no budget spent
beyond its limit plus one call's worst case, nothing left reserved, no hold leaked (a
killed server's holds released by a watchdog once they expire).

A library module of bench/chaos.py (not a bench)."""

from __future__ import annotations

import pathlib
import sqlite3
from collections.abc import Callable
from typing import Any

import trio

from agentserver.llm.tokens import PER_MESSAGE, PER_REQUEST, estimate_text_tokens

#: The default budget: large enough never to refuse in a few minutes, so the run checks
#: the reservations under the faults without failing tasks for it.
DEFAULT_TOKENS = 10**9
#: The agents' max_tokens (none declared: the default).
MAX_TOKENS = 1024


def budget_element(tokens: int) -> str:
    """The organism's ``<budget>`` for boot.xml."""
    return f'<budget tokens="{tokens}" period="total"/>'


class WorstCase:
    """The largest worst case (counted prompt + max_tokens) of any request seen."""

    def __init__(self) -> None:
        self.largest = 0

    def watch(self, decide: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
        """``decide`` (the chaos model's) recording each request's worst case first."""

        def decide_watched(body: dict[str, Any]) -> Any:
            messages = body.get("messages") or []
            prompt = PER_REQUEST + sum(
                PER_MESSAGE + estimate_text_tokens(str(m.get("content", ""))) for m in messages
            )
            self.largest = max(self.largest, prompt + int(body.get("max_tokens") or MAX_TOKENS))
            return decide(body)

        return decide_watched


def _rows(sqlite_path: pathlib.Path | None, pg_url: str | None) -> tuple[list[tuple], int]:
    spend = "SELECT budget, limit_tokens, spent_tokens, reserved_tokens, refusals FROM budget_spend"
    holds = "SELECT count(*) FROM budget_holds"
    if pg_url is not None:
        import psycopg

        with psycopg.connect(pg_url, connect_timeout=10) as conn:
            return conn.execute(spend).fetchall(), conn.execute(holds).fetchone()[0]
    if sqlite_path is None or not sqlite_path.exists():
        return [], 0
    conn = sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True, timeout=30)
    try:
        return conn.execute(spend).fetchall(), conn.execute(holds).fetchone()[0]
    finally:
        conn.close()


async def check_budgets(
    sqlite_path: pathlib.Path | None, pg_url: str | None, worst: WorstCase, wait_s: float = 30.0
) -> tuple[dict[str, object], list[str]]:
    """Counts and violations. Waits up to ``wait_s`` for the holds to be released (a
    server killed near the end: its holds expire after llm-timeout + 10 s)."""
    deadline = trio.current_time() + wait_s
    while True:
        rows, holds = await trio.to_thread.run_sync(_rows, sqlite_path, pg_url)
        if (holds == 0 and all(r[3] == 0 for r in rows)) or trio.current_time() > deadline:
            break
        await trio.sleep(1.0)
    violations = []
    for budget, limit, spent, reserved, _ in rows:
        if limit is not None and spent > limit + worst.largest:
            violations.append(
                f"budget {budget} overspent: {spent} > {limit} + one worst case {worst.largest}"
            )
        if reserved:
            violations.append(f"budget {budget}: {reserved} tokens still reserved after the drain")
    if holds:
        violations.append(f"{holds} budget holds leaked after the drain")
    counts = {
        "budget_spent_tokens": sum(int(r[2]) for r in rows),
        "budget_refusals": sum(int(r[4]) for r in rows),
        "budget_worst_case": worst.largest,
    }
    return counts, violations
