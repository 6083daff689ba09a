"""The client library's side of reply acknowledgement, against a scripted server on a real
loopback socket: it asks for acks in its hello, hands each durable reply over once,
acknowledges what it handed over, and drops copies by id (also across connections that
share a :class:`DeliveredIds`)."""

from __future__ import annotations

import trio
from lxml import etree

from agentserver.core.envelope import build_envelope
from agentserver.core.framing import FrameDecoder, encode_frame
from agentserver.core.handshake import ACK_TAG, HELLO_TAG
from agentserver.core.threads import new_thread_id
from agentserver.listeners.echo import Pong
from agentserver.net.client import DeliveredIds, open_client

PATIENCE = 10.0


def reply(text: str, reply_id: int | None, thread: str | None = None) -> bytes:
    root = build_envelope(
        "assistant", "alice", thread or new_thread_id(), Pong(text=text).to_xml_tree()
    )
    if reply_id is not None:
        root.set("reply-id", str(reply_id))
    return encode_frame(etree.tostring(root))


class ScriptedServer:
    """Accepts connections; records every frame each sends; the test writes replies."""

    def __init__(self) -> None:
        self.streams: list[trio.SocketStream] = []
        self.frames: list[list[etree._Element]] = []
        self.arrived = trio.Event()
        self.port = 0

    async def start(self, nursery: trio.Nursery) -> None:
        listeners = await nursery.start(trio.serve_tcp, self._handle, 0)
        self.port = listeners[0].socket.getsockname()[1]

    async def _handle(self, stream: trio.SocketStream) -> None:
        frames: list[etree._Element] = []
        self.streams.append(stream)
        self.frames.append(frames)
        decoder = FrameDecoder(1 << 20)
        while data := await stream.receive_some(65536):
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not None:
                frames.append(etree.fromstring(frame)[1])
                self.arrived.set()

    async def payloads(self, conn: int, count: int) -> list[etree._Element]:
        with trio.fail_after(PATIENCE):
            while len(self.frames) <= conn or len(self.frames[conn]) < count:
                self.arrived = trio.Event()
                await self.arrived.wait()
        return self.frames[conn]


def acked(payloads: list[etree._Element]) -> list[int]:
    return [int(i.text) for p in payloads if p.tag == ACK_TAG for i in p]


async def test_copies_of_a_reply_are_handed_over_once_and_acknowledged():
    server = ScriptedServer()
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        delivered = DeliveredIds()
        async with open_client(
            "127.0.0.1", server.port, client="alice", token="t", delivered=delivered
        ) as client:
            [hello] = await server.payloads(0, 1)
            assert hello.tag == HELLO_TAG and hello.get("ack") == "true"
            stream = server.streams[0]
            await stream.send_all(reply("one", 7) + reply("one", 7) + reply("plain", None))
            with trio.fail_after(PATIENCE):
                first = await client.receive()
                second = await client.receive()
            assert (first.id, first.payload[0].text) == (7, "one")
            assert (second.id, second.payload[0].text) == (None, "plain")
            assert client.duplicates == 1
            assert acked(await server.payloads(0, 2)) == [7]  # only what has an id
            # sent again (as after a restart that lost the ack): dropped, acknowledged again
            await stream.send_all(reply("one", 7))
            assert acked(await server.payloads(0, 3)) == [7, 7]
            assert client.duplicates == 2
            # a request's reply is handed over by request() and acknowledged too
            thread = new_thread_id()
            async with trio.open_nursery() as inner:

                async def answer() -> None:
                    await server.payloads(0, 4)  # the request
                    await stream.send_all(reply("two", 9, thread))

                inner.start_soon(answer)
                got = await client.request(b'<x xmlns="urn:x"/>', thread=thread, timeout=PATIENCE)
            assert got.id == 9
            assert acked(await server.payloads(0, 5)) == [7, 7, 9]
            with trio.move_on_after(0.3) as quiet:
                extra = await client.receive()
            assert quiet.cancelled_caught, extra.raw
        # a later connection sharing ``delivered`` drops what was handed over before
        async with open_client(
            "127.0.0.1", server.port, client="alice", token="t", delivered=delivered
        ) as client:
            await server.payloads(1, 1)
            await server.streams[1].send_all(reply("one", 7) + reply("three", 11))
            with trio.fail_after(PATIENCE):
                got = await client.receive()
            assert got.id == 11 and client.duplicates == 1
            assert sorted(acked(await server.payloads(1, 2))) in ([7], [7, 11])
        # flushed at the latest on close
        with trio.fail_after(PATIENCE):
            while sorted(acked(server.frames[1])) != [7, 11]:
                await server.payloads(1, len(server.frames[1]) + 1)
        nursery.cancel_scope.cancel()


async def test_an_anonymous_client_asks_for_no_acks():
    server = ScriptedServer()
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        async with open_client("127.0.0.1", server.port) as client:
            await client.send(b'<x xmlns="urn:x"/>')
            [first] = await server.payloads(0, 1)
            assert first.tag == "{urn:x}x"
        nursery.cancel_scope.cancel()
