"""PostgresAgentStore's own guarantees on a real server: schema created once by
processes starting together, claims that skip locked rows, leases (a live process's
Turns are never taken; a dead one's are, fenced), NOTIFY after work is made due."""

from __future__ import annotations

import threading

import psycopg
import pytest
import trio

from agentserver.agents.errors import StaleTurn
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import NewCard, ToolCallRecord, TurnToken
from agentserver.agents.store.pg.leases import processes
from agentserver.agents.store.pg.schema import EXTRAS_DIGEST, migrate_pg
from agentserver.agents.store.pg.store import PostgresAgentStore
from agentserver.agents.store.pg.trio_executor import PgTrioExecutor
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.sql import inbox, tools, turns
from agentserver.agents.store.sql.schema import SCHEMA_VERSION
from agentserver.agents.store.states import HeadStatus, InboxStatus


def _open(url: str, **kw) -> PostgresAgentStore:
    return PostgresAgentStore.open(url, settings=StoreSettings(url=url, **kw))


def _sql(url: str, query: str, *args):
    with psycopg.connect(url) as conn:
        cur = conn.execute(query, args)
        return cur.fetchall() if cur.description is not None else []


def test_processes_starting_together_migrate_once(pg_url: str) -> None:
    stores: list[PostgresAgentStore] = []
    errors: list[BaseException] = []
    gate = threading.Barrier(4)

    def start() -> None:
        gate.wait()
        try:
            stores.append(_open(pg_url))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        versions = _sql(pg_url, "SELECT version FROM schema_version ORDER BY version")
        assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)]
        assert len(_sql(pg_url, "SELECT owner FROM agentserver_processes")) == 4
    finally:
        for s in stores:
            s.close()


def test_a_process_starting_beside_a_busy_one_takes_no_table_lock(pg_url: str) -> None:
    """A second process starting while the first holds rows of the hot tables in an open
    transaction migrates without waiting for them (its extras already ran: no ALTER,
    CREATE TRIGGER or CREATE INDEX takes a table lock), so it neither times out nor
    queues the running process's statements behind it."""
    first = _open(pg_url)
    try:
        with psycopg.connect(pg_url) as holder:
            holder.execute("SELECT * FROM agent_inbox FOR UPDATE")
            holder.execute("SELECT * FROM agent_state_head FOR UPDATE")
            second = PgTrioExecutor.open_sync(pg_url, lock_timeout_s=0.5)
            try:
                assert second.run_sync(migrate_pg) == SCHEMA_VERSION
            finally:
                second.close()
        # Extras changed (a new version): the next start runs them again and records it.
        _sql(pg_url, "UPDATE agentserver_extras SET digest = 'older'")
        _open(pg_url).close()
        assert _sql(pg_url, "SELECT digest FROM agentserver_extras") == [(EXTRAS_DIGEST,)]
    finally:
        first.close()


async def _running(store: PostgresAgentStore, agent: str = "a"):
    await store.run(inbox.ensure_agents, [agent])
    result = await store.run(inbox.enqueue_turn, agent, b"<task>x</task>", {"ref": 1})
    assert result.leased
    [row] = await store.run1(inbox.claim_due, agent, 5)
    return await store.run(turns.start_turn, row)


async def test_claims_skip_rows_another_transaction_holds(pg_url: str) -> None:
    store = _open(pg_url)
    try:
        token = await _running(store)
        await store.run(
            tools.suspend,
            token,
            (await store.run(turns.begin_step, token))[0],
            [ToolCallRecord("t1", "calc", "<add/>"), ToolCallRecord("t2", "calc", "<add/>")],
            [],
            resume_deadline=1e12,
        )
        first = await store.run(inbox.report_tool_result, "a", "t1", b"<sum>1</sum>", failed=False)
        await store.run(inbox.report_tool_result, "a", "t2", b"<sum>2</sum>", failed=False)
        with psycopg.connect(pg_url) as holder:
            holder.execute("SELECT 1 FROM agent_inbox WHERE inbox_id = %s FOR UPDATE", (first,))
            rows = await store.run1(inbox.claim_due, "a", 5)  # no wait: lock_timeout would fail it
            assert [r.correlation_id for r in rows] == ["t2"]
        rows = await store.run1(inbox.claim_due, "a", 5)
        assert [r.inbox_id for r in rows] == [first]
    finally:
        await store.aclose()


async def test_a_live_process_keeps_its_turns_a_dead_one_loses_them_fenced(pg_url: str) -> None:
    a, b = _open(pg_url), _open(pg_url)
    try:
        token = await _running(a)
        assert await b.recover_running() == []  # a's lease is live
        await a.run(turns.add_cards, token, [NewCard("sys.note", "still a's")])
        # a stops renewing (killed): once its lease is over, b takes the Turn over.
        _sql(pg_url, "UPDATE agentserver_processes SET lease_until = 0 WHERE owner = %s", a.owner)
        [taken] = await b.recover_running()
        assert taken.agent_turn_id == token.agent_turn_id
        assert taken.turn_epoch == token.turn_epoch + 1
        with pytest.raises(StaleTurn):
            await a.run(turns.add_cards, token, [NewCard("sys.note", "from the dead")])
        [resume] = await b.run1(inbox.claim_due, "a", 5)
        assert resume.message_type == "resume" and resume.turn_epoch == taken.turn_epoch
        assert await b.run(turns.take_resume, resume) == taken
        head = await b.read(sql_head.read, "a")
        assert (head.status, head.turn_epoch) == (HeadStatus.RUNNING, taken.turn_epoch)
        owners = [p[0] for p in await b.executor.run(processes, b.env)]
        assert owners == [b.owner]  # a's registration went with its Turns
        assert await b.reclaim() == []  # taken over once
    finally:
        await a.aclose()
        await b.aclose()


async def test_an_expired_lease_is_taken_over_and_tool_calls_time_out(pg_url: str) -> None:
    a = _open(pg_url, lease_s=0.3, heartbeat_s=0.1)
    b = _open(pg_url)
    try:
        token = await _running(a)
        step, _ = await a.run(turns.begin_step, token)
        await a.run(tools.suspend, token, step, [ToolCallRecord("t1", "calc", "<add/>")], [], 1e12)
        await a.run(inbox.ensure_agents, ["other"])
        await a.run(inbox.enqueue_turn, "other", b"<task/>", {"ref": 2})
        [claimed] = await a.run1(inbox.claim_due, "other", 5)  # a dies holding it in processing
        for _ in range(100):  # a's lease (0.3 s) runs out: b's reclaim takes over
            await b.reclaim()
            if _sql(pg_url, "SELECT 1 FROM agent_inbox WHERE message_type = 'timeout'"):
                break
            await trio.sleep(0.1)
        [(status,)] = _sql(
            pg_url, "SELECT status FROM agent_inbox WHERE inbox_id = %s", claimed.inbox_id
        )
        assert status == InboxStatus.PENDING
        [(corr, failed)] = _sql(
            pg_url, "SELECT correlation_id, failed FROM agent_inbox WHERE message_type = 'timeout'"
        )
        assert (corr, failed) == ("t1", 1)
    finally:
        a.close()
        await b.aclose()


async def test_serve_hands_a_dead_processs_suspended_turn_to_the_lost_calls_given(
    pg_url: str,
) -> None:
    """The lost-calls handler is given to the store's ``serve`` by the runtime that runs
    it (no callback set on the store): its heartbeat's takeover hands each suspended
    Turn of a dead process to it, and injects no timeout itself."""
    from agentserver.agents.doorbell import Doorbell

    a = _open(pg_url, lease_s=0.3, heartbeat_s=0.1)
    b = _open(pg_url, heartbeat_s=0.1)
    handed: list[tuple[str, str]] = []
    got = trio.Event()

    async def lost_calls(token: TurnToken, reason: str) -> int:
        handed.append((token.agent_turn_id, reason))
        got.set()
        return 0

    try:
        token = await _running(a)
        step, _ = await a.run(turns.begin_step, token)
        await a.run(tools.suspend, token, step, [ToolCallRecord("t1", "calc", "<add/>")], [], 1e12)
        async with trio.open_nursery() as nursery:  # a's lease (0.3 s) runs out
            await nursery.start(b.serve, Doorbell(), lost_calls)
            with trio.fail_after(20):
                await got.wait()
            nursery.cancel_scope.cancel()
        assert handed == [(token.agent_turn_id, "was lost with the process that sent it")]
        assert not _sql(pg_url, "SELECT 1 FROM agent_inbox WHERE message_type = 'timeout'")
    finally:
        a.close()
        await b.aclose()


async def test_a_clean_close_hands_over_at_once(pg_url: str) -> None:
    a, b = _open(pg_url), _open(pg_url)
    try:
        token = await _running(a)
    finally:
        await a.aclose()
    try:
        [taken] = await b.recover_running()
        assert taken.turn_epoch == token.turn_epoch + 1
    finally:
        await b.aclose()


async def test_a_takeover_warns_only_when_it_takes_work_over(pg_url: str, caplog) -> None:
    """A process that stopped cleanly with nothing in hand leaves nothing to take over:
    the next start says nothing; one that left a running Turn is named in a warning."""
    await _open(pg_url).aclose()
    b = _open(pg_url)
    try:
        with caplog.at_level("WARNING", logger="agentserver.agents.store.pg.store"):
            assert await b.recover_running() == []
        assert "took over" not in caplog.text
        c = _open(pg_url)
        await _running(c)
        await c.aclose()
        with caplog.at_level("WARNING", logger="agentserver.agents.store.pg.store"):
            assert len(await b.reclaim()) == 1
        assert "took over from 1 stopped process(es): 1 running turn(s)" in caplog.text
    finally:
        await b.aclose()


async def test_work_made_due_rings_every_process(pg_url: str) -> None:
    from agentserver.agents.doorbell import Doorbell

    a, b = _open(pg_url), _open(pg_url)
    bell = Doorbell()
    rings = 0

    class Counting(Doorbell):
        def ring(self) -> None:
            nonlocal rings
            rings += 1
            bell.ring()

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(b.serve, Counting())
            with trio.fail_after(10):
                await bell.wait()  # after connecting
                before = rings
                await a.run(inbox.ensure_agents, ["a"])
                await a.run(inbox.enqueue_turn, "a", b"<task/>", {"ref": 1})
                await bell.wait()
                assert rings == before + 1
            nursery.cancel_scope.cancel()
    finally:
        await a.aclose()
        await b.aclose()


async def _until(condition, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await trio.sleep(0.02)
    raise AssertionError("the condition did not become true in time")


async def test_alone_on_the_store_a_process_rings_itself_instead_of_notifying(
    pg_url: str,
) -> None:
    """While no other process holds a live lease, work made due rings this process's own
    doorbell and sends no NOTIFY; once another process is there (its lease seen at a
    heartbeat, or any notification heard) it notifies again."""
    from agentserver.agents.doorbell import Doorbell
    from agentserver.agents.store.pg.notify import WAKE_CHANNEL

    spy = psycopg.connect(pg_url, autocommit=True)
    spy.execute(f"LISTEN {WAKE_CHANNEL}")

    def heard() -> int:
        return sum(1 for _ in spy.notifies(timeout=0.3))

    a = _open(pg_url, heartbeat_s=0.1)
    bell = Doorbell()
    b = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve, bell)
            await a.run(inbox.ensure_agents, ["x", "y", "z"])
            assert a.others_alive is False
            with trio.fail_after(10):
                await bell.wait()  # the listener's first ring, after connecting
                await a.run(inbox.enqueue_turn, "x", b"<task/>", {"ref": 1})
                await bell.wait()  # rung at once, by the store itself
            assert await trio.to_thread.run_sync(heard) == 0
            b = _open(pg_url)  # another process: seen at a's next heartbeat
            await _until(lambda: a.others_alive)
            await a.run(inbox.enqueue_turn, "y", b"<task/>", {"ref": 2})
            assert await trio.to_thread.run_sync(heard) >= 1
            # alone again once b is gone; a notification heard ends it at once
            await b.aclose()
            b = None
            await _until(lambda: not a.others_alive)
            spy.execute(f"NOTIFY {WAKE_CHANNEL}")
            await _until(lambda: a.others_alive)
            nursery.cancel_scope.cancel()
    finally:
        spy.close()
        if b is not None:
            await b.aclose()
        await a.aclose()
