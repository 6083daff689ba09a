"""The hot store calls on PostgreSQL in one round trip (agents/store/pg/one_trip.py): the round
trips each costs are pinned (a regression fails here), and what each does is what the
shared function does on the same rows, misses included (they rerun the shared one)."""

from __future__ import annotations

import collections
import json

import psycopg
import pytest
import trio

from agentserver.agents.errors import StaleTurn
from agentserver.agents.ports import LLMCompletion, LLMUsage
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import CardType, NewCard, ToolCallRecord
from agentserver.agents.store.governance import DecisionRecord, StepRecord
from agentserver.agents.store.pg import store as pg_store
from agentserver.agents.store.pg.store import PostgresAgentStore
from agentserver.agents.store.sql import governance, inbox, tools, turn_end, turns
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.states import AfterExecution, HeadStatus

pytestmark = pytest.mark.postgresql


def _open(url: str, executor: str = "trio") -> PostgresAgentStore:
    return PostgresAgentStore.open(url, settings=StoreSettings(url=url, pg_executor=executor))


def _sql(url: str, query: str, *args):
    with psycopg.connect(url) as conn:
        cur = conn.execute(query, args)
        return cur.fetchall() if cur.description is not None else []


class Trips:
    """Round trips per store function, from the executor's per-call hook."""

    def __init__(self, store: PostgresAgentStore) -> None:
        self.calls: dict[str, list[int]] = collections.defaultdict(list)
        store.executor.on_call = self._on_call

    def _on_call(self, fn, args, statements: int, trips: int) -> None:
        name = args[2].__name__ if fn.__name__ == "_notifying" else fn.__name__
        self.calls[name].append(trips)

    def take(self, name: str) -> list[int]:
        return self.calls.pop(name, [])


def _completion() -> LLMCompletion:
    return LLMCompletion("", LLMUsage(1, 2, 3), 0.0, "m", "b")


async def _start(store: PostgresAgentStore, agent: str = "a", max_steps: int = 8):
    await store.run(inbox.ensure_agents, [agent])
    assert (await store.run(inbox.enqueue_turn, agent, b"<task>x</task>", {"ref": 1})).leased
    [row] = await store.run1(inbox.claim_due, agent, 5)
    return await store.run(turns.start_turn_step, row, max_steps)


async def test_the_hot_calls_cost_the_round_trips_pinned(pg_url: str) -> None:
    """A Turn with two tool calls: enqueue_turn 1 (leased or queued), start_turn_step 1, complete_screened_step 1, suspend
    1, report_tool_result 1, apply_report 2 (the waiting row, then every write with
    COMMIT), finish 2 (its writes with the next queued Turn's read, then COMMIT with
    that Turn's lease, if any)."""
    store = _open(pg_url)
    try:
        trips = Trips(store)
        start = await _start(store)
        assert trips.take("enqueue_turn") == [1]  # leased at once: the head was idle
        assert start.step_id is not None and start.step_no == 1
        assert [c.card_type for c in start.context] == ["task.input"]
        assert trips.take("start_turn_step") == [1]
        token = start.head.token
        decision = DecisionRecord("calc", "add", "allow", "r1", "fine")
        await store.run(
            governance.complete_screened_step,
            token,
            start.step_id,
            _completion(),
            [NewCard("sys.note", "model said")],
            StepRecord((decision,)),
        )
        assert trips.take("complete_screened_step") == [1]
        [(meta,)] = _sql(pg_url, "SELECT metadata FROM agent_steps")
        assert json.loads(meta)["policy"] == [{"target": "calc", "decision": "allow", "rule": "r1"}]
        calls = [ToolCallRecord("t1", "calc", "<add/>"), ToolCallRecord("t2", "calc", "<add/>")]
        early = await store.run(
            tools.suspend, token, start.step_id, calls, [NewCard("sys.note", "thinking")], 1e12
        )
        assert early == 0
        assert trips.take("suspend") == [1]
        await store.run(inbox.report_tool_result, "a", "t1", b"<sum>1</sum>", failed=False)
        await store.run(inbox.report_tool_result, "a", "t2", b"<sum>2</sum>", failed=False)
        assert trips.take("report_tool_result") == [1, 1]
        assert (
            _sql(
                pg_url,
                "SELECT status, agent_turn_id FROM agent_inbox WHERE message_type = 'tool_result'",
            )
            == [("pending", token.agent_turn_id)] * 2
        )
        rows = await store.run1(inbox.claim_due, "a", 5)
        first = await store.run(tools.apply_report, rows[0], then_step=8)
        assert (first.kind, first.resumed) == ("applied", None)
        second = await store.run(tools.apply_report, rows[1], then_step=8)
        assert second.kind == "applied" and second.resumed is not None
        assert second.resumed.turn_epoch == token.turn_epoch + 1
        assert second.reply_ref_json == '{"ref": 1}' and second.terminate_card_id is None
        step = second.step
        assert step is not None and step.step_no == 2 and step.step_id is not None
        assert step.head.status == HeadStatus.RUNNING and step.head.waiting_tool_count == 0
        assert [c.card_type for c in step.output] == [
            "sys.note",
            "sys.note",
            "tool.call",
            "tool.call",
            "tool.result",
            "tool.result",
        ]
        assert trips.take("apply_report") == [2, 2]
        # A queued Turn for the same agent: the finish leases it (one round trip more).
        queued = await store.run(inbox.enqueue_turn, "a", b"<task>y</task>", {"ref": 2})
        assert not queued.leased and trips.take("enqueue_turn") == [1]  # busy: queued
        fin = await store.run(
            turn_end.finish,
            second.resumed,
            "succeeded",
            "done",
            {},
            b"<answer/>",
            step_id=step.step_id,
            completion=_completion(),
            cards=[NewCard("sys.note", "last")],
        )
        assert fin.next_leased and fin.reply is not None
        assert fin.reply.reply_ref_json == '{"ref": 1}'
        assert trips.take("finish") == [2]
        [(payload, failed)] = _sql(pg_url, "SELECT payload, failed FROM agent_replies")
        assert (bytes(payload), failed) == (b"<answer/>", 0)
        [(tokens,)] = _sql(pg_url, "SELECT total_tokens FROM agent_steps WHERE step_no = 2")
        assert tokens == 3
        # The next Turn, ended with nothing queued: two round trips.
        [row] = await store.run1(inbox.claim_due, "a", 5)
        start2 = await store.run(turns.start_turn_step, row, 8)
        fin2 = await store.run(turn_end.finish, start2.head.token, "succeeded", "ok", {}, b"<a2/>")
        assert not fin2.next_leased
        assert trips.take("start_turn_step") == [1]
        assert trips.take("finish") == [2]
        head = await store.read(sql_head.read, "a")
        assert (head.status, head.agent_turn_id) == (HeadStatus.IDLE, None)
    finally:
        await store.aclose()


@pytest.mark.parametrize("executor", ["trio", "thread"])
async def test_misses_rerun_the_shared_function(pg_url: str, executor: str) -> None:
    """A compare-and-set that misses aborts the one-trip transaction in the server
    (nothing of it stays) and the shared function meets the miss as before (on either
    executor: the thread one runs the same variants a statement at a time)."""
    store = _open(pg_url, executor)
    try:
        trips = Trips(store)
        # At the step limit: no step, the Turn started all the same (the shared path).
        start = await _start(store, max_steps=0)
        assert start.step_id is None and start.head.status == HeadStatus.RUNNING
        if executor == "trio":
            # The miss: its round trip and its ROLLBACK; then the shared call, as before.
            assert trips.take("start_turn_step") == [2, 7]
        token = start.head.token
        step_id, _ = await store.run(turns.begin_step, token)
        await store.run(
            tools.suspend, token, step_id, [ToolCallRecord("t1", "calc", "<add/>")], [], 1e12
        )
        # Fenced out: a stale token fails as before, and writes nothing.
        stale = type(token)(token.agent_id, token.agent_turn_id, token.turn_epoch + 5)
        cards_before = _sql(pg_url, "SELECT count(*) FROM cards")
        with pytest.raises(StaleTurn):
            await store.run(turn_end.finish, stale, "succeeded", "x", {}, b"<x/>")
        with pytest.raises(StaleTurn):
            await store.run(
                tools.suspend, stale, step_id, [ToolCallRecord("t9", "c", "<a/>")], [], 1e12
            )
        assert _sql(pg_url, "SELECT count(*) FROM cards") == cards_before
        assert _sql(pg_url, "SELECT count(*) FROM agent_replies") == [(0,)]
        # A report for a Turn that moved on is skipped (stale), a duplicate too.
        await store.run(inbox.report_tool_result, "a", "t1", b"<r/>", failed=False)
        _sql(pg_url, "UPDATE agent_state_head SET turn_epoch = turn_epoch + 1")
        [row] = await store.run1(inbox.claim_due, "a", 5)
        assert (await store.run(tools.apply_report, row, then_step=8)).kind == "stale"
        assert _sql(pg_url, "SELECT status FROM turn_waiting_tools") == [("waiting",)]
    finally:
        await store.aclose()


@pytest.mark.parametrize("executor", ["trio", "thread"])
async def test_a_terminating_tool_ends_without_a_step(pg_url: str, executor: str) -> None:
    store = _open(pg_url, executor)
    try:
        start = await _start(store)
        token = start.head.token
        # A report before its suspend: parked as deferred, without a Turn.
        await store.run(inbox.report_tool_result, "a", "t1", b"<r/>", failed=False)
        assert _sql(
            pg_url,
            "SELECT status, agent_turn_id, defer_reason FROM agent_inbox "
            "WHERE correlation_id = 't1'",
        ) == [("deferred", None, "awaiting suspend")]
        call = ToolCallRecord("t1", "calc", "<add/>", after_execution=AfterExecution.TERMINATE)
        assert await store.run(tools.suspend, token, start.step_id, [call], [], 1e12) == 1
        [row] = await store.run1(inbox.claim_due, "a", 5)
        out = await store.run(tools.apply_report, row, then_step=8)
        [(card_id,)] = _sql(pg_url, "SELECT result_card_id FROM turn_waiting_tools")
        assert out.resumed is not None and out.terminate_card_id == card_id
        assert out.step is None
    finally:
        await store.aclose()


async def test_an_enqueue_leases_the_oldest_queued_turn_as_before(pg_url: str) -> None:
    """An idle head with a Turn queued before (the shared function leases the oldest)
    is a miss of the one-trip enqueue: the shared one runs and leases that Turn; so
    does an enqueue continuing a conversation."""
    store = _open(pg_url)
    try:
        trips = Trips(store)
        await store.run(inbox.ensure_agents, ["a"])
        first = await store.run(inbox.enqueue_turn, "a", b"<task>1</task>", {"ref": 1})
        assert first.leased
        second = await store.run(inbox.enqueue_turn, "a", b"<task>2</task>", {"ref": 2})
        assert not second.leased
        # The head goes idle without leasing the queued Turn (as after a takeover).
        _sql(
            pg_url,
            "UPDATE agent_state_head SET status = 'idle', active_agent_turn_id = "
            "NULL, turn_inbox_id = NULL",
        )
        trips.take("enqueue_turn")
        third = await store.run(inbox.enqueue_turn, "a", b"<task>3</task>", {"ref": 3})
        assert third.leased  # a lease was made: of the older Turn, as the shared one does
        assert trips.take("enqueue_turn")[0] == 2  # the miss and its ROLLBACK
        [(turn_inbox,)] = _sql(pg_url, "SELECT turn_inbox_id FROM agent_state_head")
        assert turn_inbox == second.inbox_id
        statuses = dict(_sql(pg_url, "SELECT inbox_id, status FROM agent_inbox"))
        assert statuses[second.inbox_id] == "pending"  # (dispatched: due to start)
        assert statuses[third.inbox_id] == "queued"
        # The dispatched row carries the head's epoch and Turn, as the shared lease's.
        [(epoch, turn)] = _sql(
            pg_url, "SELECT turn_epoch, active_agent_turn_id FROM agent_state_head"
        )
        assert _sql(
            pg_url,
            "SELECT turn_epoch, agent_turn_id FROM agent_inbox WHERE inbox_id = %s",
            second.inbox_id,
        ) == [(epoch, turn)]
    finally:
        await store.aclose()


async def test_a_one_trip_lease_writes_what_the_shared_one_does(pg_url: str) -> None:
    store = _open(pg_url)
    try:
        await store.run(inbox.ensure_agents, ["a"])
        got = await store.run(inbox.enqueue_turn, "a", b"<task>x</task>", {"ref": 1})
        assert got.leased
        [(status, epoch, turn, inbox_id, ctx, out, tokens)] = _sql(
            pg_url,
            "SELECT status, turn_epoch, active_agent_turn_id, turn_inbox_id, "
            "context_box_id, output_box_id, context_tokens FROM agent_state_head",
        )
        assert (status, inbox_id) == ("dispatched", got.inbox_id) and tokens > 0
        assert _sql(pg_url, "SELECT status, turn_epoch, agent_turn_id FROM agent_inbox") == [
            ("pending", epoch, turn)
        ]
        assert sorted(_sql(pg_url, "SELECT box_id, kind FROM boxes")) == sorted(
            [(ctx, "context"), (out, "output")]
        )
        assert _sql(pg_url, "SELECT box_id, card_type, content, tokens FROM cards") == [
            (ctx, "task.input", "<task>x</task>", tokens)
        ]
        edges = _sql(pg_url, "SELECT primitive, agent_turn_id FROM execution_edges ORDER BY 1")
        assert edges == [("enqueue", None), ("lease", turn)]
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    ("clock", "finish", "start"),
    [(3.0, 1.0, 3.0), (3.0, 5.0, 5.0), (None, None, 0.0)],
)
async def test_a_fair_share_enqueue_leases_in_one_trip_and_tags_as_the_shared_lease(
    pg_url: str, clock: float | None, finish: float | None, start: float
) -> None:
    """With ``<store fair-share>`` an enqueue that leases at once is still one round trip, and
    moves the tags as agents/store/sql/fair.py's lease does: the start is ``max(V, the
    client's finish)``; the client's finish becomes ``start + 1/weight``, V the start."""
    settings = StoreSettings(url=pg_url, fair_weights=(("c", 2.0),))
    store = PostgresAgentStore.open(pg_url, settings=settings)
    try:
        await store.run(inbox.ensure_agents, ["a"])
        if clock is not None:
            _sql(pg_url, "INSERT INTO fair_share VALUES ('a', '#v', %s), ('a', 'c', %s)",
                 clock, finish)  # fmt: skip
        trips = Trips(store)
        got = await store.run(inbox.enqueue_turn, "a", b"<task>x</task>", {"ref": 1, "client": "c"})
        assert got.leased and trips.take("enqueue_turn") == [1]
        assert sorted(_sql(pg_url, "SELECT client, vfinish FROM fair_share")) == [
            ("#v", start),
            ("c", start + 0.5),
        ]
        # Busy now: the next one queues and moves no tag (its lease will).
        assert not (
            await store.run(inbox.enqueue_turn, "a", b"<task>y</task>", {"client": "d"})
        ).leased
        assert len(_sql(pg_url, "SELECT 1 FROM fair_share")) == 2
    finally:
        await store.aclose()


async def test_a_finish_locks_the_head_before_its_reply_row(pg_url: str) -> None:
    """The one-trip finish takes the head's lock before it writes the reply row, as a
    stop's end of the same Turn does (head, then reply row): one order, no deadlock.

    A second session holds the head's lock, as a stop's transaction does after its
    fence; the finish waits for it. The session then writes the Turn's reply row, as
    that stop would: before the fix the finish had written that row already, and the
    session waited on it (here until its lock timeout; in production until the deadlock
    detector killed one of the two, a second lost). The deadlock detector is held off
    for the store's sessions, so that the wait shows rather than being broken."""
    dbname = psycopg.conninfo.conninfo_to_dict(pg_url)["dbname"]
    _sql(pg_url, f"ALTER DATABASE \"{dbname}\" SET deadlock_timeout = '1min'")
    store = _open(pg_url)
    other = psycopg.connect(pg_url)
    try:
        start = await _start(store)
        token = start.head.token
        other.execute("SELECT 1 FROM agent_state_head WHERE agent_id = 'a' FOR UPDATE")
        got: list[object] = []

        async def finish() -> None:
            got.append(
                await store.run(turn_end.finish, token, "succeeded", "done", {}, b"<answer/>")
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(finish)
            for _ in range(3000):  # the finish waits for the head's lock
                if _sql(
                    pg_url,
                    "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()",
                ):
                    break
                await trio.sleep(0.01)
            else:
                raise AssertionError("the finish never waited for the head")

            def end_as_a_stop_would() -> None:
                other.execute("SET LOCAL lock_timeout = '1s'")
                other.execute(
                    "INSERT INTO agent_replies (agent_turn_id, agent_id, reply_ref, payload, "
                    "failed, status, created_at) VALUES (%s, 'a', '{}', %s, 1, 'pending', 0)",
                    (token.agent_turn_id, b"<stopped/>"),
                )
                other.rollback()  # the stop gives way: the finish goes on

            await trio.to_thread.run_sync(end_as_a_stop_would)
        [finished] = got
        assert finished.agent_turn_id == token.agent_turn_id
        assert _sql(pg_url, "SELECT payload FROM agent_replies") == [(b"<answer/>",)]
    finally:
        other.close()
        await store.aclose()


async def _worker_turn(store: PostgresAgentStore, agent: str) -> list:
    """A step that calls two tools written with its suspend, the reports applied as they
    are recorded (one failed, then a duplicate): what the worker's one-tool path does."""
    start = await _start(store, agent)
    token = start.head.token
    decision = DecisionRecord("calc", "add", "allow", "r1", "fine")
    refusal = NewCard(CardType.TOOL_REFUSED, "refused", {"to": "x", "rule": "deny"})
    calls = [ToolCallRecord(f"{agent}-t{i}", "calc", "<add/>") for i in (1, 2)]
    early = await store.run(
        tools.suspend,
        token,
        str(start.step_id),
        calls,
        [NewCard(CardType.HUH, "<huh/>")],
        1e12,
        completion=_completion(),
        step_cards=[NewCard(CardType.LLM_MESSAGE, "calling")],
        screened=StepRecord((decision,), (refusal,)),
    )
    out = [early]
    for sub, body, failed in (("t1", b"<sum>1</sum>", False), ("t2", b"<e/>", True)):
        got = await store.run(
            tools.apply_tool_result, agent, f"{agent}-{sub}", body, failed=failed, then_step=8
        )
        out.append((got.kind, got.resumed is not None, got.step is not None and got.step.step_no))
    dup = await store.run(
        tools.apply_tool_result, agent, f"{agent}-t2", b"<e/>", failed=False, then_step=8
    )
    out.append(dup.kind)
    return out


def _rows_of(url: str, agent: str) -> dict[str, list]:
    """What a Turn of ``agent`` wrote, ids and times left out (the agent's name too)."""
    turn = "(SELECT agent_turn_id FROM agent_steps WHERE agent_id = %s LIMIT 1)"
    queries = {
        "head": "SELECT status, turn_epoch, step_count, waiting_tool_count, context_tokens "
        "FROM agent_state_head WHERE agent_id = %s",
        "cards": f"SELECT card_type, content, metadata, tokens FROM cards WHERE agent_turn_id = {turn} "
        "ORDER BY seq",
        "steps": "SELECT step_no, status, total_tokens, metadata, tool_call_ids FROM agent_steps "
        "WHERE agent_id = %s ORDER BY step_no",
        "waiting": "SELECT tool_call_id, status, to_listener, after_execution FROM "
        "turn_waiting_tools WHERE agent_id = %s ORDER BY tool_call_id",
        "decisions": "SELECT target, decision, rule FROM policy_decisions WHERE agent_id = %s",
        "inbox": "SELECT message_type, status, correlation_id FROM agent_inbox "
        "WHERE agent_id = %s ORDER BY created_at",
        "edges": "SELECT primitive, edge_phase FROM execution_edges WHERE agent_id = %s "
        "ORDER BY created_at, primitive",
    }
    out = {}
    for name, query in queries.items():
        rows = _sql(url, query, agent)
        out[name] = json.loads(json.dumps(rows, default=str).replace(f"{agent}-", "X-"))
    return out


async def test_the_worker_path_writes_in_one_trip_what_the_shared_functions_do(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step written with its suspend (one round trip) and a report applied as it is
    recorded (two; a duplicate is a miss, kept in the inbox by the shared function)
    write the same rows as the shared functions on the same Turn."""
    store = _open(pg_url)
    try:
        trips = Trips(store)
        fast = await _worker_turn(store, "a")
        assert trips.take("suspend") == [1]
        assert trips.take("apply_tool_result")[:2] == [2, 2]
        for fn in (tools.suspend, tools.apply_tool_result):
            monkeypatch.delitem(pg_store.ONE_TRIP, fn)
        shared = await _worker_turn(store, "b")
    finally:
        await store.aclose()
    assert fast == shared == [0, ("applied", False, False), ("applied", True, 2), "queued"]
    assert _rows_of(pg_url, "a") == _rows_of(pg_url, "b")
