"""Hostile input over the socket. Every case gets its documented outcome (docs/wire.md),
fast, and the server keeps serving normal clients afterwards. The whole suite runs twice:
over plaintext and over TLS (same assertions)."""

from __future__ import annotations

import random

import pytest
import trio
from lxml import etree
from serverproc import DATA, RawConnection, ServerProcess, open_stream
from tlsutil import make_pki, with_tls

from agentserver.core.envelope import build_envelope
from agentserver.core.errors import HuhReason
from agentserver.core.threads import new_thread_id
from agentserver.listeners.echo import Ping
from agentserver.net.client import open_client

ENV_HEAD = (
    b'<message xmlns="https://xml-pipeline.org/ns/envelope/v1"><meta><from>x</from>'
    b"<to>echo</to><thread>t</thread></meta>"
)
PING_OPEN = b'<ping xmlns="urn:agentserver:echo">'
PING_CLOSE = b"<text>t</text></ping></message>"

BILLION_LAUGHS = (
    b"""<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
 <!ENTITY lol5 "&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;">
 <!ENTITY lol6 "&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;">
 <!ENTITY lol7 "&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;">
 <!ENTITY lol8 "&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;">
 <!ENTITY lol9 "&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;">
]>
"""
    + ENV_HEAD
    + PING_OPEN
    + b"<text>&lol9;</text></ping></message>"
)

QUADRATIC = (
    b'<!DOCTYPE m [<!ENTITY a "'
    + b"x" * 50_000
    + b'">]>'
    + ENV_HEAD
    + PING_OPEN
    + b"<text>"
    + b"&a;" * 20_000
    + b"</text></ping></message>"
)

EXTERNAL_ENTITY = (
    b'<!DOCTYPE m [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
    + ENV_HEAD
    + PING_OPEN
    + b"<text>&x;</text></ping></message>"
)

EXTERNAL_DTD = (
    b'<!DOCTYPE message SYSTEM "http://127.0.0.1:9/evil.dtd">' + ENV_HEAD + PING_OPEN + PING_CLOSE
)

DEEP = ENV_HEAD + PING_OPEN + b"<a>" * 100_000 + b"</a>" * 100_000 + PING_CLOSE

MANY_ATTRIBUTES = (
    ENV_HEAD
    + b'<ping xmlns="urn:agentserver:echo"'
    + b"".join(b' a%d=""' % i for i in range(100_000))
    + b">"
    + b"<text>t</text></ping></message>"
)

INVALID_UTF8 = ENV_HEAD + PING_OPEN + b"<text>\xc3\x28\xff\xfe</text></ping></message>"

CORE_PAYLOAD = (
    ENV_HEAD.replace(b"<to>echo</to>", b"")
    + b'<huh xmlns="https://xml-pipeline.org/ns/core/v1"><error>Message could not be parsed.</error>'
    b"<original-attempt></original-attempt></huh></message>"
)


@pytest.fixture(scope="module", params=["plaintext", "tls"])
def server(request, tmp_path_factory):
    """The e2e server, as is or with <tls> (a copy of e2e-boot.xml next to its certificate)."""
    boot = DATA / "e2e-boot.xml"
    pki = None
    if request.param == "tls":
        pki = make_pki(tmp_path_factory.mktemp("tls"))
        boot = with_tls(boot, pki.dir / "boot.xml", cert="server.pem", key="server.key")
    proc = ServerProcess.start(boot)
    if pki is not None:
        proc.ssl_context = pki.client_context()
    yield proc
    assert proc.stop() == 0


async def assert_still_serving(server) -> None:
    async with open_client(server.host, server.port, **server.client_options) as client:
        reply = await client.request(Ping(text="still here"), to="echo", timeout=5)
    assert reply.payload_xml == '<pong xmlns="urn:agentserver:echo"><text>still here</text></pong>'


async def huh_for(server, body: bytes) -> bytes:
    conn = await RawConnection.open(server)
    try:
        with trio.fail_after(5):
            await conn.send_frame(body)
            frame = await conn.receive_frame()
    finally:
        await conn.aclose()
    assert frame is not None
    return frame


def huh_text(frame: bytes) -> str:
    root = etree.fromstring(frame)
    return root[1].findtext("{https://xml-pipeline.org/ns/core/v1}error")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        pytest.param(BILLION_LAUGHS, HuhReason.MALFORMED, id="billion laughs"),
        pytest.param(QUADRATIC, HuhReason.MALFORMED, id="quadratic blowup"),
        pytest.param(EXTERNAL_ENTITY, HuhReason.MALFORMED, id="external entity (file)"),
        pytest.param(EXTERNAL_DTD, HuhReason.MALFORMED, id="external DTD"),
        pytest.param(DEEP, HuhReason.MALFORMED, id="100k-deep nesting"),
        pytest.param(MANY_ATTRIBUTES, HuhReason.INVALID_PAYLOAD, id="100k attributes"),
        pytest.param(INVALID_UTF8, HuhReason.MALFORMED, id="invalid UTF-8"),
        pytest.param(
            random.Random(7).randbytes(5000), HuhReason.MALFORMED, id="random bytes in a frame"
        ),
        pytest.param(CORE_PAYLOAD, HuhReason.RESERVED_NAMESPACE, id="core-namespace payload"),
    ],
)
async def test_hostile_frame_gets_one_canned_huh(server, body, reason):
    assert len(body) < 1024 * 1024  # each fits in a frame: the parser, not the size, decides
    with trio.fail_after(5):
        frame = await huh_for(server, body)
        assert huh_text(frame) == reason.value
        assert b"root:" not in frame  # no file content leaks anywhere
        await assert_still_serving(server)


async def test_oversize_length_prefix_is_refused_before_the_body(server):
    conn = await RawConnection.open(server)
    with trio.fail_after(5):
        # Declares 3 GiB but sends nothing more: the answer must not wait for the body.
        await conn.send_bytes((3 * 2**30).to_bytes(4, "big"))
        frame = await conn.receive_frame()
        assert huh_text(frame) == HuhReason.TOO_LARGE.value
        assert await conn.receive_frame() is None
        await assert_still_serving(server)
    await conn.aclose()


async def test_short_body_then_silence_is_closed_after_the_read_timeout(server):
    conn = await RawConnection.open(server)
    # A bound, not a measure: without a read timeout the server would wait for the rest
    # of the body for ever (e2e-boot.xml: read-timeout="1").
    with trio.fail_after(30):
        start = trio.current_time()
        await conn.send_bytes((1000).to_bytes(4, "big") + b"<message>")
        assert await conn.receive_frame() is None  # closed, nothing sent
        # Not before the read timeout (a floor load can only raise, never break).
        assert trio.current_time() - start >= 0.8
        await assert_still_serving(server)
    await conn.aclose()


async def test_trickled_frame_is_closed_at_the_read_timeout_too(server):
    """A frame must arrive whole within read-timeout of its first byte; trickling bytes
    does not keep a connection alive (slowloris)."""
    conn = await RawConnection.open(server)
    # Declares more than the trickle ever sends (one byte per 0.1 s, at most 300): the
    # frame never completes, so only the read timeout (1 s from its first byte) closes
    # it; a timeout reset by each byte never would. Bounded, not timed.
    with trio.fail_after(60):
        await conn.send_bytes((10_000).to_bytes(4, "big"))
        closed, sent = False, 0
        while not closed and sent < 300:
            sent += 1
            try:
                await conn.send_bytes(b" ")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                closed = True
                break
            with trio.move_on_after(0.1):
                closed = await conn.receive_frame() is None
        assert closed, f"still open after trickling {sent} bytes"
        await assert_still_serving(server)
    await conn.aclose()


async def test_unframed_random_bytes_are_refused_and_closed(server):
    data = random.Random(1234).randbytes(64 * 1024)  # first four bytes declare ~3 GB
    conn = await RawConnection.open(server)
    with trio.fail_after(5):
        try:
            await conn.send_bytes(data)
        except trio.BrokenResourceError:
            pass  # the server may close while we are still writing
        frame = await conn.receive_frame()
        if frame is not None:
            assert huh_text(frame) == HuhReason.TOO_LARGE.value
            assert await conn.receive_frame() is None
        await assert_still_serving(server)
    await conn.aclose()


async def test_hostile_frame_does_not_disturb_a_concurrent_client(server):
    async with open_client(server.host, server.port, **server.client_options) as client:
        conn = await RawConnection.open(server)
        with trio.fail_after(5):
            await conn.send_frame(BILLION_LAUGHS)
            for i in range(20):
                reply = await client.request(Ping(text=str(i)), to="echo", timeout=5)
                assert reply.payload[0].text == str(i)
            assert huh_text(await conn.receive_frame()) == HuhReason.MALFORMED.value
        await conn.aclose()


async def test_client_that_never_reads_is_disconnected_and_others_are_fine(server):
    """Flood requests without reading replies: the server stops reading at max-inflight
    and, once its writes block, disconnects; memory stays bounded."""
    stream = await open_stream(server)
    body = etree.tostring(
        build_envelope("x", "echo", new_thread_id(), Ping(text="x" * 20_000).to_xml_tree())
    )
    frame = len(body).to_bytes(4, "big") + body
    with trio.fail_after(10):
        disconnected = False
        with trio.move_on_after(8):
            try:
                for _ in range(5000):
                    await stream.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                disconnected = True
        await assert_still_serving(server)
    await stream.aclose()
    # The server stopped reading (max-inflight), its replies filled the socket buffers,
    # and a write blocked past write-timeout (2 s in e2e-boot.xml): it hung up.
    assert disconnected
