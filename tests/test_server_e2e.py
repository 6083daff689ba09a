"""End to end over real sockets: the server runs as a subprocess on a free port."""

from __future__ import annotations

import base64

import pytest
import trio
from e2e_handlers import Crash, Job, Note, Record, Relay, Silent, Wrong
from lxml import etree
from serverproc import RawConnection, ServerProcess

from agentserver.core.envelope import build_envelope
from agentserver.core.errors import HuhReason
from agentserver.core.threads import is_uuid4, new_thread_id
from agentserver.listeners.calculator import Add, Divide, Multiply
from agentserver.listeners.echo import Ping
from agentserver.net.client import ConnectionClosed, open_client
from agentserver.primitives.core import Boot, Hello

CORE = "https://xml-pipeline.org/ns/core/v1"


def huh_text(reply) -> str | None:
    return reply.payload.findtext(f"{{{CORE}}}error") if reply.is_huh else None


def envelope(payload, *, to=None, thread=None, sender="mallory") -> bytes:
    el = payload.to_xml_tree() if hasattr(payload, "to_xml_tree") else payload
    return etree.tostring(build_envelope(sender, to, thread or new_thread_id(), el))


async def test_echo_round_trip(server):
    async with open_client(server.host, server.port) as client:
        reply = await client.request(Ping(text="hello"), to="echo", timeout=5)
    assert reply.from_id == "echo"
    assert reply.payload_xml == '<pong xmlns="urn:agentserver:echo"><text>hello</text></pong>'
    assert reply.to.startswith("client-")


async def test_echo_routed_by_root_tag_without_to(server):
    async with open_client(server.host, server.port) as client:
        reply = await client.request(Ping(text="x"), timeout=5)
    assert reply.payload_xml.startswith("<pong")


async def test_calculator_round_trips(server):
    async with open_client(server.host, server.port) as client:
        total = await client.request(Add(a=2, b=40), to="calculator", timeout=5)
        product = await client.request(Multiply(a=-6, b=7), to="calculator", timeout=5)
        by_zero = await client.request(Divide(a=1, b=0), to="calculator", timeout=5)
    assert total.payload_xml == '<sum xmlns="urn:agentserver:calculator"><value>42</value></sum>'
    assert "<value>-42</value>" in product.payload_xml
    # an answer the caller can read (issue 10), not a handler failure
    assert by_zero.payload_xml == (
        '<error xmlns="urn:agentserver:calculator" status="failed"><code>division-by-zero</code>'
        "<message>cannot divide 1 by zero</message></error>"
    )


async def test_many_requests_in_flight_on_one_connection(server):
    """Replies are pushed as produced: a slow request does not hold up quick ones, and each
    reply carries its request's thread."""
    async with open_client(server.host, server.port) as client:
        results: dict[str, str] = {}

        async def one(i: int) -> None:
            payload = Job(text=f"job-{i}", seconds=0.4) if i == 0 else Ping(text=f"p{i}")
            reply = await client.request(payload, timeout=5)
            results[reply.thread] = (
                etree.QName(reply.payload).localname + ":" + reply.payload[0].text
            )

        order: list[int] = []
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(one, i)
                    order.append(i)
        assert len(results) == 40
        assert sorted(results.values()) == sorted(
            ["note:job-0", *(f"pong:p{i}" for i in range(1, 40))]
        )


async def test_replies_reach_the_right_connection_among_many(server):
    seen: dict[int, list[str]] = {}

    async def one_client(c: int) -> None:
        async with open_client(server.host, server.port) as client:
            threads = {}
            for i in range(10):
                t = await client.send(Ping(text=f"{c}/{i}"), to="echo")
                threads[t] = f"{c}/{i}"
            got = []
            for _ in range(10):
                reply = await client.receive()
                assert threads[reply.thread] == reply.payload[0].text
                got.append(reply.payload[0].text)
            seen[c] = got

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for c in range(25):
                nursery.start_soon(one_client, c)
    for c in range(25):
        assert sorted(seen[c]) == sorted(f"{c}/{i}" for i in range(10))


async def test_from_is_replaced_and_client_uuid4_thread_kept(server):
    thread = new_thread_id()
    async with open_client(server.host, server.port) as client:
        await client.send_raw(
            envelope(Record(text="who"), to="record", thread=thread, sender="echo")
        )
        reply = await client.receive()
    assert reply.thread == thread
    # The listener saw the connection's identity, not the claimed <from>.
    assert reply.payload[0].text == reply.to and reply.to.startswith("client-")


async def test_non_uuid_and_foreign_threads_are_replaced(server):
    async with (
        open_client(server.host, server.port) as a,
        open_client(server.host, server.port) as b,
    ):
        await a.send_raw(envelope(Ping(text="1"), to="echo", thread="not-a-uuid"))
        first = await a.receive()
        assert is_uuid4(first.thread)
        # b tries to talk on a's live conversation: it gets a thread of its own.
        busy = new_thread_id()
        await a.send_raw(envelope(Job(text="a", seconds=0.5), to="slow", thread=busy))
        await trio.sleep(0.2)  # a's job is in its handler
        await b.send_raw(envelope(Ping(text="2"), to="echo", thread=busy))
        second = await b.receive()
        assert is_uuid4(second.thread) and second.thread != busy
        assert (await a.receive()).thread == busy


@pytest.mark.parametrize(
    ("name", "body", "reason"),
    [
        ("malformed", b"<message><oops", HuhReason.MALFORMED),
        ("not utf-8", b"<message>\xff\xfe</message>", HuhReason.MALFORMED),
        (
            "no thread",
            b'<message xmlns="https://xml-pipeline.org/ns/envelope/v1"><meta><from>x</from></meta>'
            b'<ping xmlns="urn:agentserver:echo"><text>t</text></ping></message>',
            HuhReason.INVALID_ENVELOPE,
        ),
        (
            "two payloads",
            b'<message xmlns="https://xml-pipeline.org/ns/envelope/v1"><meta><from>x</from><thread>t</thread></meta>'
            b'<ping xmlns="urn:agentserver:echo"><text>t</text></ping><ping xmlns="urn:agentserver:echo"><text>t</text></ping></message>',
            HuhReason.INVALID_ENVELOPE,
        ),
        (
            "unknown root tag",
            envelope(etree.fromstring(b'<nope xmlns="urn:x"/>')),
            HuhReason.INVALID_PAYLOAD,
        ),
        (
            "payload fails its XSD",
            envelope(etree.fromstring(b'<add xmlns="urn:agentserver:calculator"><a>1</a></add>')),
            HuhReason.INVALID_PAYLOAD,
        ),
        ("unknown to", envelope(Ping(text="t"), to="nobody"), HuhReason.INVALID_PAYLOAD),
        (
            "to does not take it",
            envelope(Ping(text="t"), to="calculator"),
            HuhReason.INVALID_PAYLOAD,
        ),
        (
            "core payload",
            envelope(Boot(organism="x", timestamp="t", listener_count=1), to="boot"),
            HuhReason.RESERVED_NAMESPACE,
        ),
        (
            "hello without clients",
            envelope(Hello(client="a", token="b")),
            HuhReason.RESERVED_NAMESPACE,
        ),
        ("handler raises", envelope(Crash(text="t")), HuhReason.HANDLER_FAILED),
        ("handler returns a wrong type", envelope(Wrong(text="t")), HuhReason.HANDLER_FAILED),
    ],
)
async def test_refusals_seen_from_a_socket_client(server, name, body, reason):
    async with open_client(server.host, server.port) as client:
        await client.send_raw(body)
        with trio.fail_after(5):
            reply = await client.receive()
        assert reply.from_id == "system"
        assert huh_text(reply) == reason.value, name
        attempt = base64.b64decode(reply.payload.findtext(f"{{{CORE}}}original-attempt"))
        assert attempt == body[: len(attempt)]
        assert b"secret detail" not in reply.raw
        # Same connection, next request: still served.
        ok = await client.request(Ping(text="after"), to="echo", timeout=5)
        assert ok.payload[0].text == "after"


async def test_the_same_text_for_unknown_tag_bad_payload_and_bad_to(server):
    async with open_client(server.host, server.port) as client:
        texts = set()
        for body in (
            envelope(etree.fromstring(b'<nope xmlns="urn:x"/>')),
            envelope(etree.fromstring(b'<ping xmlns="urn:agentserver:echo"/>')),
            envelope(Ping(text="t"), to="nobody"),
        ):
            await client.send_raw(body)
            texts.add(huh_text(await client.receive()))
    assert texts == {HuhReason.INVALID_PAYLOAD.value}


async def test_handler_timeout_is_a_system_error(server):
    async with open_client(server.host, server.port) as client:
        reply = await client.request(Job(text="late", seconds=5), to="slow", timeout=5)
    assert reply.is_system_error
    assert reply.payload.findtext(f"{{{CORE}}}code") == "timeout"
    assert reply.payload.findtext(f"{{{CORE}}}retry-allowed") == "true"


async def test_forward_to_a_non_peer_returns_a_routing_error_to_the_sender(server):
    async with open_client(server.host, server.port) as client:
        reply = await client.request(Relay(text="x"), to="relay", timeout=5)
    # The relay listener got <SystemError> routing (retry allowed) and reported it.
    assert reply.payload_xml == '<note xmlns="urn:test:e2e"><text>routing:true</text></note>'


async def test_chain_ended_without_answer_leaves_the_connection_usable(server):
    async with open_client(server.host, server.port) as client:
        await client.send(Silent(text="x"), to="silent")
        with trio.move_on_after(0.3):
            await client.receive()
            pytest.fail("a chain ended with None must not be answered")
        assert (await client.request(Ping(text="y"), to="echo", timeout=5)).payload[0].text == "y"


async def test_oversize_length_prefix_gets_huh_and_close(server):
    conn = await RawConnection.open(server)
    with trio.fail_after(5):
        await conn.send_bytes((2**31).to_bytes(4, "big"))
        frame = await conn.receive_frame()
        assert HuhReason.TOO_LARGE.value.encode() in frame
        assert await conn.receive_frame() is None  # closed
    await conn.aclose()


async def test_note_model_is_what_the_slow_listener_answers(server):
    async with open_client(server.host, server.port) as client:
        reply = await client.request(Job(text="quick", seconds=0), to="slow", timeout=5)
    assert Note.from_xml_tree(reply.payload).text == "quick"


async def test_connections_beyond_the_limit_are_refused_with_a_system_error(tmp_path):
    boot_file = tmp_path / "small.xml"
    boot_file.write_text(
        '<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="small">'
        '<limits max-connections="2"/><listeners><listener name="echo" handler="echo"/></listeners>'
        "</organism>"
    )
    small = ServerProcess.start(boot_file)
    try:
        async with (
            open_client(small.host, small.port) as a,
            open_client(small.host, small.port) as b,
        ):
            for client in (a, b):  # both admitted
                assert (await client.request(Ping(text="in"), to="echo", timeout=5)).payload[
                    0
                ].text == "in"
            extra = await RawConnection.open(small)
            with trio.fail_after(5):
                frame = await extra.receive_frame()
                assert (
                    b"<code>routing</code>" in frame
                    and b"<retry-allowed>true</retry-allowed>" in frame
                )
                assert await extra.receive_frame() is None
            await extra.aclose()
        # Once they leave (the server notices the close asynchronously), new ones are served.
        with trio.fail_after(5):
            while True:
                async with open_client(small.host, small.port) as c:
                    try:
                        reply = await c.request(Ping(text="again"), to="echo", timeout=1)
                    except ConnectionClosed:
                        await trio.sleep(0.05)
                        continue
                    assert reply.payload[0].text == "again"
                    break
    finally:
        assert small.stop() == 0
