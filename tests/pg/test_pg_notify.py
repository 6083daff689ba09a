"""PgListener against a real server: a committed NOTIFY rings, a rolled-back one does
not, the slow poll rings without any, and a lost connection is re-established."""

from __future__ import annotations

import psycopg
import pytest
import trio

from agentserver.agents.doorbell import Doorbell
from agentserver.agents.store.pg.executor import PgExecutor
from agentserver.agents.store.pg.notify import PgListener, notify


class Rings:
    def __init__(self) -> None:
        self.count = 0
        self.bell = Doorbell()

    def __call__(self) -> None:
        self.count += 1
        self.bell.ring()

    async def next(self) -> int:
        await self.bell.wait()
        return self.count


async def test_a_committed_notify_rings_and_a_rolled_back_one_does_not(pg_url: str) -> None:
    wake, other = Rings(), Rings()
    listener = PgListener(pg_url, {"wake": wake, "other": other}, poll_s=3600)
    ex = await PgExecutor.open(pg_url)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(listener.run)
            with trio.fail_after(10):
                assert await wake.next() == 1  # the ring after connecting
            other.bell = Doorbell()

            def rolled_back(tx) -> None:
                notify(tx, "wake")
                raise ValueError("rollback")

            with pytest.raises(ValueError):
                await ex.run(rolled_back)

            def twice(tx) -> None:
                notify(tx, "wake")
                notify(tx, "wake")  # merged by PostgreSQL within one transaction

            await ex.run(twice)
            with trio.fail_after(10):
                assert await wake.next() == 2
            assert listener.received == 1 and other.count == 1
            nursery.cancel_scope.cancel()
    finally:
        await ex.aclose()


async def test_the_slow_poll_rings_without_notifications(pg_url: str) -> None:
    wake = Rings()
    listener = PgListener(pg_url, {"wake": wake}, poll_s=0.05)
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.run)
        with trio.fail_after(10):
            while await wake.next() < 4:
                pass
        assert listener.received == 0
        nursery.cancel_scope.cancel()


async def test_a_lost_connection_is_re_established(pg_url: str) -> None:
    wake = Rings()
    listener = PgListener(pg_url, {"wake": wake}, poll_s=3600, reconnect_s=0.05)
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.run)
        with trio.fail_after(10):
            await wake.next()
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (listener.backend_pid,))
            with trio.fail_after(10):
                await wake.next()  # the ring after reconnecting
                assert listener.connections == 2
            admin.execute("NOTIFY wake")
            with trio.fail_after(10):
                await wake.next()
        assert listener.received == 1
        nursery.cancel_scope.cancel()


async def test_an_unreachable_server_keeps_ringing_as_a_poll(caplog) -> None:
    wake = Rings()
    listener = PgListener("postgresql://u@127.0.0.1:1/db", {"wake": wake}, reconnect_s=0.01)
    with trio.move_on_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(listener.run)
            while await wake.next() < 3:
                pass
            nursery.cancel_scope.cancel()
    assert wake.count >= 3 and listener.connections == 0
    assert "cannot listen on postgresql://u@127.0.0.1:1/db" in caplog.text
