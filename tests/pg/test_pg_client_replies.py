"""Replies to named clients across processes on one PostgreSQL store: a reply kept by
one process reaches the client's connection held by another (NOTIFY, then that process
offers what is kept), once."""

from __future__ import annotations

import trio

from agentserver.agents.doorbell import Doorbell
from agentserver.agents.edge.named_clients import NamedClientReplies, forward_kept
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.pg.store import PostgresAgentStore
from agentserver.agents.store.sql import replies


class Link:
    """A connection of ``alice`` held by process A (what the server's ClientLink does)."""

    identity = "alice"
    endpoint_name = "alice"
    acks = False
    input_open = True

    def __init__(self) -> None:
        self.got: list[tuple[int, bytes]] = []
        self.arrived = trio.Event()

    def offer(self, reply_id: int, body: bytes) -> bool:
        self.got.append((reply_id, body))
        self.arrived.set()
        return True


async def test_a_reply_kept_by_one_process_reaches_the_connection_on_another(pg_url):
    settings = StoreSettings(url=pg_url)
    a = PostgresAgentStore.open(pg_url, settings=settings)
    b = PostgresAgentStore.open(pg_url, settings=settings)
    clients_a = NamedClientReplies(a, ["alice"])
    link = Link()
    await clients_a.attach(link)
    assert link.got == []
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve, Doorbell())
            nursery.start_soon(forward_kept, a.client_replies, clients_a)
            reply_id = await b.run(
                replies.record_client_reply, "alice", {"thread": "t1"}, b"<answer/>", failed=False
            )
            with trio.fail_after(10):
                await link.arrived.wait()
            assert link.got == [(reply_id, b"<answer/>")]
            # Later rings (the 1 s poll, other replies) do not offer it again.
            link.arrived = trio.Event()
            second = await b.run(
                replies.record_client_reply, "alice", {"thread": "t2"}, b"<b/>", failed=False
            )
            with trio.fail_after(10):
                await link.arrived.wait()
            assert [r for r, _ in link.got] == [reply_id, second]
            nursery.cancel_scope.cancel()
    finally:
        await a.aclose()
        await b.aclose()
