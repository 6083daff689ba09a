"""Property: a stale writer never changes anything in the agent store.

Two workers share one real SQLite store file and act in any order hypothesis chooses:
each learns a Turn (by reading the head, by starting a claimed Turn, or by resuming it
with a tool result) and later writes with what it learned, possibly after the other
worker, a watchdog or a restart moved the Turn on. Every fenced write is checked against
the whole database: if the writer's token no longer names the head's Turn and epoch, the
write must be refused (``StaleTurn``, or ``None`` from ``force_end``) and every table must
be byte for byte what it was. A refused write by a current holder must leave nothing
either (one transaction: all or nothing).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from agentserver.agents.clock import ManualClock
from agentserver.agents.errors import StaleTurn
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import NewCard, ToolCallRecord, TurnToken
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.sql import inbox, tools, turn_end, turns
from agentserver.agents.store.sqlite_store import SqliteAgentStore
from agentserver.agents.store.states import HeadStatus, MessageType

AGENT = "assistant"
WORKERS = st.sampled_from([0, 1])


def _run(call: Callable[[], Awaitable[Any]]) -> Any:
    # The SQLite store runs its transactions inline; trio only drives the coroutine.
    return trio.run(call)


def _snapshot(store: SqliteAgentStore) -> dict[str, list[tuple]]:
    db = store._db
    tables = [
        r[0]
        for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
        ).fetchall()
    ]
    return {t: db.execute(f"SELECT * FROM {t} ORDER BY rowid").fetchall() for t in tables}


def store_machine(
    directories: Callable[[], Any], stale_refusals: list[int]
) -> type[RuleBasedStateMachine]:
    """The machine class; ``stale_refusals[0]`` counts stale writes refused (so the test
    can tell that stale writers were really exercised)."""

    class TwoWorkers(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.clock = ManualClock()
            path = directories() / "agents.sqlite3"
            self.store = SqliteAgentStore.open(
                path, clock=self.clock, settings=StoreSettings(path=path, max_retries=2)
            )
            self.tokens: list[TurnToken | None] = [None, None]
            self.rows: list[list] = [[], []]
            self.calls: list[str] = []
            self.ids = itertools.count()

        def teardown(self) -> None:
            self.store.close()

        # -- what the workers learn ------------------------------------------------------

        def _head(self):
            return _run(lambda: self.store.read(sql_head.read, AGENT))

        def _current(self, token: TurnToken | None) -> bool:
            head = self._head()
            return (
                token is not None
                and head.agent_turn_id == token.agent_turn_id
                and head.turn_epoch == token.turn_epoch
            )

        @initialize()
        def first_tasks(self) -> None:
            for _ in range(2):
                self.enqueue()

        @rule()
        def enqueue(self) -> None:
            _run(
                lambda: self.store.run(inbox.enqueue_turn, AGENT, b"<task/>", {"n": next(self.ids)})
            )

        @rule(w=WORKERS)
        def read_head(self, w: int) -> None:
            self.tokens[w] = self._head().token

        @rule(w=WORKERS)
        def claim(self, w: int) -> None:
            self.rows[w] += _run(lambda: self.store.run1(inbox.claim_due, AGENT, 4))

        @rule(w=WORKERS)
        def work(self, w: int) -> None:
            """Claim what is due and handle all of it at once (the short path)."""
            self.claim(w)
            while self.rows[w]:
                self._handle(w, self.rows[w].pop(0))

        @rule(w=WORKERS, data=st.data())
        def handle_one_claimed_row(self, w: int, data: st.DataObject) -> None:
            """Handle a row claimed earlier, maybe before the Turn moved on."""
            if self.rows[w]:
                self._handle(w, self.rows[w].pop(data.draw(st.integers(0, len(self.rows[w]) - 1))))

        def _handle(self, w: int, row) -> None:
            if row.message_type == MessageType.TURN:
                stale = not self._current(row.token)
                ok, token = self._fenced(
                    lambda: self.store.run(turns.start_turn, row), row.token, stale
                )
                if ok:
                    self.tokens[w] = token
            elif row.message_type == MessageType.RESUME:
                stale = not self._current(row.token)
                before = _snapshot(self.store)
                token = _run(lambda: self.store.run(turns.take_resume, row))
                if token is None:
                    # Refused: only the row itself is acknowledged (skipped).
                    after = _snapshot(self.store)
                    assert _changed_tables(before, after) <= {"agent_inbox"}
                else:
                    assert not stale
                    self.tokens[w] = token
            else:
                outcome = _run(lambda: self.store.run(tools.apply_report, row))
                if outcome.resumed is not None:
                    self.tokens[w] = outcome.resumed

        @precondition(lambda self: self.calls)
        @rule(data=st.data())
        def a_tool_answers(self, data: st.DataObject) -> None:
            call = data.draw(st.sampled_from(self.calls))
            _run(
                lambda: self.store.run(inbox.report_tool_result, AGENT, call, b"<r/>", failed=False)
            )

        @rule()
        def watchdog_force_ends(self) -> None:
            _run(lambda: self.store.run(turn_end.force_end, AGENT, "failed", "watchdog", b"<f/>"))

        @rule()
        def restart(self) -> None:
            # Workers die with the process; their tokens and claimed rows are now stale.
            _run(self.store.recover_running)

        @rule()
        def time_passes(self) -> None:
            self.clock.advance(5)

        # -- fenced writes with whatever a worker holds -------------------------------------

        def _fenced(
            self, write: Callable[[], Awaitable[Any]], token: TurnToken | None, stale: bool
        ) -> tuple[bool, Any]:
            """Run a fenced write; (accepted, its result). A stale one must be refused
            with nothing changed."""
            before = _snapshot(self.store)
            try:
                result = _run(write)
            except StaleTurn:
                assert _snapshot(self.store) == before, "a refused write changed the store"
                stale_refusals[0] += stale
                return False, None
            assert not stale, f"stale token {token} was accepted (head: {self._head()})"
            return True, result

        @precondition(lambda self: any(self.tokens))
        @rule(w=WORKERS)
        def begin_step(self, w: int) -> None:
            token = self.tokens[w]
            if token is not None:
                stale = not self._current(token)
                self._fenced(lambda: self.store.run(turns.begin_step, token), token, stale)

        @precondition(lambda self: any(self.tokens))
        @rule(w=WORKERS)
        def add_cards(self, w: int) -> None:
            token = self.tokens[w]
            if token is not None:
                stale = not self._current(token)
                card = NewCard("sys.note", f"from worker {w}")
                self._fenced(lambda: self.store.run(turns.add_cards, token, [card]), token, stale)

        @precondition(lambda self: any(self.tokens))
        @rule(w=WORKERS)
        def complete_step(self, w: int) -> None:
            token = self.tokens[w]
            if token is not None:
                stale = not self._current(token)
                card = NewCard("llm.message", "reply")
                write = lambda: self.store.run(turns.complete_step, token, "no-step", None, [card])  # noqa: E731
                self._fenced(write, token, stale)

        @precondition(lambda self: any(self.tokens))
        @rule(w=WORKERS, deadline=st.sampled_from([0.0, 60.0]))
        def suspend(self, w: int, deadline: float) -> None:
            token = self.tokens[w]
            if token is None:
                return
            stale = not self._current(token)
            call = f"call-{next(self.ids)}"
            record = ToolCallRecord(call, "calculator", "<add/>")
            when = self.clock.now() + deadline
            write = lambda: self.store.run(tools.suspend, token, "no-step", [record], [], when)  # noqa: E731
            if self._fenced(write, token, stale)[0]:
                self.calls.append(call)

        @precondition(lambda self: any(self.tokens))
        @rule(w=WORKERS)
        def finish(self, w: int) -> None:
            token = self.tokens[w]
            if token is not None:
                stale = not self._current(token)
                write = lambda: self.store.run(  # noqa: E731
                    turn_end.finish, token, "succeeded", "done", {}, b"<a/>"
                )
                self._fenced(write, token, stale)

        @precondition(lambda self: any(self.tokens))
        @rule(w=WORKERS)
        def inject_timeouts(self, w: int) -> None:
            token = self.tokens[w]
            if token is not None:
                stale = not self._current(token)
                self._fenced(lambda: self.store.run(tools.inject_timeouts, token), token, stale)

        @precondition(lambda self: any(self.tokens))
        @rule(w=WORKERS)
        def force_end_what_it_holds(self, w: int) -> None:
            token = self.tokens[w]
            if token is None:
                return
            stale = not self._current(token)
            before = _snapshot(self.store)
            ended = _run(
                lambda: self.store.run(
                    turn_end.force_end,
                    AGENT,
                    "stopped",
                    "stop",
                    b"<s/>",
                    agent_turn_id=token.agent_turn_id,
                    turn_epoch=token.turn_epoch,
                )
            )
            if ended is None:
                assert _snapshot(self.store) == before
                stale_refusals[0] += stale
            else:
                assert not stale, f"stale token {token} ended the Turn"

        @invariant()
        def one_turn_at_most_is_active(self) -> None:
            head = self._head()
            assert (head.agent_turn_id is None) == (head.status == HeadStatus.IDLE)

    return TwoWorkers


def _changed_tables(before: dict, after: dict) -> set[str]:
    return {t for t in before.keys() | after.keys() if before.get(t) != after.get(t)}


def test_a_stale_writer_never_changes_anything(tmp_path_factory):
    stale_refusals = [0]
    machine = store_machine(lambda: tmp_path_factory.mktemp("store"), stale_refusals)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=150,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert stale_refusals[0] > 0  # the interleavings did produce stale writers
