"""Identity and access over the socket when boot.xml declares clients."""

from __future__ import annotations

import pytest
import trio
from e2e_handlers import Record
from lxml import etree
from serverproc import DATA, RawConnection, ServerProcess, subprocess_env

from agentserver.core.envelope import build_envelope
from agentserver.core.errors import HuhReason
from agentserver.core.handshake import hello_frame_body
from agentserver.core.threads import new_thread_id
from agentserver.listeners.echo import Ping
from agentserver.net.client import ConnectionClosed, open_client

ALICE = "alice-token-0123456789"
BOB = "bob-token-9876543210"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    record = tmp_path_factory.mktemp("record") / "seen.txt"
    record.write_text("")
    env = subprocess_env(E2E_ALICE_TOKEN=ALICE, E2E_BOB_TOKEN=BOB, E2E_RECORD_FILE=str(record))
    env.pop("E2E_CAROL_TOKEN_UNSET", None)
    proc = ServerProcess.start(DATA / "clients-boot.xml", env=env)
    proc.record = record
    yield proc
    assert proc.stop() == 0


def record_frame(text: str) -> bytes:
    payload = Record(text=text).to_xml_tree()
    return etree.tostring(build_envelope("alice", "record", new_thread_id(), payload))


async def expect_refused(conn: RawConnection) -> None:
    with trio.fail_after(5):
        frame = await conn.receive_frame()
        assert frame is not None and HuhReason.UNAUTHENTICATED.value.encode() in frame
        assert await conn.receive_frame() is None  # and the connection is closed


async def test_correct_hello_then_requests_work(guarded):
    async with open_client(guarded.host, guarded.port, client="alice", token=ALICE) as client:
        reply = await client.request(Record(text="hi"), to="record", timeout=5)
        # The listener sees the authenticated name as the sender.
        assert reply.payload[0].text == "alice" and reply.to == "alice"
        pong = await client.request(Ping(text="x"), to="echo", timeout=5)
        assert pong.payload[0].text == "x"


async def test_second_connection_of_one_client_gets_a_distinct_identity(guarded):
    async with (
        open_client(guarded.host, guarded.port, client="alice", token=ALICE) as one,
        open_client(guarded.host, guarded.port, client="alice", token=ALICE) as two,
    ):
        first = await one.request(Record(text="1"), to="record", timeout=5)
        second = await two.request(Record(text="2"), to="record", timeout=5)
    names = {first.payload[0].text, second.payload[0].text}
    assert "alice" in names and any(n.startswith("alice-") for n in names)


@pytest.mark.parametrize(
    "first_frame",
    [
        pytest.param(record_frame("no hello"), id="message instead of hello"),
        pytest.param(hello_frame_body("alice", "wrong-token"), id="wrong token"),
        pytest.param(hello_frame_body("mallory", ALICE), id="unknown client"),
        pytest.param(hello_frame_body("carol", ""), id="client whose token is unset"),
        pytest.param(b"<hello/>", id="bare element"),
        pytest.param(b"\x00\xff garbage", id="garbage"),
    ],
)
async def test_anything_but_a_valid_hello_is_refused_and_closed(guarded, first_frame):
    conn = await RawConnection.open(guarded)
    await conn.send_frame(first_frame)
    # A message right behind a bad hello must not reach a listener either.
    await conn.send_frame(record_frame("behind a bad hello"))
    await expect_refused(conn)
    await conn.aclose()
    assert "hello" not in guarded.record.read_text()


async def test_oversize_first_frame_is_refused_without_reading_it(guarded):
    conn = await RawConnection.open(guarded)
    await conn.send_bytes((10_000).to_bytes(4, "big"))
    await expect_refused(conn)
    await conn.aclose()


async def test_silence_instead_of_hello_is_refused_after_the_hello_timeout(guarded):
    conn = await RawConnection.open(guarded)
    with trio.fail_after(4):
        await expect_refused(conn)
    await conn.aclose()


async def test_frames_sent_right_behind_the_hello_are_served(guarded):
    conn = await RawConnection.open(guarded)
    ping = etree.tostring(
        build_envelope("x", "echo", new_thread_id(), Ping(text="fast").to_xml_tree())
    )
    await conn.send_bytes(
        len(hello := hello_frame_body("alice", ALICE)).to_bytes(4, "big")
        + hello
        + len(ping).to_bytes(4, "big")
        + ping
    )
    with trio.fail_after(5):
        frame = await conn.receive_frame()
    assert b"<text>fast</text>" in frame
    await conn.aclose()


async def test_may_address_limits_what_a_client_reaches(guarded):
    async with open_client(guarded.host, guarded.port, client="bob", token=BOB) as client:
        ok = await client.request(Ping(text="b"), to="echo", timeout=5)
        assert ok.payload[0].text == "b"
        refused = await client.request(Record(text="bob was here"), to="record", timeout=5)
        assert refused.is_huh and refused.error_text == HuhReason.INVALID_PAYLOAD.value
    assert "bob was here" not in guarded.record.read_text()


async def test_client_library_reports_the_refusal(guarded):
    with pytest.raises(ConnectionClosed):
        async with open_client(guarded.host, guarded.port, client="alice", token="nope") as client:
            reply = await client.request(Ping(text="x"), to="echo", timeout=5)
            # The canned refusal arrives on the hello's thread, so request() sees the close.
            pytest.fail(f"unexpected reply {reply}")
