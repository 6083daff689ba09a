"""Byte bounds next to the count bounds: requests in flight per connection, and replies
waiting in an endpoint's outgoing buffer. A single message always gets through."""

from __future__ import annotations

import trio
from lxml import etree
from test_server_direct_write import ping_frame, read_frame, serving

from agentserver.config.topology import Limits
from agentserver.core.framing import FrameDecoder
from agentserver.core.listener import Listener
from agentserver.core.threads import new_thread_id
from agentserver.listeners.echo import Ping, Pong, handle
from agentserver.pump.pump import PumpConfig, open_pump

TEXT = "x" * 2000


async def test_requests_in_flight_are_bounded_in_bytes_too():
    seen: list[str] = []
    release = trio.Event()

    async def gated(payload, meta):
        seen.append(meta.thread_id)
        await release.wait()
        return await handle(payload, meta)

    echo = Listener("echo", (Ping,), gated, responses=(Pong,), raw=True, concurrency=50)
    size = len(ping_frame(TEXT, new_thread_id())) - 4
    # Room for three requests by count many times over, but by bytes for three only.
    limits = Limits(max_inflight=100, max_inflight_bytes=3 * size + size // 2)
    async with serving(echo, limits) as (_, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        threads = [new_thread_id() for _ in range(8)]
        await stream.send_all(b"".join(ping_frame(TEXT, t) for t in threads))
        await trio.sleep(0.3)
        assert len(seen) == 3  # the server stopped reading at the byte bound
        release.set()
        decoder = FrameDecoder(1 << 20)
        answered = [etree.fromstring(await read_frame(stream, decoder)) for _ in threads]
        assert sorted(r[0][-1].text for r in answered) == sorted(threads)
        assert len(seen) == 8
        await stream.aclose()


async def test_a_request_larger_than_the_byte_bound_is_admitted_alone():
    echo = Listener("echo", (Ping,), handle, responses=(Pong,), raw=True)
    async with serving(echo, Limits(max_inflight_bytes=100)) as (_, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        decoder = FrameDecoder(1 << 20)
        threads = [new_thread_id() for _ in range(3)]
        await stream.send_all(b"".join(ping_frame(TEXT, t) for t in threads))
        answered = [etree.fromstring(await read_frame(stream, decoder)) for _ in threads]
        assert [r[0][-1].text for r in answered] == threads
        assert [r[1][0].text for r in answered] == [TEXT] * 3
        await stream.aclose()


async def test_endpoint_buffer_is_bounded_in_bytes_and_a_big_message_fits_when_empty():
    async with open_pump([], config=PumpConfig(endpoint_buffer_bytes=1000)) as pump:
        ep = pump.open_endpoint("reader", buffer=100)
        assert ep.push(b"a" * 5000)  # larger than the bound, but the buffer was empty
        assert ep.buffered_bytes == 5000
        assert ep.receive_nowait() == b"a" * 5000
        assert ep.buffered_bytes == 0
        assert ep.push(b"b" * 400) and ep.push(b"c" * 400)
        assert not ep.push(b"d" * 400)  # 1200 > 1000: a reader this slow is cut off
        assert ep.closed and ep.overflowed and ep.dropped == 1
        # What was buffered before the overflow can still be read.
        assert [ep.receive_nowait(), await ep.receive()] == [b"b" * 400, b"c" * 400]
        assert ep.buffered_bytes == 0
