"""The store's read-only views (``/v1/agents``), its ``/metrics`` figures and the runner
step log, through the store on every backend (``opener`` is parametrised: ``sqlite``
always, ``postgresql`` when a server is reachable, skipped otherwise)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from agentserver.agents.clock import ManualClock
from agentserver.agents.ports import LLMCompletion, LLMUsage
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import CardType, NewCard, TaskStatus
from agentserver.agents.store.figures import StoreFigures
from agentserver.agents.store.sql import inbox, replies, turn_end, turns
from agentserver.agents.store.sql.views import ERROR_TEXT_CHARS, error_text
from agentserver.agents.store.sql_store import SqlAgentStore
from agentserver.agents.store.step_log import StoreStepLog
from agentserver.http.agents_view import AgentsView
from agentserver.steps.log import StepRow

A, B = "assistant", "helper"
Opener = Callable[[], Awaitable[SqlAgentStore]]


@pytest.fixture(params=["sqlite", "postgresql"])
async def opener(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[Opener]:
    """Opens the test's store (again: the same file or database, as after a restart);
    every store it opened is closed at the end."""
    clock = ManualClock(1000.0)
    settings = StoreSettings(path=tmp_path / "agents.sqlite3")
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else None
    opened: list[SqlAgentStore] = []

    async def open_store() -> SqlAgentStore:
        if url is None:
            from agentserver.agents.store.sqlite_store import SqliteAgentStore

            store: Any = SqliteAgentStore.open(settings.path, clock=clock, settings=settings)
        else:
            from agentserver.agents.store.pg.store import PostgresAgentStore

            store = PostgresAgentStore.open(url, clock=clock, settings=settings)
        store = await store if inspect.isawaitable(store) else store
        opened.append(store)
        return store

    try:
        yield open_store
    finally:
        for store in opened:
            await store.aclose()


def rows(n: int, listener: str = "search") -> list[StepRow]:
    return [
        StepRow(f"s{i // 2}", listener, "assistant", i % 2, "step.x", at=float(i)) for i in range(n)
    ]


#: A failed Turn's deliverable longer than the bound on an error's text: a first sentence,
#: then words, the last sentence ending past the bound.
LONG_ERROR = (
    "The model refused the request. "
    + "Its provider said: "
    + "quota exceeded for the organisation " * 250
    + "today. "
    + "Retry after noon."
)


async def failed_turn(
    store: SqlAgentStore, text: str, thread: str, error: str = "no luck " * 100
) -> str:
    """Run one Turn of agent A on ``thread``: one step with usage, then a failed end with
    ``error`` as its deliverable."""
    clock = store.env.clock
    await store.run(inbox.enqueue_turn, A, text.encode(), {"caller_thread": thread})
    [row] = await store.run1(inbox.claim_due, A, 5)
    token = await store.run(turns.start_turn, row)
    step_id, _ = await store.run(turns.begin_step, token)
    clock.advance(2)
    usage = LLMUsage(prompt_tokens=10, completion_tokens=5, total_tokens=15)
    completion = LLMCompletion("trying", usage=usage, cost=0.25, model="m", backend="b")
    await store.run(
        turns.complete_step, token, step_id, completion, [NewCard(CardType.LLM_MESSAGE, "x")]
    )
    clock.advance(1)
    await store.run(turn_end.finish, token, TaskStatus.FAILED, error, {}, b"<a/>")
    return token.agent_turn_id


# -- GET /v1/agents and the task view ---------------------------------------------------------


async def test_agents_view_is_the_same_on_every_backend(opener):
    store = await opener()
    await store.run(inbox.ensure_agents, [A, B])
    view = AgentsView(store, (A, B))
    assert await view.reachable()
    idle = {
        "state": "idle",
        "active_turn": None,
        "queue": 0,
        "last_error": None,
        # (an unversioned store: docs/deploy.md)
        "version": None,
        "versions": {},
    }
    assert await view.agent_list() == [{"name": A, **idle}, {"name": B, **idle}]
    assert await view.task(A, "nothing") is None

    turn = await failed_turn(store, "first", "t1", LONG_ERROR)
    await store.run(
        inbox.enqueue_turn, A, b"second", {"caller_thread": "t2"}
    )  # leased, not started
    await store.run(inbox.enqueue_turn, A, b"third", {"caller_thread": "t3", "hop": "h3"})  # queued
    [row] = await store.run1(inbox.claim_due, A, 5)
    running = await store.run(turns.start_turn, row)
    await store.run(turns.begin_step, running)
    # The whole error up to the bound, cut at a word's end with the count of the rest.
    assert len(LONG_ERROR) > ERROR_TEXT_CHARS
    kept = LONG_ERROR[: LONG_ERROR.rindex(" ", 0, ERROR_TEXT_CHARS + 1)]
    assert LONG_ERROR.startswith(kept) and len(kept) > ERROR_TEXT_CHARS - 20
    cut = f"{kept} … ({len(LONG_ERROR) - len(kept)} more characters)"
    error = {"turn": turn, "status": "failed", "text": cut}
    assert await view.agent_list([A]) == [
        {
            "name": A,
            "state": "running",
            "active_turn": {
                "id": running.agent_turn_id,
                "steps": 1,
                "waiting_tools": 0,
                "running_since": 1003.0,
                "version": None,
                "pinned": False,
                "waiting_for_version": None,
            },
            "queue": 1,
            "last_error": {**error, "at": 1003.0},
            "version": None,
            "versions": {},
        }
    ]
    assert await view.agent(B) == {"name": B, **idle}
    # ``agentserver status`` shows it whole, on one line (issue 45: it was cut mid-word).
    from agentserver.cli.status import format_status

    doc = {"organism": "o", "agents": await view.agent_list([A])}
    assert f"    last error (failed): {cut}" in format_status(doc).splitlines()
    assert await view.task(A, "t1") == {
        "agent": A,
        "thread": "t1",
        "turn": turn,
        "status": "failed",
        "version": None,
        "created_at": 1000.0,
        "finished_at": 1003.0,
        "error": error["text"],
        "steps": [
            {
                "step": 1,
                "status": "completed",
                "model": "m",
                "backend": "b",
                "prompt_tokens": 10,
                "completion_tokens": 5,
                "total_tokens": 15,
                "cost": 0.25,
                "started_at": 1000.0,
                "ended_at": 1002.0,
                "tool_calls": 0,
                "version": None,
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "cost": 0.25},
        # The failed Turn's answer, as its caller was sent it.
        "answer": "<a/>",
        "answer_failed": True,
    }
    running_task = await view.task(A, "t2")
    assert running_task is not None and running_task["status"] == "running"
    assert running_task["turn"] == running.agent_turn_id
    queued = await view.task(A, "h3")  # found by the hop thread too
    assert queued is not None and (queued["status"], queued["turn"]) == ("queued", None)
    assert await view.turn_thread(turn) == ("t1", None)
    assert await view.turn_thread("no-such-turn") == (None, None)


ERROR_WORDS = st.text(alphabet=st.sampled_from("ab. \n"), max_size=300)


@given(text=ERROR_WORDS, limit=st.integers(min_value=1, max_value=120))
def test_an_error_is_whole_or_cut_between_words_with_what_is_left(text: str, limit: int) -> None:
    """``error_text``: the whole text when it fits; else a prefix that ends a word (or a
    sentence), never inside one unless one word is longer than the bound, and a marker
    with the exact count of what is not shown."""
    shown = error_text(text, limit)
    if len(text) <= limit:
        assert shown == text
        return
    kept, sep, marker = shown.rpartition(" … (")
    assert sep and marker == f"{len(text) - len(kept)} more characters)"
    assert text.startswith(kept) and 0 < len(kept) <= limit
    if any(c.isspace() for c in text[1 : limit + 1]) and text[:limit].strip():
        # A word boundary exists within the bound: the cut is at one.
        assert text[len(kept)].isspace() and not kept[-1].isspace()
    else:
        assert kept == text[:limit]


def test_an_error_is_cut_at_a_sentence_near_the_bound() -> None:
    text = "First part of the error. Second part goes on and on"
    assert error_text(text, 30) == f"First part of the error. … ({len(text) - 24} more characters)"
    # A sentence end far before the bound loses to the last word that fits.
    assert error_text(text, 48).startswith("First part of the error. Second part goes on and …")
    assert error_text("x" * 10, 4) == "xxxx … (6 more characters)"
    # A provider's error body of a few KiB is shown whole (it was cut at 500 characters).
    body = "upstream said: " + '{"error": {"message": "rate limited", "code": 429}} ' * 80
    assert len(body) > 4000 and error_text(body) == body


async def test_the_web_consoles_views_are_the_same_on_every_backend(opener):
    """The recent tasks of an agent and a Turn's log (cards, cut; decisions; approvals)."""
    from agentserver.agents.store.sql.views import CARD_TEXT_CHARS

    store = await opener()
    await store.run(inbox.ensure_agents, [A, B])
    view = AgentsView(store, (A, B))
    assert await view.recent_tasks(A) == []
    turn = await failed_turn(store, "first", "t1")
    await store.run(inbox.enqueue_turn, A, b"second", {"caller_thread": "t2"})
    await store.run(inbox.enqueue_turn, A, b"third", {"hop": "h3"})
    tasks = await view.recent_tasks(A, 2)
    # Newest first, by the caller's thread (else the hop's); the second is not started.
    assert [(t["thread"], t["hop"]) for t in tasks] == [("h3", "h3"), ("t2", None)]
    assert tasks[0]["status"] == "queued" and tasks[0]["turn"] is None
    first = (await view.recent_tasks(A))[-1]
    assert (first["thread"], first["turn"], first["created_at"]) == ("t1", turn, 1000.0)
    assert await view.recent_tasks(B) == []

    log = await view.turn_log(turn)
    kinds = [c["type"] for c in log["cards"]]
    assert kinds[0] == CardType.TASK_INPUT and kinds[-1] == CardType.DELIVERABLE
    assert CardType.LLM_MESSAGE in kinds
    assert [c["seq"] for c in log["cards"]] == sorted(c["seq"] for c in log["cards"])
    deliverable = log["cards"][-1]
    assert deliverable["text"] == ("no luck " * 100)[:CARD_TEXT_CHARS]
    assert deliverable["cut"] is False and isinstance(deliverable["metadata"], dict)
    assert log["decisions"] == [] and log["approvals"] == []
    assert await view.turn_log("no-such-turn") == {"cards": [], "decisions": [], "approvals": []}
    assert await view.pending_approvals() == []


async def test_what_a_person_reads_of_a_task_is_the_same_on_every_backend(opener):
    """The web console's reading of a task (views.reading): its text (the payload while
    queued, the Turn's task card once started), its end and answer, its inbox status."""
    from agentserver.agents.store.sql.views import LIST_TEXT_CHARS

    store = await opener()
    await store.run(inbox.ensure_agents, [A])
    view = AgentsView(store, (A,))
    assert await view.task_reading(A, "t1") is None
    first = "<task><text>first</text></task>"
    await failed_turn(store, first, "t1")
    done = await view.task_reading(A, "t1")
    assert done is not None
    assert (done["inbox_status"], done["outcome"], done["asking"]) == ("consumed", "failed", False)
    # The started row gave its payload up: the text is the Turn's task.input card.
    assert (done["text"], done["text_cut"]) == (first, False)
    assert done["answer"] == "no luck " * 100 and done["answer_cut"] is False
    assert done["finished_at"] == 1003.0

    second = "<task><text>second</text></task>"
    await store.run(inbox.enqueue_turn, A, second.encode(), {"caller_thread": "t2"})
    [row] = await store.run1(inbox.claim_due, A, 5)
    await store.run(turns.start_turn, row)
    running = await view.task_reading(A, "t2")
    assert running is not None
    assert (running["outcome"], running["answer"], running["finished_at"]) == (None, None, None)
    assert running["text"] == second and running["inbox_status"] == "consumed"

    long = "x" * (LIST_TEXT_CHARS + 5)
    await store.run(inbox.enqueue_turn, A, long.encode(), {"caller_thread": "t3"})  # behind t2
    queued = await view.task_reading(A, "t3")
    assert queued is not None and (queued["inbox_status"], queued["text"]) == ("queued", long)
    listed = await view.recent_tasks(A)
    assert [t["inbox_status"] for t in listed] == ["queued", "consumed", "consumed"]
    assert listed[0]["text"] == long[:LIST_TEXT_CHARS] and listed[0]["text_cut"] is True
    assert [t["outcome"] for t in listed] == [None, None, "failed"]
    assert listed[2]["text"] == first
    assert listed[2]["answer"] == ("no luck " * 100)[:LIST_TEXT_CHARS] and listed[2]["answer_cut"]

    await store.run(replies.cancel_queued, A, "t3", b"<cancelled/>")
    cancelled = await view.task_reading(A, "t3")
    assert cancelled is not None
    assert (cancelled["inbox_status"], cancelled["outcome"]) == ("skipped", None)
    assert cancelled["text"] == long


async def test_an_unreachable_store_is_not_ready(opener):
    store = await opener()
    view = AgentsView(store, (A,))
    assert await view.reachable()
    await store.aclose()
    assert not await view.reachable()


# -- the /metrics store figures ---------------------------------------------------------------


async def test_store_figures_are_a_snapshot_refreshed_by_a_task(opener):
    from agentserver.observability import Metrics

    store = await opener()
    clock = store.env.clock
    figures = StoreFigures(store, clock, period=0.05)
    registry = CollectorRegistry()
    Metrics(registry).bind_agents(figures, (A,))

    def sample(name: str) -> float | None:
        return registry.get_sample_value(name, {"agent": A})

    lag = "agentserver_agent_inbox_lag_seconds"
    assert sample(lag) is None  # no snapshot yet: left out of the scrape
    await store.run(inbox.enqueue_turn, A, b"one", {"caller_thread": "one"})
    clock.advance(4)
    async with trio.open_nursery() as nursery:
        await nursery.start(figures.run)  # the first refresh is done when it has started
        assert sample(lag) == 4
        assert sample("agentserver_agent_approvals_pending") == 0
        [row] = await store.run1(inbox.claim_due, A, 5)
        await store.run(turns.start_turn, row)
        taken = figures.taken_at
        clock.advance(1)
        assert sample(lag) == 5  # the snapshot's oldest task, aged at scrape time
        with trio.fail_after(10):
            while figures.taken_at == taken:  # noqa: ASYNC110 (the task's next refresh)
                await trio.sleep(0.01)
        assert sample(lag) == 0  # nothing waits any more
        nursery.cancel_scope.cancel()
    await store.aclose()
    assert not await figures.refresh()
    assert sample(lag) is None  # a failing store: left out until a refresh succeeds


# -- the runner step log ----------------------------------------------------------------------


async def test_step_log_rows_are_written_in_batches_and_survive_a_restart(opener):
    store = await opener()
    log = StoreStepLog(store)
    written = [log.append(r) for r in rows(5)]
    assert [r.seq for r in written] == [0] * 5  # buffered: numbered once written
    assert log.waiting == 5
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        with trio.fail_after(10):
            await log.flush()
        assert [r.seq for r in written] == [1, 2, 3, 4, 5]
        assert log.waiting == 0 and log.written == 5
        log.append(rows(1, "other")[0])
        # a read waits for the rows recorded before it
        assert [r.listener for r in await log.rows(listener="other")] == ["other"]
        nursery.cancel_scope.cancel()
    await store.aclose()

    store = await opener()  # a restart
    log = StoreStepLog(store)
    assert [r.seq for r in await log.rows()] == [1, 2, 3, 4, 5, 6]
    log.append(rows(1, "third")[0])
    await log.drain()  # no writer running: what is buffered is written now
    assert [r.seq for r in await log.rows(listener="third")] == [7]  # numbering goes on
    assert [r.seq for r in await log.rows(after=2, limit=2)] == [3, 4]
    assert [r.seq for r in await log.rows(step="s1")] == [3, 4]
    assert (await log.rows(after=2, limit=2))[0] == StepRow(
        "s1", "search", "assistant", 0, "step.x", "", 2.0, 3
    )


async def test_a_failing_store_keeps_the_rows_and_a_full_buffer_drops_counted(opener, caplog):
    from agentserver.observability import Metrics

    store = await opener()

    async def ddl(sql: str) -> None:
        def run(tx: Any, env: Any) -> None:
            tx.execute(sql)

        await store.run(run)

    await ddl("ALTER TABLE step_log RENAME TO step_log_away")  # every write fails
    log = StoreStepLog(store, buffer=3)
    registry = CollectorRegistry()
    Metrics(registry).bind_step_log(log)
    log.retry_s = 0.01
    caplog.set_level(logging.WARNING, logger="agentserver.agents.store.step_log")
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        for row in rows(3):
            log.append(row)
        with trio.fail_after(10):
            while "could not write" not in caplog.text:  # noqa: ASYNC110 (a log record)
                await trio.sleep(0.01)
        # the writer holds the 3 rows it took; the buffer takes 3 more, then drops
        for row in rows(5, "late"):
            log.append(row)
        assert (log.written, log.waiting, log.dropped) == (0, 6, 2)
        assert registry.get_sample_value("agentserver_step_log_dropped_total") == 2
        assert registry.get_sample_value("agentserver_step_log_waiting") == 6
        assert "buffer full" in caplog.text and caplog.text.count("buffer full") == 1
        await ddl("ALTER TABLE step_log_away RENAME TO step_log")  # the store is back
        with trio.fail_after(10):
            await log.flush()
        nursery.cancel_scope.cancel()
    got = await log.rows(limit=1000)
    assert [(r.listener, r.step) for r in got] == [
        *(("search", f"s{i // 2}") for i in range(3)),
        *(("late", f"s{i // 2}") for i in range(3)),
    ]
    assert log.dropped == 2 and "writing again (2 row(s) dropped in all)" in caplog.text


async def test_processes_sharing_a_postgresql_store_see_each_others_agents_and_steps(pg_url):
    """Two processes on one database: each one's view shows the agents and the step
    events of both (the figures too)."""
    from agentserver.agents.store.pg.store import PostgresAgentStore

    clock = ManualClock(1000.0)
    settings = StoreSettings(url=pg_url)
    one = await trio.to_thread.run_sync(
        lambda: PostgresAgentStore.open(pg_url, clock=clock, settings=settings)
    )
    two = await trio.to_thread.run_sync(
        lambda: PostgresAgentStore.open(pg_url, clock=clock, settings=settings)
    )
    try:
        await one.run(inbox.enqueue_turn, A, b"task", {"caller_thread": "t"})
        [row] = await one.run1(inbox.claim_due, A, 5)
        token = await one.run(turns.start_turn, row)
        [seen] = await AgentsView(two, (A,)).agent_list()
        assert seen["state"] == "running" and seen["active_turn"]["id"] == token.agent_turn_id
        logs = [StoreStepLog(one), StoreStepLog(two)]
        for i, log in enumerate(logs):
            log.append(rows(1, f"from-{i}")[0])
            await log.drain()
        for log in logs:
            assert [r.listener for r in await log.rows()] == ["from-0", "from-1"]
        figures = StoreFigures(two, clock)
        assert await figures.refresh() and figures.inbox_lag() == {}
    finally:
        await one.aclose()
        await two.aclose()
