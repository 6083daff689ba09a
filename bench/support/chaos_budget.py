"""The chaos bench's budget part (issues 37 and 43): an organism ``<budget>`` every model
call reserves in (too large to refuse), and with ``--budget-tokens N`` a small
``period="total"`` budget of N tokens on each client of :data:`BUDGET_CLIENTS`, which runs
out under the faults; the worst case of every request the model saw; and the check after
the drain (:func:`check_budgets`): no budget spent beyond its limit plus one call's worst
case, and no step written without its spend (issue 48: a model call's spend commits with
its step's results, so the organism's spend is at least what the completed steps the
store still holds report), each a violation. Holds still there after the drain (and up to 30 s more) are counted,
not a violation by themselves: a killed server's holds may make a budget refuse sooner,
and the promise the clients see is that every refused task is answered once (the
checker's rule for every task; :func:`refusal_violations` adds that a "budget exhausted"
answer names a budget its task pays into).

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


#: The clients with a small budget under ``--budget-tokens`` (one with acks, one without,
#: and the A2A, MCP and AG-UI clients): their tasks are refused once it is spent; the
#: others' never are.
BUDGET_CLIENTS = ("c1", "c2", "a2a", "mcp", "agui")


def budget_element(tokens: int) -> str:
    """A ``<budget>`` of ``tokens`` for boot.xml (the organism's, or inside a client)."""
    return f'<budget tokens="{tokens}" period="total"/>'


def client_budget(name: str, tokens: int | None) -> str:
    """The ``<budget>`` inside client ``name``'s element ("" without one)."""
    if tokens is None or name not in BUDGET_CLIENTS:
        return ""
    return budget_element(tokens)


def refusal_violations(
    refused: list[tuple[str, str, str]], tokens: int | None
) -> tuple[dict[str, object], list[str]]:
    """``refused``: (client, thread, text) of every task answered "budget exhausted". Each
    must name ``client:CLIENT`` of its own client, one of :data:`BUDGET_CLIENTS` (the
    organism's budget is too large to run out)."""
    violations = []
    for client, thread, text in refused:
        if tokens is None or client not in BUDGET_CLIENTS or f"client:{client}" not in text:
            violations.append(f"budget refusal to {client} on {thread}: {text[:200]}")
    by_client: dict[str, int] = {}
    for client, _, _ in refused:
        by_client[client] = by_client.get(client, 0) + 1
    return {"budget_refused_tasks": len(refused), "budget_refused_by_client": by_client}, violations


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


#: The tokens the completed steps still in the store report (each step's reply is
#: written with its call's spend; retention only ever lowers this).
STEPS_USED = (
    "SELECT COALESCE(SUM(total_tokens), 0) FROM agent_steps WHERE status = 'completed'"
    " AND total_tokens IS NOT NULL"
)


def _rows(sqlite_path: pathlib.Path | None, pg_url: str | None) -> tuple[list[tuple], int, int]:
    """The spend rows, the holds left and :data:`STEPS_USED`, from either store."""

    def read(conn: Any) -> tuple[list[tuple], int, int]:
        spend = (
            "SELECT budget, limit_tokens, spent_tokens, reserved_tokens, refusals FROM budget_spend"
        )
        holds = "SELECT count(*) FROM budget_holds"
        return (
            conn.execute(spend).fetchall(),
            conn.execute(holds).fetchone()[0],
            int(conn.execute(STEPS_USED).fetchone()[0]),
        )

    if pg_url is not None:
        import psycopg

        with psycopg.connect(pg_url, connect_timeout=10) as conn:
            return read(conn)
    if sqlite_path is None or not sqlite_path.exists():
        return [], 0, 0
    conn = sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True, timeout=30)
    try:
        return read(conn)
    finally:
        conn.close()


def unspent_steps(rows: list[tuple], steps_used: int) -> list[str]:
    """A violation when the organism's spend (every call pays into it) is below what the
    completed steps report: some step's reply was written without its call's spend."""
    spent = sum(int(r[2]) for r in rows if r[0] == "organism")
    if rows and spent < steps_used:
        return [f"steps written without their spend: organism spent {spent} < {steps_used}"]
    return []


async def check_budgets(
    sqlite_path: pathlib.Path | None, pg_url: str | None, worst: WorstCase, wait_s: float = 30.0
) -> tuple[dict[str, object], list[str]]:
    """Counts and violations. Waits up to ``wait_s`` for the holds to be released (a
    server killed near the end: its holds expire after llm-timeout + 10 s)."""
    deadline = trio.current_time() + wait_s
    while True:
        rows, holds, steps_used = await trio.to_thread.run_sync(_rows, sqlite_path, pg_url)
        if (holds == 0 and all(r[3] == 0 for r in rows)) or trio.current_time() > deadline:
            break
        await trio.sleep(1.0)
    violations = unspent_steps(rows, steps_used)
    for budget, limit, spent, _reserved, _ in rows:
        if limit is not None and spent > limit + worst.largest:
            violations.append(
                f"budget {budget} overspent: {spent} > {limit} + one worst case {worst.largest}"
            )
    small = [r for r in rows if r[0] != "organism"]
    counts = {
        "budget_spent_tokens": sum(int(r[2]) for r in rows),
        "budget_refusals": sum(int(r[4]) for r in rows),
        "budget_worst_case": worst.largest,
        # Per small budget: [limit, spent, refusals] (spent may pass the limit by one
        # worst case at most).
        "budget_spend": {str(r[0]): [r[1], int(r[2]), int(r[4])] for r in small},
        "budget_reserved_left": sum(int(r[3]) for r in rows),
        "budget_holds_left": int(holds),
        "budget_steps_tokens": steps_used,
    }
    return counts, violations
