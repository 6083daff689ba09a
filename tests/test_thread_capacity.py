"""What a finished conversation holds, over real sockets: no registry capacity and no
in-flight slot. A client can neither fill the thread registry for everyone nor stall its
own connection with requests that end without an answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from lxml import etree
from pydantic_xml import BaseXmlModel, element
from test_server_direct_write import ping_frame, read_frame

from agentserver.config.topology import Limits
from agentserver.core.envelope import build_envelope
from agentserver.core.framing import FrameDecoder, encode_frame
from agentserver.core.handshake import HelloGate
from agentserver.core.listener import HandlerResponse, Listener
from agentserver.core.threads import new_thread_id
from agentserver.listeners.echo import Ping, Pong
from agentserver.listeners.echo import handle as echo
from agentserver.net.server import Server
from agentserver.pump.pump import Pump, PumpConfig, open_pump

CORE = "{https://xml-pipeline.org/ns/core/v1}"
NSMAP = {"": "urn:test:capacity"}


class Keep(BaseXmlModel, tag="keep", nsmap=NSMAP):
    text: str = element()


class Drop(BaseXmlModel, tag="drop", nsmap=NSMAP):
    text: str = element()


class Pass(BaseXmlModel, tag="pass", nsmap=NSMAP):
    text: str = element()


@asynccontextmanager
async def serving(
    listeners: list[Listener], limits: Limits, config: PumpConfig | None = None
) -> AsyncIterator[tuple[Pump, int]]:
    async with open_pump(listeners, config=config) as pump, trio.open_nursery() as nursery:
        server = Server(pump, limits, HelloGate({}))
        addresses = await nursery.start(server.serve, "127.0.0.1", 0)
        yield pump, addresses[0][1]
        server.stop_accepting()
        pump.close()


def frame(payload: etree._Element, to: str, thread: str | None = None) -> bytes:
    envelope = build_envelope("x", to, thread or new_thread_id(), payload)
    return encode_frame(etree.tostring(envelope))


class Connection:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder(1 << 20)

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def ask(self, data: bytes) -> etree._Element:
        await self.stream.send_all(data)
        return await self.reply()

    async def reply(self) -> etree._Element:
        return etree.fromstring(await read_frame(self.stream, self.decoder))


def is_pong(reply: etree._Element, text: str) -> bool:
    return etree.QName(reply[1]).localname == "pong" and reply[1][0].text == text


@pytest.mark.slow
async def test_sequential_requests_far_beyond_max_threads_never_fill_the_registry():
    """One connection, 100 x max-threads sequential echo requests, each on a fresh uuid4
    thread (as docs/wire.md advises): every one is answered, the registry stays at its
    root thread between requests, and a bystander is answered normally afterwards."""
    max_threads = 100
    config = PumpConfig(max_threads=max_threads)
    listener = Listener("echo", (Ping,), echo, responses=(Pong,), raw=True)
    async with serving([listener], Limits(), config) as (pump, port):
        conn = await Connection.open(port)
        largest = 0
        for i in range(100 * max_threads):
            thread = new_thread_id()
            reply = await conn.ask(ping_frame(str(i), thread))
            assert is_pong(reply, str(i)), etree.tostring(reply)
            assert reply[0][-1].text == thread
            largest = max(largest, len(pump.threads))
        # The pump's root thread, plus at most the conversation whose reply was just
        # written (the registry drops it right after pushing the reply).
        assert largest <= 3
        bystander = await Connection.open(port)
        assert is_pong(await bystander.ask(ping_frame("bystander", new_thread_id())), "bystander")
        await trio.testing.wait_all_tasks_blocked()
        assert len(pump.threads) == 1
        await conn.stream.aclose()
        await bystander.stream.aclose()


async def test_one_connection_cannot_take_the_registry_from_another():
    """A client whose conversations stay open (held, as an agent holds a task) is refused
    past its own quota; a bystander is still answered and the registry has room."""
    pump_ref: list[Pump] = []

    async def keep(payload, meta):
        pump_ref[0].hold(meta.thread_id)  # answered "later": the conversation stays open
        return None

    listeners = [
        Listener("echo", (Ping,), echo, responses=(Pong,), raw=True),
        Listener("keep", (Keep,), keep),
    ]
    # Without the quota, 40 open conversations (two threads each) would fill 30 threads.
    config = PumpConfig(max_threads=30, max_threads_per_endpoint=10)
    async with serving(listeners, Limits(), config) as (pump, port):
        pump_ref.append(pump)
        greedy = await Connection.open(port)
        await greedy.stream.send_all(
            b"".join(frame(Keep(text=str(i)).to_xml_tree(), "keep") for i in range(40))
        )
        refusals = [await greedy.reply() for _ in range(35)]
        # Each open conversation holds its root and its held hop: 5 fit in a share of 10.
        assert all(r[1].tag == CORE + "SystemError" for r in refusals)
        assert {r[1].findtext(CORE + "code") for r in refusals} == {"routing"}
        await trio.testing.wait_all_tasks_blocked()
        assert len(pump.threads) == 1 + 10
        bystander = await Connection.open(port)
        for i in range(3):
            reply = await bystander.ask(ping_frame(f"b{i}", new_thread_id()))
            assert is_pong(reply, f"b{i}")
        await greedy.stream.aclose()
        await bystander.stream.aclose()


async def sink(payload, meta):
    return None


async def forward(payload, meta):
    return HandlerResponse(Drop(text=payload.text), to="sink")


@pytest.mark.parametrize("to", ["sink", "relay"], ids=["handler returns None", "last hop ends"])
async def test_requests_that_end_without_an_answer_free_their_in_flight_slot_at_once(to):
    """max-inflight requests that end without an answer (the handler returns None, or the
    last listener of the chain does) do not stop the server reading the connection: the
    next request is answered at once, not after inflight-ttl."""
    listeners = [
        Listener("echo", (Ping,), echo, responses=(Pong,), raw=True),
        Listener("sink", (Drop,), sink),
        Listener("relay", (Pass,), forward, peers=("sink",)),
    ]
    limits = Limits(max_inflight=4, inflight_ttl=120)
    kind = Drop if to == "sink" else Pass
    async with serving(listeners, limits) as (pump, port):
        conn = await Connection.open(port)
        silent = b"".join(frame(kind(text=str(i)).to_xml_tree(), to) for i in range(12))
        with trio.fail_after(5):
            reply = await conn.ask(silent + ping_frame("after", new_thread_id()))
        assert is_pong(reply, "after")  # nothing else came back: the 12 ended silently
        await trio.testing.wait_all_tasks_blocked()
        assert len(pump.threads) == 1  # every hop, and every conversation, is gone
        # End of input with nothing owed: the server closes at once, without lingering
        # read-timeout for replies that will never come.
        await conn.stream.send_eof()
        with trio.fail_after(2):
            assert await conn.stream.receive_some(100) == b""
        await conn.stream.aclose()
