"""agentserver.net.tlsstream.TlsStream: the byte stream under arbitrary chunking, the
synchronous direct handle, close_notify both ways, truncation, session resumption (open_client
with TlsSessions, mutual TLS included) and ciphertext the socket did not take."""

from __future__ import annotations

import functools
import logging
import pathlib
import ssl
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree
from tlsutil import Pki, make_pki

from agentserver.config.topology import Limits
from agentserver.core.envelope import build_envelope
from agentserver.core.framing import FrameDecoder, encode_frame
from agentserver.core.handshake import HelloGate
from agentserver.core.listener import Listener
from agentserver.core.threads import new_thread_id
from agentserver.listeners.echo import Ping, Pong, handle
from agentserver.net.client import TlsSessions, open_client
from agentserver.net.server import Server
from agentserver.net.tls import CertificateRule, TlsSpec, client_context, server_context
from agentserver.net.tlsstream import TlsStream, TlsTruncated
from agentserver.pump.pump import open_pump


@functools.cache
def shared_pki() -> Pki:
    """One CA for the whole module (hypothesis runs many examples in one test)."""
    return make_pki(pathlib.Path(tempfile.mkdtemp(prefix="tlsstream-")))


def contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    pki = shared_pki()
    spec = TlsSpec(cert=pki.cert_file, key=pki.key_file)
    return server_context(spec, {}), pki.client_context()


async def socket_stream_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


async def relay(source: trio.SocketStream, target: trio.SocketStream, sizes: list[int]) -> None:
    """Copy ``source`` to ``target`` cut into pieces of ``sizes`` (cycled), each sent on
    its own after a scheduler round: records and handshake messages arrive split
    anywhere. Ends at end of input (passed on)."""
    i = 0
    pending = b""
    try:
        while True:
            data = await source.receive_some(65536)
            if not data:
                await target.send_eof()
                return
            pending += data
            while pending:
                size = sizes[i % len(sizes)]
                i += 1
                piece, pending = pending[:size], pending[size:]
                await target.send_all(piece)
                await trio.lowlevel.checkpoint()
    except trio.BrokenResourceError:
        return  # the far end closed first (the last close_notify has no reader)


async def receive_exactly(
    stream: TlsStream, size: int, *, direct: bool, max_bytes: int = 65536
) -> bytes:
    """``size`` bytes of plaintext, read by the direct handle (recv, waiting on the socket
    when it has nothing) or by receive_some (at most ``max_bytes`` at once)."""
    got = b""
    while len(got) < size:
        if direct:
            try:
                data = stream.recv(65536)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(stream.socket)
                continue
        else:
            data = await stream.receive_some(max_bytes)
            assert len(data) <= max_bytes
        assert data, "end of input before every byte came"
        got += data
    assert len(got) == size
    return got


async def chunked_exchange(
    messages: list[bytes], sizes: list[int], direct_read: bool, direct_write: bool, max_bytes: int
) -> None:
    server_ctx, client_ctx = contexts()
    server_side, server_wire = await socket_stream_pair()
    client_side, client_wire = await socket_stream_pair()
    server = TlsStream(server_side, server_ctx, server_side=True)
    client = TlsStream(client_side, client_ctx, server_hostname="127.0.0.1")
    total = sum(len(m) for m in messages)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay, client_wire, server_wire, sizes)
            nursery.start_soon(relay, server_wire, client_wire, sizes[::-1] or [1])
            async with trio.open_nursery() as handshakes:
                handshakes.start_soon(server.do_handshake)
                handshakes.start_soon(client.do_handshake)
            # Client to server: every write kind, every read kind.
            async with trio.open_nursery() as exchange:

                async def write() -> None:
                    for message in messages:
                        if direct_write:
                            assert client.send(message) == len(message)
                            await trio.lowlevel.checkpoint()
                        else:
                            await client.send_all(message)
                    await client.send_all(b"")  # whatever the socket did not take

                exchange.start_soon(write)
                got = await receive_exactly(server, total, direct=direct_read, max_bytes=max_bytes)
            assert got == b"".join(messages)
            # And back, the direct write from the server.
            for message in messages:
                server.send(message)
            await server.send_all(b"")
            assert not server.owes
            back = await receive_exactly(client, total, direct=not direct_read, max_bytes=max_bytes)
            assert back == got
            # close_notify: the end of input, not a broken connection, on both sides.
            await client.aclose()
            assert await server.receive_some() == b""
            await server.aclose()
            nursery.cancel_scope.cancel()
    for s in (server_wire, client_wire):
        await s.aclose()


@pytest.mark.socket
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    messages=st.lists(st.binary(min_size=1, max_size=40_000), min_size=1, max_size=6),
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=8),
    direct_read=st.booleans(),
    direct_write=st.booleans(),
    max_bytes=st.integers(1, 70_000),
)
def test_any_chunking_of_the_ciphertext_delivers_the_same_bytes(
    messages, sizes, direct_read, direct_write, max_bytes
):
    trio.run(chunked_exchange, messages, sizes, direct_read, direct_write, max_bytes)


@pytest.mark.socket
async def test_a_tcp_close_without_close_notify_is_a_truncation_not_an_end():
    server_ctx, client_ctx = contexts()
    server_side, client_side = await socket_stream_pair()
    server = TlsStream(server_side, server_ctx, server_side=True)
    client = TlsStream(client_side, client_ctx, server_hostname="127.0.0.1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.do_handshake)
        nursery.start_soon(client.do_handshake)
    with trio.move_on_after(0.2):
        await client.receive_some()  # takes the server's session tickets: no reset below
    client.send(b"last words")
    client.discard()
    await client_side.aclose()  # no close_notify
    assert await server.receive_some() == b"last words"
    with pytest.raises(TlsTruncated):
        while True:
            try:
                server.recv(1024)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(server.socket)
    with pytest.raises(trio.BrokenResourceError):
        await server.receive_some()
    await server.aclose()


@pytest.mark.socket
async def test_a_failed_handshake_says_why_and_sends_no_plaintext():
    server_ctx, _ = contexts()
    untrusting = ssl.create_default_context()  # the test CA is not in it
    server_side, client_side = await socket_stream_pair()
    server = TlsStream(server_side, server_ctx, server_side=True)
    client = TlsStream(client_side, untrusting, server_hostname="127.0.0.1")
    causes: list[BaseException | None] = []

    async def shake(stream: TlsStream) -> None:
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            causes.append(exc.__cause__)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(shake, server)
        nursery.start_soon(shake, client)
    assert any(isinstance(c, ssl.SSLCertVerificationError) for c in causes)
    for stream in (server, client):
        stream.discard()
    await server_side.aclose()
    await client_side.aclose()


def test_renegotiation_is_refused_by_both_sides_contexts():
    pki = shared_pki()
    server = server_context(TlsSpec(cert=pki.cert_file, key=pki.key_file), {})
    client = client_context(ca=pki.ca_file)
    for ctx in (server, client):
        assert ctx.options & ssl.OP_NO_RENEGOTIATION
    # TLS 1.3 has no renegotiation at all: a min-version="1.3" listener cannot be asked.
    strict = server_context(TlsSpec(cert=pki.cert_file, key=pki.key_file, min_version="1.3"), {})
    assert strict.minimum_version is ssl.TLSVersion.TLSv1_3


# -- against the real server -------------------------------------------------------------


@asynccontextmanager
async def serving(
    context: ssl.SSLContext,
    *,
    rules: tuple[CertificateRule, ...] = (),
    limits: Limits | None = None,
) -> AsyncIterator[tuple[Server, int]]:
    echo = Listener("echo", (Ping,), handle, responses=(Pong,), raw=True)
    async with open_pump([echo]) as pump, trio.open_nursery() as nursery:
        server = Server(
            pump,
            limits or Limits(read_timeout=2.0, hello_timeout=1.0),
            HelloGate({}),
            ssl_context=context,
            cert_rules=rules,
        )
        addresses = await nursery.start(server.serve, "127.0.0.1", 0)
        yield server, addresses[0][1]
        server.stop_accepting()
        pump.close()


def ping_frame(text: str) -> tuple[bytes, str]:
    thread = new_thread_id()
    envelope = build_envelope("x", "echo", thread, Ping(text=text).to_xml_tree())
    return encode_frame(etree.tostring(envelope)), thread


@pytest.mark.socket
async def test_a_reconnecting_client_resumes_its_session(tmp_path):
    pki = make_pki(tmp_path / "pki")
    sessions = TlsSessions()
    async with serving(pki.server_context()) as (server, port):
        for i in range(3):
            async with open_client("127.0.0.1", port, ca=pki.ca_file, sessions=sessions) as client:
                reply = await client.request(Ping(text=f"n{i}"), to="echo", timeout=5)
                assert reply.payload[0].text == f"n{i}"
        # The first connection shook hands in full; the next two resumed its session.
        assert (sessions.full, sessions.resumed) == (1, 2)
        # Without the object, every connection is a full handshake (nothing kept).
        async with open_client("127.0.0.1", port, ca=pki.ca_file) as client:
            await client.request(Ping(text="fresh"), to="echo", timeout=5)
        assert server.counters["tls_failed"] == 0


@pytest.mark.socket
async def test_a_resumed_mutual_tls_session_still_names_the_client(tmp_path):
    pki = make_pki(tmp_path / "pki")
    cert, key = pki.client_files("alice")
    spec = TlsSpec(cert=pki.cert_file, key=pki.key_file, client_ca=pki.ca_file)
    rules = (CertificateRule("alice", subject=frozenset({("CN", "alice")})),)
    sessions = TlsSessions()
    async with serving(server_context(spec, {}), rules=rules) as (server, port):
        for _ in range(2):
            async with open_client(
                "127.0.0.1",
                port,
                client="alice",
                ca=pki.ca_file,
                cert=cert,
                key=key,
                sessions=sessions,
            ) as client:
                reply = await client.request(Ping(text="me"), to="echo", timeout=5)
                assert reply.to == "alice", reply.raw
        assert (sessions.full, sessions.resumed) == (1, 1)
        assert server.counters["unauthenticated"] == 0


@pytest.mark.socket
async def test_replies_the_socket_cannot_take_at_once_arrive_whole_and_in_order(tmp_path):
    """One request at a time, each reply written directly by the task producing it, to a
    client that reads nothing for a while (12 MB: more than the socket buffers): the socket fills, a
    direct send leaves ciphertext behind, the stream keeps it and the writer sends it
    first; every reply then arrives whole."""
    pki = make_pki(tmp_path / "pki")
    text = "x" * 250_000
    count = 48
    limits = Limits(read_timeout=5.0, hello_timeout=1.0, outgoing_buffer_bytes=16 * 1024 * 1024)
    async with serving(pki.server_context(), limits=limits) as (server, port):
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        stream = TlsStream(tcp, pki.client_context(), server_hostname="127.0.0.1")
        await stream.do_handshake()
        frames = [ping_frame(f"{i}:{text}") for i in range(count)]
        for frame, _ in frames:
            await stream.send_all(frame)
            await trio.sleep(0.01)  # its reply is produced (and written) meanwhile
        decoder = FrameDecoder(1024 * 1024)
        replies: list[bytes] = []
        with trio.move_on_after(5):
            while len(replies) < count:
                decoder.feed(await stream.receive_some())
                replies.extend(decoder.frames())
        assert len(replies) == count, (len(replies), str(server.counters))
        # Each request's own reply, whole (the echo's handlers may answer out of order).
        by_text = {}
        for reply in replies:
            pong = etree.fromstring(reply)
            body = pong.findtext(".//{urn:agentserver:echo}text")
            by_text[body] = pong.findtext(".//{*}thread")
        assert by_text == {f"{i}:{text}": thread for i, (_, thread) in enumerate(frames)}
        assert server.counters["carried"] >= 1  # the kept ciphertext went by the writer
        await stream.aclose()


@pytest.mark.socket
async def test_the_server_ends_a_connection_with_close_notify(tmp_path):
    """An oversize frame gets its <huh> and the connection is closed: the client reads
    the refusal, then a clean end of input (close_notify), not a broken connection."""
    pki = make_pki(tmp_path / "pki")
    limits = Limits(read_timeout=2.0, hello_timeout=1.0, max_message_bytes=4096)
    async with serving(pki.server_context(), limits=limits) as (server, port):
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        stream = TlsStream(tcp, pki.client_context(), server_hostname="127.0.0.1")
        await stream.do_handshake()
        await stream.send_all((100_000).to_bytes(4, "big") + b"<" * 10)
        received = b""
        with trio.fail_after(5):
            while data := await stream.receive_some():
                received += data
        assert b"huh" in received
        assert server.counters["oversize"] == 1
        await stream.aclose()


@pytest.mark.socket
async def test_a_forged_record_ends_the_connection_quietly(tmp_path, caplog):
    """Bytes that are no record of this session (injected on the path): the server's
    decryption fails, the connection is closed, nothing is logged as a failure and the
    server goes on serving."""
    pki = make_pki(tmp_path / "pki")
    async with serving(pki.server_context()) as (server, port):
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        stream = TlsStream(tcp, pki.client_context(), server_hostname="127.0.0.1")
        await stream.do_handshake()
        # An application-data record of 32 bytes that were never encrypted by us.
        await tcp.send_all(b"\x17\x03\x03\x00\x20" + bytes(range(32)))
        with trio.fail_after(5), pytest.raises(trio.BrokenResourceError):
            while await stream.receive_some():
                pass
            raise trio.BrokenResourceError("ended")  # a clean end counts too
        stream.discard()
        await tcp.aclose()
        async with open_client("127.0.0.1", port, ca=pki.ca_file) as client:
            reply = await client.request(Ping(text="still here"), to="echo", timeout=5)
        assert reply.payload[0].text == "still here"
        assert server.counters["accepted"] == 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
