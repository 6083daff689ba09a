"""The server's accept loop: out-of-descriptor errors are retried, brief connections
(connect, close) leave nothing behind, and every connection is still served."""

from __future__ import annotations

import errno

import pytest
import trio
from lxml import etree
from test_server_direct_write import ping_frame, read_frame, serving, sync_echo

from agentserver.config.topology import Limits
from agentserver.core.framing import FrameDecoder
from agentserver.core.threads import new_thread_id


async def ping(port: int) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        thread = new_thread_id()
        await stream.send_all(ping_frame("hi", thread))
        reply = etree.fromstring(await read_frame(stream, FrameDecoder(1 << 20)))
        assert reply[0][-1].text == thread


async def test_accept_out_of_descriptors_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    accept = trio.SocketListener.accept
    failures = []

    async def failing_once(self: trio.SocketListener) -> trio.SocketStream:
        if not failures:
            failures.append(1)
            await trio.lowlevel.checkpoint()
            raise OSError(errno.EMFILE, "Too many open files")
        return await accept(self)

    monkeypatch.setattr(trio.SocketListener, "accept", failing_once)
    async with serving(sync_echo(), Limits()) as (server, port):
        with trio.fail_after(10):
            await ping(port)
        assert failures == [1]
        assert server.counters["accepted"] == 1


async def test_brief_connections_leave_nothing_behind() -> None:
    async with serving(sync_echo(), Limits()) as (server, port):
        for _ in range(20):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.aclose()
        with trio.fail_after(10):
            await ping(port)  # served after them
            while server.connection_count:  # noqa: ASYNC110 (a count, no event to wait for)
                await trio.sleep(0.01)
        assert server.counters["accepted"] == 21
