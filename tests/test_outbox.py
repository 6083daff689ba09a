"""The durable outbox (agents/store/outbox.py) and its sender (agents/edge/outbox.py), on
every store (``sqlite`` always, ``postgresql`` when a server is reachable), against real
HTTP receivers on loopback (tests/hookrecv.py): at least once, the same id on every
attempt, backoff, a hanging or dead receiver holding back no other, two senders sharing
a store never delivering a row twice at once."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from hookrecv import Receiver

from agentserver.agents.clock import ManualClock, SystemClock
from agentserver.agents.edge.hooksign import new_secret, secret_bytes
from agentserver.agents.edge.outbox import Channel, Outbox, backoff
from agentserver.agents.edge.webhook_events import render_signed
from agentserver.agents.edge.webhooks import WebhookDirectory, Webhooks
from agentserver.agents.errors import StoreInUse
from agentserver.agents.events import EventBus
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.profile.webhooks import WebhookSpec
from agentserver.agents.store import outbox as store_outbox
from agentserver.agents.store.outbox import (
    DISABLED,
    EXPIRED,
    PENDING,
    OutboxItem,
    delivery_id,
)
from agentserver.agents.store.sql import inbox, turn_end, turns
from agentserver.agents.store.sql_store import SqlAgentStore

pytestmark = [pytest.mark.socket, pytest.mark.database]

SECRET = new_secret()


def signed(name: str, **kw: Any) -> Channel:
    """A channel whose attempts are signed the Standard Webhooks way (as webhooks')."""
    return Channel(name, render=render_signed(secret_bytes(SECRET)), **kw)


def built_webhooks(store: Any, bus: EventBus, specs: tuple[WebhookSpec, ...] = ()) -> Webhooks:
    """Webhooks built as the composition root builds them: the directory, the outbox
    given it, then the webhooks given both."""
    directory = WebhookDirectory(store, bus)
    outbox = Outbox(store, store.env.clock.now, directory=directory)
    return Webhooks(store, directory, outbox, bus, store.env.clock.now, specs)


def verify(got: Any) -> dict[str, Any]:
    """The payload, verified by the maintained Standard Webhooks implementation."""
    from standardwebhooks.webhooks import Webhook

    return Webhook(SECRET).verify(got.body, got.headers)


Opener = Callable[[], Awaitable[SqlAgentStore]]


def _opener_fixture(
    clock_factory: Callable[[pytest.FixtureRequest], Any],
    stores: tuple[str, ...] = ("sqlite", "postgresql"),
) -> Any:
    @pytest.fixture(params=stores)
    async def fixture(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[Opener]:
        clock = clock_factory(request)
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

    return fixture


class FollowsMockClock:
    """A store clock that is the test's ``MockClock`` plus an offset: the sender's sleeps
    and the store's due times move together in virtual time. Read from any thread (the
    PostgreSQL store's calls run on worker threads)."""

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self._clock = clock

    def now(self) -> float:
        return 1_700_000_000.0 + self._clock.current_time()


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


manual = _opener_fixture(lambda _request: ManualClock(1000.0))
real = _opener_fixture(lambda _request: SystemClock())
#: The test must ask for ``autojump_clock`` too (pytest-trio runs it on that clock).
#: SQLite only: its calls run on the trio thread, so virtual time moves only when the
#: sender waits (PostgreSQL's calls wait on worker threads, and autojump would move time
#: during each). The store's part of an expiry is checked on both stores above.
virtual = _opener_fixture(
    lambda request: FollowsMockClock(request.getfixturevalue("autojump_clock")), ("sqlite",)
)


def item(n: int, channel: str = "c1", url: str = "http://127.0.0.1:9/x", **kw: Any) -> OutboxItem:
    return OutboxItem(
        channel=channel,
        url=url,
        body=b'{"n":%d}' % n,
        dedupe_key=f"{channel}:{n}",
        order_key=kw.pop("order_key", f"{channel}|conv"),
        **kw,
    )


async def test_store_rows_dedupe_sequence_lease_and_outcomes(manual: Opener) -> None:
    store = await manual()
    clock = store.env.clock
    assert await store.run(store_outbox.enqueue, [item(1), item(2), item(3)]) == 3
    # The same keys again add nothing (a producer not sure it enqueued may enqueue again).
    assert await store.run(store_outbox.enqueue, [item(2), item(3)]) == 0
    rows = await store.run(store_outbox.claim, "p1", 60.0, 10)
    assert [r.order_seq for r in rows] == [1, 2, 3]
    assert [r.delivery_id for r in rows] == [delivery_id(f"c1:{n}") for n in (1, 2, 3)]
    assert rows[0].delivery_id.startswith("msg_")
    # Leased: nobody else claims them until the lease runs out.
    assert await store.run(store_outbox.claim, "p2", 60.0, 10) == []
    await store.run(store_outbox.release, [rows[2].seq], "p1")
    [again] = await store.run(store_outbox.claim, "p2", 60.0, 10)
    assert again.seq == rows[2].seq
    clock.advance(61)
    # Every lease ran out: all three are claimable again (the same rows, the same ids).
    assert [r.delivery_id for r in await store.run(store_outbox.claim, "p2", 60.0, 10)] == [
        r.delivery_id for r in rows
    ]
    await store.run(store_outbox.delivered, [(rows[0].seq, "c1", 204)])
    disabled = await store.run(
        store_outbox.failed, rows[1].seq, "c1", "HTTP 500", 500, clock.now() + 30, None
    )
    assert not disabled
    await store.run(store_outbox.failed, rows[2].seq, "c1", "refused", None, None, None)
    figures = {f.channel: f for f in await store.read(store_outbox.figures)}["c1"]
    assert (figures.pending, figures.delivered, figures.expired) == (1, 1, 1)
    assert figures.failing_since is not None and figures.last_error == "refused"
    # The retry is due 30 s later, with its attempt counted.
    clock.advance(29)
    assert await store.run(store_outbox.claim, "p1", 60.0, 10) == []
    clock.advance(2)
    [retry] = await store.run(store_outbox.claim, "p1", 60.0, 10)
    assert (retry.seq, retry.attempts) == (rows[1].seq, 1)
    # Sequence numbers continue past pruned rows (a counter, not a max).
    await store.run(store_outbox.delivered, [(retry.seq, "c1", 200)])
    clock.advance(10)
    assert await store.run(store_outbox.prune, 5.0) == 3
    await store.run(store_outbox.enqueue, [item(4)])
    [four] = await store.run(store_outbox.claim, "p1", 60.0, 10)
    assert four.order_seq == 4
    statuses = [d["status"] for d in await store.read(store_outbox.deliveries, "c1", 10)]
    assert statuses == [PENDING]
    # A key twice in one batch is one delivery; the sequence goes on without a gap.
    assert (
        await store.run(store_outbox.enqueue, [item(5), item(5), item(6, order_key="other")]) == 2
    )
    got = {d["id"]: d["sequence"] for d in await store.read(store_outbox.deliveries, None, 10)}
    assert got[delivery_id("c1:5")] == 5 and got[delivery_id("c1:6")] == 1


async def test_channel_disabled_after_failing_too_long_and_enabled_again(manual: Opener) -> None:
    store = await manual()
    clock = store.env.clock
    await store.run(store_outbox.enqueue, [item(1), item(2)])
    [r1, _r2] = await store.run(store_outbox.claim, "p", 60.0, 10)
    assert not await store.run(store_outbox.failed, r1.seq, "c1", "x", None, clock.now() + 1, 100.0)
    clock.advance(101)
    [r1] = await store.run(store_outbox.claim, "p", 60.0, 1)
    assert await store.run(store_outbox.failed, r1.seq, "c1", "x", None, clock.now() + 1, 100.0)
    # Once: the next failure does not disable it again.
    assert not await store.run(store_outbox.failed, r1.seq, "c1", "x", None, clock.now() + 1, 100.0)
    [f] = await store.read(store_outbox.figures)
    assert f.disabled_at is not None and f.pending == 0 and f.disabled_rows == 2
    # New rows of a disabled channel are parked too.
    await store.run(store_outbox.enqueue, [item(3)])
    assert await store.run(store_outbox.claim, "p", 60.0, 10) == []
    assert [d["status"] for d in await store.read(store_outbox.deliveries, None, 10)] == [
        DISABLED
    ] * 3
    assert await store.run(store_outbox.enable, "c1") == 3
    assert len(await store.run(store_outbox.claim, "p", 60.0, 10)) == 3
    [f] = await store.read(store_outbox.figures)
    assert f.disabled_at is None and f.failing_since is None
    assert {d["status"] for d in await store.read(store_outbox.deliveries, None, 10)} == {PENDING}


async def test_a_delivery_failing_past_its_retry_for_expires_and_is_not_tried_again(
    virtual: Opener, autojump_clock: trio.testing.MockClock
) -> None:
    """The sender gives a delivery up once its next retry would fall after ``retry_for``
    (``expires_at``): the row ends ``expired``, counted, and is never attempted again."""
    store = await virtual()
    clock = store.env.clock
    attempts: list[float] = []

    async def receiver_down(row: Any) -> None:
        attempts.append(clock.now())
        raise ConnectionRefusedError("receiver down")

    outbox = Outbox(store, clock.now, rand=lambda: 1.0)  # no jitter: full backoff
    outbox.add(Channel("down", check=receiver_down))
    async with trio.open_nursery() as nursery:
        await nursery.start(outbox.run)
        await outbox.enqueue(
            [item(1, "down", first_delay_s=1.0, max_delay_s=8.0, retry_for_s=30.0)]
        )
        # An hour of virtual time, a second at a time (no far deadline: autojump would
        # jump to it while every task waits on a store call's thread): retried for ever,
        # the row would still be pending.
        for _ in range(3600):
            if (await store.read(store_outbox.deliveries, "down", 10))[0]["status"] == EXPIRED:
                break
            await trio.sleep(1.0)
        else:
            pytest.fail(f"never expired: still pending after {len(attempts)} attempts")
        tried = len(attempts)
        for _ in range(600):  # ten minutes more: no attempt more
            await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert len(attempts) == tried
    # Backoff 1, 2, 4, 8, 8 s (each found up to a poll late): the sixth attempt's retry
    # (8 s on) is past the 30 s; the fifth's is not.
    [row] = await store.read(store_outbox.deliveries, "down", 10)
    since = [round(at - row["created_at"], 3) for at in attempts]
    assert 5 <= tried <= 6, since
    # Each attempt but the last was retried: its retry fell within the 30 s.
    assert all(at + 1.0 <= 30.0 for at in since[:-1]), since
    assert row["status"] == EXPIRED and row["attempts"] == tried
    [figures] = await store.read(store_outbox.figures)
    assert (figures.expired, figures.pending) == (1, 0)
    assert outbox.figures.expired == 1 and outbox.figures.failed == tried


def test_backoff_is_exponential_capped_and_jittered() -> None:
    assert backoff(1, 2.0, 60.0, lambda: 0.0) == 1.0
    assert backoff(1, 2.0, 60.0, lambda: 1.0) == 2.0
    assert backoff(4, 2.0, 60.0, lambda: 1.0) == 16.0
    assert backoff(30, 2.0, 60.0, lambda: 1.0) == 60.0
    assert 30.0 <= backoff(500, 2.0, 60.0, lambda: 0.5) <= 60.0


async def wait_for(cond: Callable[[], bool], within: float = 20.0) -> None:
    """Poll ``cond`` (a receiver's thread changes what it reads) until true."""
    with trio.fail_after(within):
        while True:
            if cond():
                return
            await trio.sleep(0.02)


async def test_receiver_failing_its_first_five_gets_each_once_with_its_id(real: Opener) -> None:
    store = await real()
    flaky = Receiver(fail_first=5).start()
    try:
        outbox = Outbox(store, store.env.clock.now)
        outbox.add(signed("flaky", timeout_s=5.0))
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            items = [
                item(n, "flaky", flaky.url, first_delay_s=0.02, max_delay_s=0.1) for n in range(3)
            ]
            await outbox.enqueue(items)
            await wait_for(lambda: len(flaky.ok()) >= 3 and outbox.figures.delivered >= 3)
            with trio.fail_after(10):  # the deliveries recorded (in a batch, a moment later)
                while True:
                    [f] = await store.read(store_outbox.figures)
                    if f.delivered == 3:
                        break
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
        assert len(flaky.got) == 8
        ids = {delivery_id(i.dedupe_key) for i in items}
        assert flaky.ids() == ids
        for got in flaky.got:
            assert verify(got)["n"] in (0, 1, 2)
        # Every attempt carried its row's id: the failed ones were retried with the same.
        assert {g.id for g in flaky.got} == ids
        assert outbox.figures.failed == 5 and outbox.figures.delivered == 3
        [f] = await store.read(store_outbox.figures)
        assert f.delivered == 3 and f.failing_since is None
    finally:
        flaky.stop()


async def test_hanging_receiver_holds_back_no_other(real: Opener) -> None:
    store = await real()
    hung = Receiver(hang=True, hang_s=10.0).start()
    good = Receiver().start()
    try:
        outbox = Outbox(store, store.env.clock.now)
        outbox.add(signed("hung", concurrency=2, timeout_s=3.0))
        outbox.add(signed("good", concurrency=2, timeout_s=5.0))
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            await outbox.enqueue([item(n, "hung", hung.url, first_delay_s=5.0) for n in range(10)])
            await trio.sleep(0.2)
            start = trio.current_time()
            await outbox.enqueue([item(n, "good", good.url) for n in range(20)])
            await wait_for(lambda: len(good.ok()) == 20, within=10.0)
            # The good receiver got everything while the hung one held its two slots
            # (held back, it would wait for the hung one's 10 attempts: 5 x 3 s).
            assert trio.current_time() - start < 6.0
            assert outbox.inflight("hung") <= 2
            await wait_for(lambda: outbox.figures.failed >= 2, within=10.0)
            # The sender counts a failure before its store write lands (on PostgreSQL a
            # thread hop later): wait, bounded, for the store to show it before stopping.
            with trio.fail_after(10.0):
                while True:
                    figures = {f.channel: f for f in await store.read(store_outbox.figures)}
                    if figures["hung"].last_error is not None:
                        break
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        figures = {f.channel: f for f in await store.read(store_outbox.figures)}
        assert figures["hung"].last_error == "timed out after 3s"
        assert figures["hung"].pending == 10
    finally:
        hung.stop()
        good.stop()


async def test_receiver_killed_and_restarted_loses_nothing(real: Opener) -> None:
    store = await real()
    recv = Receiver().start()
    try:
        outbox = Outbox(store, store.env.clock.now)
        outbox.add(signed("r", timeout_s=2.0))
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            await outbox.enqueue(
                [item(n, "r", recv.url, first_delay_s=0.05, max_delay_s=0.3) for n in range(5)]
            )
            await wait_for(lambda: len(recv.ok()) == 5)
            recv.stop()  # killed: connections refused
            await outbox.enqueue(
                [item(n, "r", recv.url, first_delay_s=0.05, max_delay_s=0.3) for n in range(5, 10)]
            )
            await wait_for(lambda: outbox.figures.failed >= 5)
            recv.start()  # the same port again
            await wait_for(lambda: len(recv.ok()) == 10)
            nursery.cancel_scope.cancel()
        assert recv.ids() == {delivery_id(f"r:{n}") for n in range(10)}
    finally:
        recv.stop()


async def test_two_senders_on_one_store_never_deliver_a_row_twice(real: Opener) -> None:
    first = await real()
    try:
        second = await real()  # a second process's connections to the same store
    except StoreInUse:
        second = first  # SQLite: one process per file; two senders in it
    recv = Receiver().start()
    try:
        a = Outbox(first, first.env.clock.now)
        b = Outbox(second, second.env.clock.now)
        for outbox in (a, b):
            outbox.add(signed("r", concurrency=8, timeout_s=5.0))
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            await a.enqueue([item(n, "r", recv.url, order_key=f"k{n % 7}") for n in range(60)])
            await b.enqueue([item(n, "r", recv.url) for n in range(60, 120)])
            await wait_for(lambda: len(recv.ok()) >= 120)
            await trio.sleep(0.3)
            nursery.cancel_scope.cancel()
        assert len(recv.got) == 120  # each once: a row is claimed by one sender
        assert len(recv.ids()) == 120
        assert a.figures.delivered + b.figures.delivered == 120
    finally:
        recv.stop()


async def test_a_task_end_lost_before_its_write_is_offered_again_at_start(real: Opener) -> None:
    """A process killed between a Turn's end and the write of its event: the next start's
    sweep finds the Turn's deliverable and enqueues the event (once: its key)."""
    from agentserver.agents.events import EventBus
    from agentserver.agents.ports import LLMCompletion, LLMUsage
    from agentserver.agents.profile.webhooks import WebhookSpec
    from agentserver.agents.store.base import CardType, NewCard, TaskStatus

    store = await real()
    await store.run(inbox.enqueue_turn, "assistant", b"<t/>", {"caller_thread": "th-1"})
    [row] = await store.run1(inbox.claim_due, "assistant", 5)
    token = await store.run(turns.start_turn, row)
    step_id, _ = await store.run(turns.begin_step, token)
    usage = LLMUsage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    completion = LLMCompletion("done", usage=usage, cost=0.0, model="m", backend="b")
    await store.run(
        turns.complete_step, token, step_id, completion, [NewCard(CardType.LLM_MESSAGE, "x")]
    )
    await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "the answer", {}, b"<a/>")
    recv = Receiver().start()
    try:
        for _ in range(2):  # two starts: the second finds the event there already
            spec = WebhookSpec("w", recv.url, ("task.succeeded",), SECRET, first_delay_s=0.05)
            hooks = built_webhooks(store, EventBus(), (spec,))
            async with trio.open_nursery() as nursery:
                await nursery.start(hooks.run)
                await wait_for(lambda: len(recv.ok()) >= 1)
                await trio.sleep(0.3)
                nursery.cancel_scope.cancel()
        [got] = recv.ok()
        payload = verify(got)
        assert payload["type"] == "task.succeeded"
        assert payload["data"]["turn"] == token.agent_turn_id
        assert payload["data"]["thread"] == "th-1" and payload["data"]["answer"] == "the answer"
    finally:
        recv.stop()


async def test_a_task_end_another_process_lost_is_offered_while_running(real: Opener) -> None:
    """Another process ended a Turn and was killed before it wrote the event (and never
    started again, so no start-up sweep of its own): a running process's periodic sweep
    finds the end with nothing in the outbox and delivers it, once; later sweeps find
    it there and offer nothing."""
    from agentserver.agents.events import EventBus
    from agentserver.agents.ports import LLMCompletion, LLMUsage
    from agentserver.agents.store.base import CardType, NewCard, TaskStatus

    store = await real()
    recv = Receiver().start()
    try:
        spec = WebhookSpec("w", recv.url, ("task.succeeded",), SECRET, first_delay_s=0.05)
        directory = WebhookDirectory(store, EventBus())
        outbox = Outbox(store, store.env.clock.now, directory=directory)
        hooks = Webhooks(
            store,
            directory,
            outbox,
            EventBus(),
            store.env.clock.now,
            (spec,),
            resweep_every_s=0.1,
            resweep_grace_s=0.05,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(hooks.run)
            # The other process's Turn, ended in the store; its event never published.
            await store.run(inbox.enqueue_turn, "assistant", b"<t/>", {"caller_thread": "th-2"})
            [row] = await store.run1(inbox.claim_due, "assistant", 5)
            token = await store.run(turns.start_turn, row)
            step_id, _ = await store.run(turns.begin_step, token)
            usage = LLMUsage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
            done = LLMCompletion("done", usage=usage, cost=0.0, model="m", backend="b")
            await store.run(
                turns.complete_step, token, step_id, done, [NewCard(CardType.LLM_MESSAGE, "x")]
            )
            await store.run(turn_end.finish, token, TaskStatus.SUCCEEDED, "the answer", {}, b"<a/>")
            await wait_for(lambda: len(recv.ok()) >= 1)
            swept = hooks.swept
            await trio.sleep(0.6)  # several sweeps more: the event is in the outbox now
            nursery.cancel_scope.cancel()
        [got] = recv.ok()
        assert verify(got)["data"]["turn"] == token.agent_turn_id
        assert swept == hooks.swept == 1
    finally:
        recv.stop()


async def test_no_webhook_costs_nothing_and_the_first_one_made_starts_them(real: Opener) -> None:
    from agentserver.agents.events import EventBus, TaskEvent
    from agentserver.agents.profile.webhooks import WebhookSpec

    store = await real()
    bus = EventBus()
    recv = Receiver().start()
    try:
        hooks = built_webhooks(store, bus)
        async with trio.open_nursery() as nursery:
            await nursery.start(hooks.run)
            bus.publish(TaskEvent("a", "turn-0", "succeeded", "", ""))
            await trio.sleep(0.2)
            assert not hooks.observing and await store.read(store_outbox.figures) == []
            spec = WebhookSpec("late", recv.url, ("task.*",), first_delay_s=0.05)
            made = await hooks.create(spec)
            assert made.secret.startswith("whsec_") and hooks.observing
            bus.publish(TaskEvent("a", "turn-1", "failed", "", ""))
            await wait_for(lambda: len(recv.ok()) == 1)
            nursery.cancel_scope.cancel()
        assert recv.ok()[0].payload["data"]["turn"] == "turn-1"
    finally:
        recv.stop()


async def test_a_receiver_failing_too_long_is_disabled_with_an_event(real: Opener) -> None:
    from agentserver.agents.events import EventBus, NoticeEvent, TaskEvent
    from agentserver.agents.profile.webhooks import WebhookSpec

    store = await real()
    bus = EventBus()
    dead = Receiver().start()
    dead.stop()  # nothing listens on its port: refused
    watcher = Receiver().start()
    try:
        specs = (
            WebhookSpec(
                "dead", dead.url, ("task.*",), SECRET, first_delay_s=0.05, max_delay_s=0.1,
                disable_after_s=0.5,
            ),
            WebhookSpec("watch", watcher.url, ("webhook.disabled",), SECRET, first_delay_s=0.05),
        )  # fmt: skip
        hooks = built_webhooks(store, bus, specs)
        async with bus.subscribe() as sub:
            async with trio.open_nursery() as nursery:
                await nursery.start(hooks.run)
                bus.publish(TaskEvent("a", "turn-1", "failed", "", ""))
                await wait_for(lambda: len(watcher.ok()) == 1)
                [state] = [w for w in await hooks.status() if w["name"] == "dead"]
                assert state["disabled"] and state["disabled_rows"] == 1
                # Enabled again: the parked event is due (and fails again: refused).
                assert await hooks.enable("dead") == 1
                nursery.cancel_scope.cancel()
            notices = [e for e in sub.drain() if isinstance(e, NoticeEvent)]
        assert [n.event_type for n in notices] == ["webhook.disabled"]
        assert notices[0].data["webhook"] == "dead"
        assert verify(watcher.ok()[0])["type"] == "webhook.disabled"
    finally:
        watcher.stop()


async def test_a_disable_whose_event_was_lost_is_announced_at_start_once(real: Opener) -> None:
    """A process killed after the sender committed a disable and before its
    ``webhook.disabled`` was written: the next start offers it (keyed by the disable's
    time in the store), and a start after that adds nothing."""
    from agentserver.agents.edge.webhooks import channel_name
    from agentserver.agents.events import EventBus
    from agentserver.agents.profile.webhooks import WebhookSpec
    from agentserver.agents.store.outbox import OutboxItem

    store = await real()
    watcher = Receiver().start()
    try:
        dead = channel_name("dead")
        # The disable, committed with no Webhooks running to announce it (the "crash").
        await store.run(
            store_outbox.enqueue, [OutboxItem(dead, "http://127.0.0.1:9/", b"{}", "k1")]
        )
        [row] = await store.run(store_outbox.claim, "me", 30.0, 10)
        assert await store.run(store_outbox.failed, row.seq, dead, "refused", None, None, 0.0)
        specs = (
            WebhookSpec("dead", "http://127.0.0.1:9/", ("task.*",), SECRET),
            WebhookSpec("watch", watcher.url, ("webhook.disabled",), SECRET, first_delay_s=0.05),
        )
        for _start in range(2):
            hooks = built_webhooks(store, EventBus(), specs)
            async with trio.open_nursery() as nursery:
                await nursery.start(hooks.run)
                await wait_for(lambda: len(watcher.ok()) >= 1)
                await trio.sleep(0.3)  # time for a second delivery, were there one
                nursery.cancel_scope.cancel()
            await hooks.drain()
        assert len(watcher.ok()) == 1
        event = verify(watcher.ok()[0])
        assert event["type"] == "webhook.disabled" and event["data"]["webhook"] == "dead"
    finally:
        watcher.stop()


async def test_a_family_makes_a_channel_per_receiver_and_checks_each_attempt(
    real: Opener,
) -> None:
    """Channels made on demand by prefix (A2A push: one per receiver), each attempt
    checked first: a refused check is a failed attempt, retried with the same id."""
    store = await real()
    one, two = Receiver().start(), Receiver().start()
    checked: list[str] = []
    try:
        outbox = Outbox(store, store.env.clock.now)

        async def check(row: Any) -> None:
            checked.append(row.delivery_id)
            if len(checked) == 1:
                raise ValueError("not yet")

        outbox.add_family("fam:", lambda name: Channel(name, concurrency=1, check=check))
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            fast = {"first_delay_s": 0.02, "max_delay_s": 0.1}
            await outbox.enqueue(
                [item(0, "fam:one", one.url, **fast), item(1, "fam:two", two.url, **fast)]
            )
            # The sender counts a delivery once the receiver's answer is read, which may
            # come after the receiver recorded it: wait for the figure too.
            await wait_for(
                lambda: len(one.ok()) == 1 and len(two.ok()) == 1 and outbox.figures.delivered == 2
            )
            nursery.cancel_scope.cancel()
        assert outbox.channel("fam:one") is not None and outbox.channel("fam:two") is not None
        assert len(checked) == 3 and len(set(checked)) == 2  # the refused one, again
        assert outbox.figures.failed == 1 and outbox.figures.delivered == 2
    finally:
        one.stop()
        two.stop()


async def test_a_webhook_another_process_made_is_resolved_by_the_outbox(real: Opener) -> None:
    """The outbox asks the directory it was built with for a channel it does not know:
    a webhook made at run time by another process (here: its Webhooks, on the same
    store) is loaded from the store and its rows delivered, signed with its secret."""
    from agentserver.agents.edge.webhooks import channel_name

    store = await real()
    recv = Receiver().start()
    try:
        maker = built_webhooks(store, EventBus())
        spec = WebhookSpec("late", recv.url, ("task.*",), SECRET, first_delay_s=0.05)
        await maker.create(spec)  # durable; this directory alone knows it
        directory = WebhookDirectory(store, EventBus())
        outbox = Outbox(store, store.env.clock.now, directory=directory)
        assert "late" not in directory and outbox.channel(channel_name("late")) is None
        await store.run(store_outbox.enqueue, [item(7, channel_name("late"), recv.url)])
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            await wait_for(lambda: len(recv.ok()) == 1)
            nursery.cancel_scope.cancel()
        assert verify(recv.ok()[0])["n"] == 7  # signed with the secret the store keeps
        assert "late" in directory and outbox.channel(channel_name("late")) is not None
    finally:
        recv.stop()
