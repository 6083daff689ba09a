"""Issue 48: PostgreSQL's one-trip forms (agents/store/pg/one_trip*.py) write what the shared
functions write, for every transition they stand for. One Turn walks every entry of
``ONE_TRIP`` (a spend budget settled with its steps included); the same walk with
``ONE_TRIP`` emptied runs the shared functions only; every row either writes is compared,
ids and times left out. The walk must take each one-trip form at least once without a
miss, so an entry added to ``ONE_TRIP`` and not walked here fails this test."""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from agentserver.agents.ports import LLMCompletion, LLMUsage
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import CardType, NewCard, ToolCallRecord, TurnToken
from agentserver.agents.store.governance import DecisionRecord, StepRecord
from agentserver.agents.store.pg import store as pg_store
from agentserver.agents.store.pg.store import PostgresAgentStore
from agentserver.agents.store.sql import budgets as sql_budgets
from agentserver.agents.store.sql import governance, inbox, tools, turn_end, turns
from agentserver.agents.store.sql.budgets import HoldOwner, PeriodRow, Spend, row_key

pytestmark = pytest.mark.postgresql


def _sql(url: str, query: str, *args: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        cur = conn.execute(query, args)
        return cur.fetchall() if cur.description is not None else []


def _completion(text: str) -> LLMCompletion:
    return LLMCompletion(text, LLMUsage(10, 20, 30), 0.001, "m", "b")


async def _spend(store: PostgresAgentStore, agent: str, token: TurnToken, step: str) -> Spend:
    """A hold of ``agent``'s budget for a call of ``step``, as the call would have taken
    it, and what settling it writes (30 tokens spent)."""
    key = row_key(f"agent:{agent}", 0.0)
    hold = f"{agent}-hold-{step}"
    owner = HoldOwner(agent, token.agent_turn_id, token.turn_epoch, step)
    assert await store.run(sql_budgets.reserve, [key], 100, 0.01, hold, 1e12, owner)
    return Spend(hold, (key,), 30, 0.001)


async def _walk(store: PostgresAgentStore, agent: str) -> list[object]:
    """A Turn through every one-trip transition: enqueue, start, complete (plain and
    screened), suspend (with its step, governance's record and a spend), a report kept in
    the inbox then applied from it, one applied as it is recorded, and the finish with
    its last step and spend."""
    budget = f"agent:{agent}"
    await store.run(
        sql_budgets.ensure_rows, [PeriodRow(budget, "total", 0.0, math.inf, 10_000, None, 0.005)]
    )
    await store.run(inbox.ensure_agents, [agent])
    out: list[object] = []
    out.append((await store.run(inbox.enqueue_turn, agent, b"<task>x</task>", {"ref": 1})).leased)
    [row] = await store.run1(inbox.claim_due, agent, 5)
    start = await store.run(turns.start_turn_step, row, 8)
    token = start.head.token
    assert token is not None and start.step_id is not None
    spend = await _spend(store, agent, token, start.step_id)
    await store.run(
        turns.complete_step,
        token,
        start.step_id,
        _completion("thinking"),
        [NewCard(CardType.LLM_MESSAGE, "thinking")],
        None,
        [spend],
    )
    out.append([r.budget for r in spend.crossed])
    step = await store.run(turns.open_step, token, 8)
    assert step.step_id is not None
    spend = await _spend(store, agent, token, step.step_id)
    decision = DecisionRecord("calc", "add", "allow", "r1", "fine")
    refusal = NewCard(CardType.TOOL_REFUSED, "refused", {"to": "x", "rule": "deny"})
    calls = [ToolCallRecord(f"{agent}-t{i}", "calc", "<add/>") for i in (1, 2)]
    out.append(
        await store.run(
            tools.suspend,
            token,
            step.step_id,
            calls,
            [NewCard(CardType.HUH, "<huh/>")],
            1e12,
            _completion("calling"),
            [NewCard(CardType.LLM_MESSAGE, "calling")],
            StepRecord((decision,), (refusal,)),
            [spend],
        )
    )
    # The first report kept in the inbox (the path of a report its Turn's worker
    # claims), then applied from its row; the second applied as it is recorded.
    await store.run(inbox.report_tool_result, agent, f"{agent}-t1", b"<sum>1</sum>", False)
    [report] = await store.run1(inbox.claim_due, agent, 5)
    first = await store.run(tools.apply_report, report, 8)
    out.append((first.kind, first.resumed is not None))
    second = await store.run(tools.apply_tool_result, agent, f"{agent}-t2", b"<e/>", True, 8)
    assert second.resumed is not None and second.step is not None
    assert second.step.step_id is not None
    out.append((second.kind, second.step.step_no))
    token = second.resumed
    await store.run(
        governance.complete_screened_step,
        token,
        second.step.step_id,
        _completion("judged"),
        [NewCard(CardType.LLM_MESSAGE, "judged")],
        StepRecord((decision,), (refusal,)),
    )
    last = await store.run(turns.open_step, token, 8)
    assert last.step_id is not None
    spend = await _spend(store, agent, token, last.step_id)
    fin = await store.run(
        turn_end.finish,
        token,
        "succeeded",
        "done",
        {"k": 1},
        b"<answer/>",
        last.step_id,
        _completion("done"),
        [NewCard(CardType.LLM_MESSAGE, "done")],
        (),
        [spend],
    )
    out.append((fin.status, fin.reply is not None))
    return out


def _rows_of(url: str, agent: str) -> dict[str, object]:
    """What the walk of ``agent`` wrote, ids and times left out (the agent's name too)."""
    queries = {
        "head": "SELECT status, turn_epoch, step_count, waiting_tool_count, context_tokens "
        "FROM agent_state_head WHERE agent_id = %s",
        "cards": "SELECT c.card_type, c.content, c.metadata, c.tokens FROM cards c "
        "JOIN agent_steps s ON s.agent_turn_id = c.agent_turn_id WHERE s.agent_id = %s "
        "AND s.step_no = 1 ORDER BY c.seq",
        "steps": "SELECT step_no, status, total_tokens, metadata, tool_call_ids FROM agent_steps "
        "WHERE agent_id = %s ORDER BY step_no",
        "waiting": "SELECT tool_call_id, status, to_listener, after_execution FROM "
        "turn_waiting_tools WHERE agent_id = %s ORDER BY tool_call_id",
        "decisions": "SELECT target, decision, rule FROM policy_decisions WHERE agent_id = %s "
        "ORDER BY target, decision, rule",
        "inbox": "SELECT message_type, status, correlation_id FROM agent_inbox "
        "WHERE agent_id = %s ORDER BY created_at",
        "edges": "SELECT primitive, edge_phase, metadata FROM execution_edges "
        "WHERE agent_id = %s ORDER BY created_at, primitive",
        "replies": "SELECT payload, failed, status FROM agent_replies WHERE agent_id = %s",
        "budget": "SELECT spent_tokens, spent_cost, reserved_tokens, reserved_cost, "
        "soft_at IS NOT NULL FROM budget_spend WHERE budget = 'agent:' || %s",
        "holds": "SELECT count(*) FROM budget_holds WHERE agent_id = %s",
    }
    out: dict[str, object] = {}
    for name, query in queries.items():
        rows = _sql(url, query, agent)
        text = json.dumps(rows, default=str).replace(f"{agent}-", "X-")
        out[name] = json.loads(_ID.sub("<id>", text))
    return out


#: A row id (uuid4().hex) or a Turn's thread id: each walk draws its own.
_ID = re.compile(
    r"\b[0-9a-f]{32}\b|\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"
)


def _counting(name: str, fn: Callable[..., Any], taken: set[str]) -> Callable[..., Any]:
    """``fn``, noting ``name`` in ``taken`` each time it returns (a miss raises)."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        result = fn(*args)
        taken.add(name)
        return result

    return run


async def test_every_one_trip_form_writes_what_its_shared_function_does(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: set[str] = set()
    forms = dict(pg_store.ONE_TRIP)
    names = {fn: f"{fn.__module__}.{fn.__name__}" for fn in forms}
    store = PostgresAgentStore.open(pg_url, settings=StoreSettings(url=pg_url))
    try:
        monkeypatch.setattr(
            pg_store,
            "ONE_TRIP",
            {fn: _counting(names[fn], form, taken) for fn, form in forms.items()},
        )
        fast = await _walk(store, "a")
        monkeypatch.setattr(pg_store, "ONE_TRIP", {})
        shared = await _walk(store, "b")
    finally:
        await store.aclose()
    assert taken == set(names.values()), sorted(set(names.values()) - taken)
    assert fast == shared
    a, b = _rows_of(pg_url, "a"), _rows_of(pg_url, "b")
    for table in a:
        assert a[table] == b[table], table
    # the spends were settled with their steps: three calls of 30 tokens, nothing held
    assert a["budget"] == [[90, 0.003, 0, 0.0, True]] and a["holds"] == [[0]]


def test_every_one_trip_form_takes_what_its_shared_function_takes() -> None:
    """The store passes a call's arguments to either by position, defaults filled in
    (agents/store/pg/store.py ``_positions``), so each form takes its shared function's
    parameters, in order, after the NOTIFY channel."""
    for fn, form in pg_store.ONE_TRIP.items():
        shared = list(inspect.signature(fn).parameters)[2:]
        fast = list(inspect.signature(form).parameters)[3:]
        assert fast == shared, (fn.__name__, fast, shared)
