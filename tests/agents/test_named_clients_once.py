"""A named client's reply reaches her connection once, while the paths that offer it
race (issue 25, item 1: byte-identical answers twice on PostgreSQL).

In one process two paths offer a kept reply: ``deliver`` right after keeping it, and the
flush of what the store holds (on PostgreSQL woken by every keep, this process's own
included, and every second). The store here is the real one (SQLite and PostgreSQL),
with gates where the races happen: an acknowledgement that commits only when the test
says, a read of kept replies that returns its rows only when the test says, and a hook
after a keep commits (what this process's own NOTIFY sets off). A connection without acks
receives a reply as it is written; one with acks when she acknowledges it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import trio
import trio.testing
from lxml import etree

from agentserver.agents.edge import named_clients
from agentserver.agents.edge.bridge import PumpPorts
from agentserver.agents.edge.named_clients import NamedClientReplies
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.sql import replies
from agentserver.agents.store.sql_store import SqlAgentStore
from agentserver.core.threads import new_thread_id
from agentserver.pump.pump import open_pump

BODY = b'<answer xmlns="urn:test:once"><text>done</text></answer>'


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[SqlAgentStore]:
    settings = StoreSettings(path=tmp_path / "agents.sqlite3")
    if request.param == "sqlite":
        from agentserver.agents.store.sqlite_store import SqliteAgentStore

        s: SqlAgentStore = SqliteAgentStore.open(settings.path, settings=settings)
    else:
        from agentserver.agents.store.pg.store import PostgresAgentStore

        url = request.getfixturevalue("pg_url")  # skips when no server is reachable
        opened = PostgresAgentStore.open(url, settings=settings)
        s = await opened if inspect.isawaitable(opened) else opened
    try:
        yield s
    finally:
        await s.aclose()


class Gated:
    """The store, with gates where the races happen (each off until set)."""

    def __init__(self, store: SqlAgentStore) -> None:
        self.store = store
        #: An acknowledgement commits only once this is set.
        self.ack_gate: trio.Event | None = None
        self.acked = trio.Event()
        #: A read of kept replies has its rows (set), then returns them once this is set.
        self.read_gate: trio.Event | None = None
        self.read_has_rows = trio.Event()
        #: Awaited after a keep committed, before the keeper goes on.
        self.after_keep: Callable[[], Awaitable[Any]] | None = None

    @contextlib.contextmanager
    def opened_at_exit(self) -> Iterator[None]:
        """The gates open when the block ends, however it ends: a receipt without acks
        is taken shielded from cancel (agents/edge/named_clients.py), so a test failing
        while one waits at a gate would otherwise wait for ever."""
        try:
            yield
        finally:
            for gate in (self.ack_gate, self.read_gate):
                if gate is not None:
                    gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def run1(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn is replies.ack_client_replies or fn is replies.take_client_reply:
            # an acknowledgement, or the receipt committed before the write
            if self.ack_gate is not None:
                await self.ack_gate.wait()
            done = await self.store.run1(fn, *args, **kwargs)
            self.acked.set()
            return done
        return await self.store.run1(fn, *args, **kwargs)

    async def read(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        rows = await self.store.read(fn, *args, **kwargs)
        if fn is replies.pending_client_replies and self.read_gate is not None and rows:
            self.read_has_rows.set()
            await self.read_gate.wait()
        return rows

    async def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        done = await self.store.run(fn, *args, **kwargs)
        if fn is replies.record_client_reply and self.after_keep is not None:
            await self.after_keep()
        return done


class Link:
    """A connection of ``alice`` (the server's ClientLink): each reply offered is written
    at once (without acks, received); with acks she acknowledges when the test says."""

    identity = "alice"
    endpoint_name = "alice"
    input_open = True

    def __init__(self, acks: bool) -> None:
        self.acks = acks
        #: The reply ids of the frames written to her, in order: a repeat is a duplicate.
        self.frames: list[int] = []
        #: Set at the second frame.
        self.repeated = trio.Event()

    def offer(self, reply_id: int, body: bytes) -> bool:
        self.frames.append(reply_id)
        if len(self.frames) > 1:
            self.repeated.set()
        return True


async def first_of(*events: trio.Event) -> None:
    """Until one of ``events`` is set."""
    async with trio.open_nursery() as nursery:
        for event in events:

            async def wait(event: trio.Event = event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait)


@pytest.mark.parametrize("acks", [False, True], ids=["no-acks", "acks"])
@pytest.mark.parametrize("commit", ["after-the-flush", "during-the-read"])
async def test_a_flush_does_not_offer_again_a_reply_whose_receipt_is_committing(
    store, acks, commit
):
    """Race (a): the reply's receipt (without acks, taken before it is written; with
    acks, her acknowledgement) is still committing while this process's flusher reads
    what is kept: the read still shows the reply; it must not be offered again."""
    gated = Gated(store)
    clients = NamedClientReplies(gated, ["alice"])
    link = Link(acks)
    await clients.attach(link)
    reply_id = await gated.run(replies.record_client_reply, "alice", {"t": 1}, BODY, failed=False)
    gated.ack_gate = trio.Event()
    if commit == "during-the-read":
        gated.read_gate = trio.Event()
    async with trio.open_nursery() as nursery:
        with gated.opened_at_exit():
            if acks:
                assert await clients.deliver("alice", reply_id, BODY)
                nursery.start_soon(clients.received, link, [reply_id])  # her <ack>
            else:
                # Without acks the receipt commits first, and the reply is written after it.
                nursery.start_soon(clients.deliver, "alice", reply_id, BODY)
            await trio.testing.wait_all_tasks_blocked()  # at the gate: committing
            assert link.frames == ([reply_id] if acks else [])
            if commit == "after-the-flush":
                flushed = trio.Event()

                async def flush() -> None:
                    await clients.flush_all()
                    flushed.set()

                nursery.start_soon(flush)
                # Done, or offered it again (then it may wait for its own ack at the gate).
                await first_of(flushed, link.repeated)
                gated.ack_gate.set()
            else:
                nursery.start_soon(clients.flush_all)
                await gated.read_has_rows.wait()  # the read saw the reply kept ...
                gated.ack_gate.set()
                await gated.acked.wait()  # ... the receipt committed, then the flush goes on
                assert gated.read_gate is not None
                gated.read_gate.set()
    assert link.frames == [reply_id]
    assert await store.read(replies.pending_client_replies, "alice") == []
    # The next flush (the poll) finds nothing either.
    gated.read_gate = None
    assert await clients.flush_all() == 0
    assert link.frames == [reply_id]


@pytest.mark.parametrize("received", ["written", "offered", "acknowledged"])
async def test_deliver_does_not_offer_again_a_reply_the_flusher_offered(store, received):
    """Race (b): keeping the reply woke this process's flusher, which offered it (and,
    written or acknowledged, saw it received) before ``deliver`` ran: one frame."""
    gated = Gated(store)
    link = Link(acks=received != "written")
    async with open_pump() as pump:
        ports = PumpPorts(pump, store=gated, named_clients=["alice"])  # type: ignore[arg-type]
        clients = ports.clients
        assert clients is not None
        await clients.attach(link)

        async def flusher() -> None:
            assert clients is not None
            assert await clients.flush_all() == 1
            if received == "acknowledged":
                await clients.received(link, list(link.frames))

        gated.after_keep = flusher
        ref = {
            "hop": new_thread_id(),
            "caller_thread": new_thread_id(),
            "chain": ["alice", "assistant"],
            "client": "alice",
        }
        await ports.deliver(ref, etree.fromstring(BODY), failed=False, turn_id="turn-1")
    assert len(link.frames) == 1, link.frames
    kept = await store.read(replies.pending_client_replies, "alice")
    assert [r.reply_id for r in kept] == ([] if received != "offered" else link.frames)


async def test_a_reply_written_without_acks_is_not_written_again_after_a_crash(store):
    """The double answer of the 30-minute soak (seed 4302, PostgreSQL, two processes): a
    no-ack client's reply was written to her connection, then the process was SIGKILLed
    before its receipt committed (the receipt's transaction waited behind a deadlock for
    two seconds). The store still kept the reply, and her next connection was handed it
    again. Here the receipt stalls at its gate and the process is left there, as a kill
    leaves it; her next connection is on a new process on the same store. She gets the
    reply once: the receipt now commits before the reply is written, so a process killed
    before it commits has written nothing."""
    gated = Gated(store)
    killed = NamedClientReplies(gated, ["alice"])
    link = Link(acks=False)
    await killed.attach(link)
    reply_id = await gated.run(replies.record_client_reply, "alice", {"t": 1}, BODY, failed=False)
    gated.ack_gate = trio.Event()
    async with trio.open_nursery() as nursery:
        with gated.opened_at_exit():
            nursery.start_soon(killed.deliver, "alice", reply_id, BODY)
            await trio.testing.wait_all_tasks_blocked()  # its receipt at the gate
            restarted = NamedClientReplies(store, ["alice"])
            again = Link(acks=False)
            await restarted.attach(again)  # her next connection: what is kept is handed over
            assert link.frames + again.frames == [reply_id]
            # A process only stalled (not killed) that goes on writes it no more either.
            gated.ack_gate.set()
    assert link.frames + again.frames == [reply_id]
    assert await store.read(replies.pending_client_replies, "alice") == []


def test_receipts_are_forgotten_once_no_read_that_began_before_them_is_in_flight(
    monkeypatch,
):
    """The memory that stops both races is bounded: a committed receipt is kept only
    while a read or keep that began before it is in flight, and never more than
    MAX_REMEMBERED of them."""
    from agentserver.agents.edge.named_clients import _Receipts

    receipts = _Receipts()
    with receipts.busy():  # a read in flight ...
        receipts.committing("alice", [1, 2])
        assert ("alice", 1) in receipts and ("bob", 1) not in receipts
        receipts.committed("alice", [1, 2])
        with receipts.busy():  # ... and a later one
            receipts.committing("alice", [3])
            receipts.committed("alice", [3])
        assert ("alice", 1) in receipts and ("alice", 3) in receipts
    assert ("alice", 1) not in receipts and ("alice", 3) not in receipts
    receipts.committing("alice", [4])  # still committing: remembered, read or not
    with receipts.busy():
        pass
    assert ("alice", 4) in receipts
    receipts.committed("alice", [4])
    assert ("alice", 4) not in receipts
    monkeypatch.setattr(named_clients, "MAX_REMEMBERED", 10)
    with receipts.busy():  # a read that never ends does not pin more than the bound
        for rid in range(100, 130):
            receipts.committing("alice", [rid])
            receipts.committed("alice", [rid])
        assert len(receipts._held) == 10
        assert ("alice", 129) in receipts and ("alice", 119) not in receipts


class Leaving(Link):
    """A connection without acks whose end of input is read while the reply's receipt
    commits: it can no longer take the reply."""

    def offer(self, reply_id: int, body: bytes) -> bool:
        return False


async def test_a_reply_taken_for_a_connection_that_cannot_write_it_is_kept_again(store):
    """Taken out of the store for a connection that then cannot write it, the reply is
    kept again, with its id, and her next connection gets it once."""
    clients = NamedClientReplies(store, ["alice"])
    leaving = Leaving(acks=False)
    await clients.attach(leaving)
    first = await store.run(replies.record_client_reply, "alice", {"t": 1}, BODY, failed=False)
    second = await store.run(replies.record_client_reply, "alice", {"t": 2}, BODY, failed=False)
    assert not await clients.deliver("alice", first, BODY)
    kept = await store.read(replies.pending_client_replies, "alice")
    assert [r.reply_id for r in kept] == [first, second]  # in its place
    await clients.detach(leaving)
    again = Link(acks=False)
    await clients.attach(again)
    assert again.frames == [first, second]
    assert await store.read(replies.pending_client_replies, "alice") == []
