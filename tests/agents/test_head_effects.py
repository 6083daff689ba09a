"""The head events' column effects are data (``HEAD_EFFECTS``, agents/store/states.py):
every head transition is driven through the store, and the head row it leaves is checked
against that data; on PostgreSQL the same Turns run twice, through the one-trip
statements (agents/store/pg/one_trip*.py) and through the shared SQL functions
(agents/store/sql/), and both leave the same rows.

Backends: ``sqlite`` always (the shared functions); ``postgresql`` when a server is
reachable (the ``pg_url`` fixture skips otherwise).
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentserver.agents.clock import ManualClock
from agentserver.agents.ports import LLMCompletion, LLMUsage
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import NewCard, TaskStatus, ToolCallRecord, TurnToken
from agentserver.agents.store.served import ServedVersions
from agentserver.agents.store.sql import inbox, tools, turn_end, turns
from agentserver.agents.store.sql_store import SqlAgentStore
from agentserver.agents.store.states import (
    HEAD_EFFECTS,
    HEAD_TRANSITIONS,
    NOW,
    Given,
    HeadEvent,
)

#: The columns read back: every column an event sets, and those the transitions move.
COLUMNS = (
    "status",
    "turn_epoch",
    "step_count",
    "context_tokens",
    "updated_at",
    *sorted({c for effects in HEAD_EFFECTS.values() for c in effects}),
)
#: The walks' agents, versioned and pinned: a Turn's start records its version and pin.
SERVED = ServedVersions(
    versions={a: "v1" for a in ("shared-or-only", "one-trip", "shared")},
    pinned=frozenset({"shared-or-only", "one-trip", "shared"}),
)
#: The columns that hold a moment of the store's clock.
TIMES = ("updated_at", "dispatched_at", "running_since")
#: The hot calls that have a one-trip variant on PostgreSQL.
ONE_TRIP_CALLS = {
    "enqueue_turn",
    "report_tool_result",
    "start_turn_step",
    "suspend",
    "apply_report",
    "finish",
}


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[SqlAgentStore]:
    clock = ManualClock()
    settings = StoreSettings(path=tmp_path / "agents.sqlite3")
    if request.param == "sqlite":
        from agentserver.agents.store.sqlite_store import SqliteAgentStore

        s: SqlAgentStore = SqliteAgentStore.open(
            settings.path, clock=clock, settings=settings, served=SERVED
        )
    else:
        from agentserver.agents.store.pg.store import PostgresAgentStore

        url = request.getfixturevalue("pg_url")  # skips when no server is reachable
        s = PostgresAgentStore.open(url, clock=clock, settings=settings, served=SERVED)
    try:
        yield s
    finally:
        await s.aclose()


def _completion() -> LLMCompletion:
    return LLMCompletion("", LLMUsage(1, 2, 3), 0.0, "m", "b")


class Walk:
    """Drives one agent's Turns through every head transition; after each event, the
    head's row (ids replaced by their order of appearance) and the check of the
    event's effects."""

    def __init__(self, store: SqlAgentStore, agent: str) -> None:
        self.store = store
        self.agent = agent
        self.clock = store.env.clock
        assert isinstance(self.clock, ManualClock)
        self.seen: set[tuple[str, str]] = set()
        self.rows: list[tuple[str, dict[str, Any]]] = []
        self._ids: dict[str, str] = {}

    async def _row(self) -> dict[str, Any]:
        def read(tx: Any, env: Any) -> list[tuple[Any, ...]]:
            return tx.all(
                f"SELECT {', '.join(COLUMNS)} FROM agent_state_head WHERE agent_id = ?",
                (self.agent,),
            )

        [row] = await self.store.read(read)
        return dict(zip(COLUMNS, row, strict=True))

    async def before(self, event: HeadEvent) -> None:
        """Record the transition ``event`` is about to take; move the clock on, so the
        event's ``now`` is its own."""
        self.seen.add((str((await self._row())["status"]), str(event)))
        self.clock.advance(1.0)

    async def after(self, label: str, event: HeadEvent) -> None:
        """The head as ``event`` left it: its effects as the data says, kept for the
        comparison of the two paths."""
        row = await self._row()
        transition = HEAD_TRANSITIONS[next(k for k in HEAD_TRANSITIONS if k[1] == event)]
        assert row["status"] == transition.target, label
        for column, value in HEAD_EFFECTS[event].items():
            if value == NOW:
                assert row[column] == self.clock.now(), (label, column)
            elif isinstance(value, Given):
                assert row[column] is not None, (label, column)
            else:
                assert row[column] == value, (label, column)
        self.rows.append((label, {c: self._named(v) for c, v in row.items()}))

    def _named(self, value: Any) -> Any:
        if isinstance(value, str) and len(value) >= 32:
            return self._ids.setdefault(value, f"id{len(self._ids)}")
        return value

    # -- the Turns -------------------------------------------------------------------

    async def lease(self, text: str) -> None:
        await self.before(HeadEvent.LEASE)
        got = await self.store.run(
            inbox.enqueue_turn, self.agent, text.encode(), {"caller_thread": text}
        )
        assert got.leased
        await self.after(f"lease {text}", HeadEvent.LEASE)

    async def start(self) -> tuple[TurnToken, str]:
        [row] = await self.store.run1(inbox.claim_due, self.agent, 5)
        await self.before(HeadEvent.START)
        step = await self.store.run(turns.start_turn_step, row, 8)
        await self.after("start", HeadEvent.START)
        assert step.step_id is not None and step.head.token is not None
        return step.head.token, step.step_id

    async def suspend(self, token: TurnToken, step_id: str, call: str) -> None:
        await self.before(HeadEvent.SUSPEND)
        calls = [ToolCallRecord(call, "calc", "<add/>")]
        await self.store.run(
            tools.suspend, token, step_id, calls, [NewCard("sys.note", "calling")], 1e12
        )
        await self.after("suspend", HeadEvent.SUSPEND)

    async def force_end(self, label: str) -> None:
        await self.before(HeadEvent.FORCE_END)
        ended = await self.store.run(
            turn_end.force_end, self.agent, TaskStatus.STOPPED, "stopped", b"<s/>"
        )
        assert ended is not None
        await self.after(f"force_end {label}", HeadEvent.FORCE_END)

    async def run(self) -> None:
        s, a = self.store, self.agent
        await s.run(inbox.ensure_agents, [a])
        # T1: lease, start, suspend, resume, then its finish leases the queued T2.
        await self.lease("t1")
        token, step_id = await self.start()
        await self.suspend(token, step_id, f"{a}-call-1")
        await s.run(inbox.report_tool_result, a, f"{a}-call-1", b"<sum>1</sum>", failed=False)
        [row] = await s.run1(inbox.claim_due, a, 5)
        await self.before(HeadEvent.RESUME)
        outcome = await s.run(tools.apply_report, row, then_step=8)
        await self.after("resume", HeadEvent.RESUME)
        assert outcome.resumed is not None and outcome.step is not None
        assert not (await s.run(inbox.enqueue_turn, a, b"t2", {"caller_thread": "t2"})).leased
        await self.before(HeadEvent.FINISH)
        fin = await s.run(
            turn_end.finish,
            outcome.resumed,
            TaskStatus.SUCCEEDED,
            "done",
            {},
            b"<a/>",
            step_id=outcome.step.step_id,
            completion=_completion(),
            cards=[NewCard("sys.note", "last")],
        )
        assert fin.next_leased
        await self.after("finish, the next Turn leased", HeadEvent.LEASE)
        # T2 ends while dispatched.
        await self.force_end("dispatched")
        # T3 finishes with nothing queued.
        await self.lease("t3")
        token, step_id = await self.start()
        await self.before(HeadEvent.FINISH)
        await s.run(
            turn_end.finish,
            token,
            TaskStatus.SUCCEEDED,
            "done",
            {},
            b"<a/>",
            step_id=step_id,
            completion=None,
        )
        await self.after("finish", HeadEvent.FINISH)
        # T4 ends while running; T5 while suspended.
        await self.lease("t4")
        await self.start()
        await self.force_end("running")
        await self.lease("t5")
        token, step_id = await self.start()
        await self.suspend(token, step_id, f"{a}-call-5")
        await self.force_end("suspended")
        # T6 is recovered (its worker is gone), then ended.
        await self.lease("t6")
        await self.start()
        await self.before(HeadEvent.RECOVER)
        assert len(await s.recover_running()) == 1
        await self.after("recover", HeadEvent.RECOVER)
        await self.force_end("recovered")


async def test_every_head_transition_writes_its_declared_effects(store: SqlAgentStore) -> None:
    walk = Walk(store, "shared-or-only")
    await walk.run()
    assert walk.seen == {(str(s), str(e)) for s, e in HEAD_TRANSITIONS}


async def test_one_trip_statements_and_shared_functions_leave_the_same_rows(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same Turns through PostgreSQL's one-trip variants (checked to have run, none
    missed) and through the shared functions alone: the same head rows, event by event."""
    from agentserver.agents.store.pg import store as pg_store

    settings = StoreSettings(url=pg_url)
    s = pg_store.PostgresAgentStore.open(
        pg_url, clock=ManualClock(), settings=settings, served=SERVED
    )
    try:
        calls: collections.Counter[tuple[str, str]] = collections.Counter()

        def on_call(fn: Any, args: tuple, statements: int, trips: int) -> None:
            if fn.__name__ == "_notifying":
                fn = args[2]
            calls[fn.__module__.rsplit(".", 1)[-1], fn.__name__] += 1

        s.executor.on_call = on_call
        fast = Walk(s, "one-trip")
        await fast.run()
        shared_calls = {name for (module, name) in calls if not module.startswith("one_trip")}
        assert not shared_calls & ONE_TRIP_CALLS, calls  # no miss fell back to them
        assert {name for (module, name) in calls if module.startswith("one_trip")} == (
            ONE_TRIP_CALLS
        )
        monkeypatch.setattr(pg_store, "ONE_TRIP", {})
        calls.clear()
        slow = Walk(s, "shared")
        await slow.run()
        assert not any(module.startswith("one_trip") for module, _ in calls)
    finally:
        await s.aclose()
    assert fast.seen == slow.seen == {(str(st), str(e)) for st, e in HEAD_TRANSITIONS}
    # The second walk's clock starts where the first's stopped: times are compared
    # from each walk's first event.
    base_fast = fast.rows[0][1]["updated_at"]
    base_slow = slow.rows[0][1]["updated_at"]

    def relative(rows: list[tuple[str, dict[str, Any]]], base: float) -> list[Any]:
        return [
            (label, {c: v - base if c in TIMES and v is not None else v for c, v in r.items()})
            for label, r in rows
        ]

    assert relative(fast.rows, base_fast) == relative(slow.rows, base_slow)
