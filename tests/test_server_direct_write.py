"""Replies written straight to an idle socket (the endpoint's sink) keep the wire intact:
in order, never interleaved, and whole even when the socket takes only part of one."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing
from lxml import etree

from agentserver.config.topology import Limits
from agentserver.core.envelope import build_envelope
from agentserver.core.framing import FrameDecoder, encode_frame
from agentserver.core.handshake import HelloGate
from agentserver.core.listener import Listener
from agentserver.core.threads import new_thread_id
from agentserver.listeners.echo import Ping, Pong, handle, respond
from agentserver.net.server import Server
from agentserver.pump.pump import PumpConfig, open_pump


def ping_frame(text: str, thread: str) -> bytes:
    envelope = build_envelope("x", "echo", thread, Ping(text=text).to_xml_tree())
    return encode_frame(etree.tostring(envelope))


async def read_frame(stream: trio.SocketStream, decoder: FrameDecoder) -> bytes:
    with trio.fail_after(10):
        while (frame := decoder.next_frame()) is None:
            data = await stream.receive_some(65536)
            assert data, "server closed the connection"
            decoder.feed(data)
    return frame


BIG = 8 * 1024 * 1024


def sync_echo() -> Listener:
    """The built-in echo's form: answered in the reader's task, in the requests' order."""
    return Listener("echo", (Ping,), respond, responses=(Pong,), raw=True, sync=True)


@asynccontextmanager
async def serving(
    listener: Listener, limits: Limits, config: PumpConfig | None = None
) -> AsyncIterator[tuple[Server, int]]:
    """A pump with ``listener`` behind a real server on a loopback port: ``(server, port)``.
    Stops both on exit."""
    async with open_pump([listener], config=config) as pump, trio.open_nursery() as nursery:
        server = Server(pump, limits, HelloGate({}))
        addresses = await nursery.start(server.serve, "127.0.0.1", 0)
        yield server, addresses[0][1]
        server.stop_accepting()
        pump.close()


async def test_large_replies_to_a_slow_reader_arrive_whole_and_in_order():
    echo = Listener("echo", (Ping,), handle, responses=(Pong,), raw=True)
    config = PumpConfig(max_message_bytes=BIG)
    async with serving(echo, Limits(max_message_bytes=BIG), config) as (server, port):
        # A small receive window (set before connecting, so TCP starts with it), and
        # replies larger than any socket send buffer (Linux caps them at 4 MB by default):
        # a direct write cannot be taken whole.
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        await sock.connect(("127.0.0.1", port))
        stream = trio.SocketStream(sock)
        decoder = FrameDecoder(BIG)
        for i in range(3):
            text = f"{i}:" + "x" * 6_000_000
            thread = new_thread_id()
            await stream.send_all(ping_frame(text, thread))
            await trio.sleep(0.2)  # not reading yet: the direct write fills the socket
            reply = etree.fromstring(await read_frame(stream, decoder))
            assert reply[0][-1].text == thread
            assert reply[1][0].text == text
        assert server.counters["carried"] >= 1  # the carry path ran
        assert server.counters["replies"] == 3
        # Small replies with one in flight go out directly, whole and in order too.
        for i in range(50):
            thread = new_thread_id()
            await stream.send_all(ping_frame(str(i), thread))
            reply = etree.fromstring(await read_frame(stream, decoder))
            assert (reply[0][-1].text, reply[1][0].text) == (thread, str(i))
        # One write per reply, plus one by the writer for each carried remainder.
        assert server.counters["replies"] == 53
        assert server.counters["writes"] == 53 + server.counters["carried"]
        await stream.aclose()


async def test_pipelined_replies_are_batched_by_the_writer_not_written_one_by_one():
    echo = Listener("echo", (Ping,), handle, responses=(Pong,), raw=True)
    async with serving(echo, Limits(max_message_bytes=BIG)) as (server, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        decoder = FrameDecoder(1024 * 1024)
        threads = [new_thread_id() for _ in range(64)]
        await stream.send_all(b"".join(ping_frame(str(i), t) for i, t in enumerate(threads)))
        got = [etree.fromstring(await read_frame(stream, decoder)) for _ in threads]
        assert sorted(r[0][-1].text for r in got) == sorted(threads)
        assert server.counters["replies"] == 64
        assert server.counters["writes"] < 64  # more than one reply per write
        await stream.aclose()


async def test_a_client_resetting_its_connection_ends_it_quietly(caplog):
    # The reader reads the socket directly (not through trio's stream): a reset must end
    # the connection as a closed one, not as a failure, and others go on being served.
    echo = Listener("echo", (Ping,), handle, responses=(Pong,), raw=True)
    async with serving(echo, Limits()) as (server, port):
        rude = trio.socket.socket()
        await rude.connect(("127.0.0.1", port))
        stream = trio.SocketStream(rude)
        decoder = FrameDecoder(1024 * 1024)
        thread = new_thread_id()
        await stream.send_all(ping_frame("one", thread))
        assert etree.fromstring(await read_frame(stream, decoder))[0][-1].text == thread
        # Linger 0: close() sends a RST while the server's reader waits for a request.
        rude.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        rude.close()
        with trio.fail_after(10):
            while server.connection_count:  # noqa: ASYNC110 (the server has no event for it)
                await trio.sleep(0.01)
        polite = await trio.open_tcp_stream("127.0.0.1", port)
        thread = new_thread_id()
        await polite.send_all(ping_frame("two", thread))
        reply = etree.fromstring(await read_frame(polite, FrameDecoder(1024 * 1024)))
        assert (reply[0][-1].text, reply[1][0].text) == (thread, "two")
        await polite.aclose()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_stopping_the_server_ends_a_connection_waiting_for_its_next_request():
    # The direct read waits for the socket in a cancellable checkpoint: stopping the server
    # (which stops every reader) must not wait for the idle client to send or leave.
    echo = Listener("echo", (Ping,), handle, responses=(Pong,), raw=True)
    with trio.fail_after(10):
        async with serving(echo, Limits()) as (server, port):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            thread = new_thread_id()
            await stream.send_all(ping_frame("one", thread))
            reply = await read_frame(stream, FrameDecoder(1024 * 1024))
            assert etree.fromstring(reply)[0][-1].text == thread
            await trio.sleep(0.05)  # the reader is waiting for the socket now
        # serving() returned: the server stopped and every connection ended.
        assert server.connection_count == 0
        assert await stream.receive_some(65536) == b""  # closed by the server
        await stream.aclose()


async def test_replies_to_one_read_go_out_together_without_the_writer():
    # Pipelined requests to a sync listener: the reader collects the replies to what it
    # read and writes them with one send; none goes through the endpoint's buffer.
    echo = sync_echo()
    async with serving(echo, Limits()) as (server, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        decoder = FrameDecoder(1024 * 1024)
        # One exchange first: until the connection's writer has started (and waits), the
        # reader leaves replies to it.
        await stream.send_all(ping_frame("first", new_thread_id()))
        await read_frame(stream, decoder)
        await trio.testing.wait_all_tasks_blocked()
        queued = server.counters["queued"]
        for burst in range(5):
            threads = [new_thread_id() for _ in range(8)]
            await stream.send_all(
                b"".join(ping_frame(f"{burst}.{i}", t) for i, t in enumerate(threads))
            )
            got = [etree.fromstring(await read_frame(stream, decoder)) for _ in threads]
            # One connection's replies are in its requests' order.
            assert [(r[0][-1].text, r[1][0].text) for r in got] == [
                (t, f"{burst}.{i}") for i, t in enumerate(threads)
            ]
        assert server.counters["replies"] == 41
        assert server.counters["queued"] == queued
        assert server.counters["writes"] < 41
        await stream.aclose()


async def test_a_client_pipelining_past_its_inflight_limit_gets_every_reply():
    # The reader holds the replies it collects until it is done with a read; when the
    # in-flight limit stops it first, it must write them (they free the room it waits
    # for) rather than wait for room that only they can make.
    echo = sync_echo()
    async with serving(echo, Limits(max_inflight=4)) as (_server, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        decoder = FrameDecoder(1024 * 1024)
        threads = [new_thread_id() for _ in range(50)]
        await stream.send_all(b"".join(ping_frame(str(i), t) for i, t in enumerate(threads)))
        got = [etree.fromstring(await read_frame(stream, decoder)) for _ in threads]
        assert [(r[0][-1].text, r[1][0].text) for r in got] == [
            (t, str(i)) for i, t in enumerate(threads)
        ]
        await stream.aclose()


async def test_pipelined_large_replies_to_a_slow_reader_arrive_whole_and_in_order():
    # Collected replies the socket cannot take whole: the rest is carried over to the
    # writer, and later replies queue behind it.
    echo = sync_echo()
    config = PumpConfig(max_message_bytes=BIG)
    async with serving(echo, Limits(max_message_bytes=BIG), config) as (server, port):
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        await sock.connect(("127.0.0.1", port))
        stream = trio.SocketStream(sock)
        decoder = FrameDecoder(BIG)
        sizes = [100, 3_000_000, 50, 200_000, 10, 3_000_000, 5]
        threads = [new_thread_id() for _ in sizes]
        texts = [f"{i}:" + "x" * size for i, size in enumerate(sizes)]
        await stream.send_all(
            b"".join(ping_frame(t, th) for t, th in zip(texts, threads, strict=True))
        )
        await trio.sleep(0.2)  # not reading yet: the socket fills
        for text, thread in zip(texts, threads, strict=True):
            reply = etree.fromstring(await read_frame(stream, decoder))
            assert (reply[0][-1].text, reply[1][0].text) == (thread, text)
        assert server.counters["carried"] >= 1
        assert server.counters["replies"] == len(sizes)
        await stream.aclose()
