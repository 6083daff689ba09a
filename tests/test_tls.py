"""TLS on the listener, in process: a real server on loopback with trustme certificates."""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from lxml import etree
from tlsutil import Pki, make_pki

from agentserver.config.topology import Limits
from agentserver.core.envelope import build_envelope
from agentserver.core.errors import HuhReason
from agentserver.core.framing import FrameDecoder, encode_frame
from agentserver.core.handshake import Credential, HelloGate, hello_frame_body
from agentserver.core.listener import Listener
from agentserver.core.threads import new_thread_id
from agentserver.core.throttle import HelloThrottle
from agentserver.listeners.echo import Ping, Pong, handle
from agentserver.net.client import ConnectionClosed, TlsHandshakeError, open_client
from agentserver.net.server import Server
from agentserver.pump.pump import open_pump

TOKEN = "alice-token-0123456789"


@pytest.fixture
def pki(tmp_path) -> Pki:
    return make_pki(tmp_path / "pki")


@asynccontextmanager
async def serving(
    ssl_context: ssl.SSLContext | None,
    *,
    limits: Limits | None = None,
    clients: dict[str, Credential] | None = None,
    throttle: HelloThrottle | None = None,
) -> AsyncIterator[tuple[Server, int]]:
    echo = Listener("echo", (Ping,), handle, responses=(Pong,), raw=True)
    async with open_pump([echo]) as pump, trio.open_nursery() as nursery:
        server = Server(
            pump,
            limits or Limits(read_timeout=1.0, hello_timeout=1.0),
            HelloGate(clients or {}),
            ssl_context=ssl_context,
            throttle=throttle,
        )
        addresses = await nursery.start(server.serve, "127.0.0.1", 0)
        yield server, addresses[0][1]
        server.stop_accepting()
        pump.close()


def ping_frame(text: str) -> bytes:
    envelope = build_envelope("x", "echo", new_thread_id(), Ping(text=text).to_xml_tree())
    return encode_frame(etree.tostring(envelope))


async def test_echo_round_trip_over_tls(pki):
    async with serving(pki.server_context()) as (server, port):
        async with open_client("127.0.0.1", port, tls=True, ca=pki.ca_file) as client:
            reply = await client.request(Ping(text="secret"), to="echo", timeout=5)
        assert reply.payload_xml == '<pong xmlns="urn:agentserver:echo"><text>secret</text></pong>'
        # The server name is verified too: "localhost" is in the certificate.
        async with open_client("localhost", port, tls=pki.client_context()) as client:
            reply = await client.request(Ping(text="by name"), to="echo", timeout=5)
        assert reply.payload[0].text == "by name"
        assert server.counters["tls_failed"] == 0


async def test_one_at_a_time_replies_never_bypass_the_encryption(pki):
    """Request, reply, request...: on plaintext these replies go out by a direct write on
    the socket; on TLS that would put cleartext in the TLS stream and break it."""
    async with serving(pki.server_context()) as (server, port):
        async with open_client("127.0.0.1", port, tls=pki.client_context()) as client:
            for i in range(50):
                reply = await client.request(Ping(text=str(i)), to="echo", timeout=5)
                assert reply.payload[0].text == str(i)
        assert server.counters["replies"] == 50


async def test_a_client_that_does_not_trust_the_ca_gets_a_clear_error(pki, tmp_path):
    stranger = make_pki(tmp_path / "other")
    async with serving(pki.server_context()) as (_, port):
        with pytest.raises(TlsHandshakeError) as caught:
            async with open_client("127.0.0.1", port, tls=True, ca=stranger.ca_file):
                pytest.fail("connected without trusting the server")
        message = str(caught.value)
        assert "certificate" in message and "CA" in message, message
        # With the system CAs only (no ca=), the private CA is not trusted either.
        with pytest.raises(TlsHandshakeError):
            async with open_client("127.0.0.1", port, tls=True):
                pytest.fail("connected without trusting the server")
        # A name the certificate does not carry is refused, even with the right CA.
        with pytest.raises(TlsHandshakeError, match="certificate"):
            async with open_client(
                "127.0.0.1", port, tls=True, ca=pki.ca_file, server_hostname="example.org"
            ):
                pytest.fail("connected to the wrong name")
        async with open_client("127.0.0.1", port, ca=pki.ca_file) as client:  # ca= means TLS
            assert (await client.request(Ping(text="ok"), to="echo", timeout=5)).payload[0].text


async def test_a_plaintext_client_on_a_tls_port_is_disconnected(pki):
    async with serving(pki.server_context()) as (server, port):
        with trio.fail_after(5):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(ping_frame("in clear"))
            # Not a TLS record: the server hangs up at once (no reply, no wait).
            try:
                data = await stream.receive_some(65536)
                while data:
                    assert b"<pong" not in data
                    data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                pass  # a reset is a disconnection too
            await stream.aclose()
            # The plaintext client library says so rather than hanging.
            with pytest.raises(ConnectionClosed):
                async with open_client("127.0.0.1", port) as client:
                    await client.request(Ping(text="x"), to="echo", timeout=5)
        assert server.counters["tls_failed"] == 2
        async with open_client("127.0.0.1", port, tls=pki.client_context()) as client:
            assert (await client.request(Ping(text="fine"), to="echo", timeout=5)).payload[0].text


async def test_a_stalled_tls_handshake_is_closed_at_the_read_timeout(pki):
    limits = Limits(read_timeout=0.5, hello_timeout=5.0)
    async with serving(pki.server_context(), limits=limits) as (server, port):
        with trio.fail_after(5):
            # A TCP connection that never starts the handshake, and one that stops half
            # way (the first bytes of a ClientHello record).
            silent = await trio.open_tcp_stream("127.0.0.1", port)
            partial = await trio.open_tcp_stream("127.0.0.1", port)
            await partial.send_all(b"\x16\x03\x01\x02\x00\x01")
            start = trio.current_time()
            for stream in (silent, partial):
                try:
                    assert await stream.receive_some(1024) == b""
                except trio.BrokenResourceError:
                    pass
            elapsed = trio.current_time() - start
            assert elapsed >= 0.4  # closed by the timeout, not at once
        assert server.counters["tls_failed"] == 2
        assert server.connection_count == 0 and server._handshaking == 0
        await silent.aclose()
        await partial.aclose()


async def test_one_connection_too_many_gets_its_refusal_over_tls(pki):
    limits = Limits(max_connections=1, read_timeout=1.0, hello_timeout=1.0)
    async with serving(pki.server_context(), limits=limits) as (server, port):
        async with open_client("127.0.0.1", port, tls=pki.client_context()) as first:
            assert (await first.request(Ping(text="1"), to="echo", timeout=5)).payload[0].text
            with trio.fail_after(5):
                async with open_client("127.0.0.1", port, tls=pki.client_context()) as second:
                    refusal = await second.receive()  # readable: it came through TLS
            assert refusal.is_system_error
        assert server.counters["refused_busy"] == 1


async def test_tls_hello_with_token_still_works(pki):
    clients = {"alice": Credential(TOKEN)}
    async with serving(pki.server_context(), clients=clients) as (_, port):
        async with open_client(
            "127.0.0.1", port, client="alice", token=TOKEN, tls=pki.client_context()
        ) as client:
            reply = await client.request(Ping(text="a"), to="echo", timeout=5)
        assert reply.to == "alice"


# -- hello throttling ---------------------------------------------------------------------


async def wrong_hello(port: int, local: str) -> float:
    """One connection from ``local`` with a wrong token; seconds until it was refused."""
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=local)
    start = trio.current_time()
    await stream.send_all(encode_frame(hello_frame_body("alice", "wrong")))
    decoder = FrameDecoder(65536)
    frames = []
    while data := await stream.receive_some(65536):
        decoder.feed(data)
        frames.extend(decoder.frames())
    await stream.aclose()
    assert len(frames) == 1 and HuhReason.UNAUTHENTICATED.value.encode() in frames[0]
    return trio.current_time() - start


async def test_twenty_wrong_tokens_are_slowed_and_another_address_is_not(caplog):
    throttle = HelloThrottle(free_failures=5, base_delay=0.05, max_delay=0.4)
    clients = {"alice": Credential(TOKEN)}
    caplog.set_level(logging.INFO, logger="agentserver.server")
    async with serving(None, clients=clients, throttle=throttle) as (server, port):
        with trio.fail_after(30):
            waits = []
            for i in range(20):
                waits.append(await wrong_hello(port, "127.0.0.1"))
                # The first five are answered without delay; every later one is slowed.
                assert server.counters["throttled"] == max(0, i - 4)
            # ... each longer than the one before, up to the cap: 0.05, 0.1, 0.2, 0.4, 0.4...
            assert waits[5] >= 0.04 and waits[7] >= 0.18 and min(waits[8:]) >= 0.35, waits
            # Another address is not slowed, and its right token works.
            await wrong_hello(port, "127.0.0.2")
            assert server.counters["throttled"] == 15
            stream = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.2")
            await stream.send_all(
                encode_frame(hello_frame_body("alice", TOKEN)) + ping_frame("from elsewhere")
            )
            decoder = FrameDecoder(65536)
            while not (frames := decoder.frames()):
                decoder.feed(await stream.receive_some(65536))
            assert b"<text>from elsewhere</text>" in frames[0]
            await stream.aclose()
            assert server.counters["throttled"] == 15
    # Logged once for the burst, and the log never says which part was wrong.
    bursts = [r for r in caplog.records if "slowing" in r.getMessage()]
    assert len(bursts) == 1 and "127.0.0.1" in bursts[0].getMessage()


async def test_a_throttled_address_gets_one_waiting_hello_at_a_time():
    throttle = HelloThrottle(free_failures=1, base_delay=2.0, max_delay=2.0)
    clients = {"alice": Credential(TOKEN)}
    async with serving(None, clients=clients, throttle=throttle) as (server, port):
        with trio.fail_after(10):
            await wrong_hello(port, "127.0.0.1")
            first_done = trio.Event()

            async def slowed() -> None:
                assert await wrong_hello(port, "127.0.0.1") >= 1.5  # waits 2 s
                first_done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(slowed)
                # Until the first hello was read and waits (every task blocked a while).
                await trio.testing.wait_all_tasks_blocked(cushion=0.1)
                assert server.hello.throttled == {"127.0.0.1"}
                # A second one meanwhile is refused unchecked (same refusal), before the
                # first is answered.
                await wrong_hello(port, "127.0.0.1")
                assert not first_done.is_set()
                assert server.counters["unauthenticated"] == 1  # only the first was checked
        assert server.counters["throttled"] == 2 and server.counters["unauthenticated"] == 2
