"""The sans-IO cores of the server: framing and the hello handshake."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lxml import etree

from agentserver.core.envelope import build_envelope
from agentserver.core.framing import FrameDecoder, FrameTooLarge, encode_frame, encode_frames
from agentserver.core.handshake import (
    MAX_HELLO_BYTES,
    Credential,
    HelloGate,
    Unauthenticated,
    hello_frame_body,
)
from agentserver.core.threads import new_thread_id
from agentserver.listeners.echo import Ping


@given(
    bodies=st.lists(st.binary(max_size=300), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=7000), max_size=30),
)
def test_any_chunking_yields_the_same_frames(bodies, cuts):
    stream = encode_frames(bodies)
    assert stream == b"".join(encode_frame(b) for b in bodies)
    decoder = FrameDecoder(1000)
    out = []
    points = sorted({c for c in cuts if c < len(stream)} | {0, len(stream)})
    for start, end in itertools.pairwise(points):
        decoder.feed(stream[start:end])
        out.extend(decoder.frames())
    assert out == bodies
    assert not decoder.mid_frame and decoder.buffered == 0


def test_oversize_is_refused_from_the_header_alone():
    decoder = FrameDecoder(100)
    decoder.feed((101).to_bytes(4, "big"))
    with pytest.raises(FrameTooLarge) as info:
        decoder.next_frame()
    assert (info.value.declared, info.value.limit) == (101, 100)


def test_mid_frame_tracks_partial_headers_and_bodies():
    decoder = FrameDecoder(100)
    assert not decoder.mid_frame
    decoder.feed(b"\x00\x00")
    assert decoder.next_frame() is None and decoder.mid_frame
    decoder.feed(b"\x00\x03ab")
    assert decoder.next_frame() is None and decoder.mid_frame
    decoder.feed(b"c")
    assert decoder.next_frame() == b"abc" and not decoder.mid_frame


def test_take_remainder_hands_back_a_partly_read_frame():
    decoder = FrameDecoder(100)
    decoder.feed(encode_frame(b"one") + encode_frame(b"two")[:5])
    assert decoder.next_frame() == b"one"
    assert decoder.next_frame() is None  # header of "two" consumed, body partial
    rest = decoder.take_remainder()
    assert rest == encode_frame(b"two")[:5]
    assert decoder.buffered == 0 and not decoder.mid_frame


def test_zero_length_frames_and_bad_limits():
    decoder = FrameDecoder(10)
    decoder.feed(encode_frame(b"") * 2)
    assert decoder.frames() == [b"", b""]
    with pytest.raises(ValueError):
        FrameDecoder(0)


# -- hello -------------------------------------------------------------------------------

GATE = HelloGate(
    {
        "alice": Credential("s3cret"),
        "bob": Credential(None),
        "cy": Credential("t", frozenset({"echo"})),
    }
)


def test_valid_hello_gives_the_identity():
    identity = GATE.check(hello_frame_body("alice", "s3cret"))
    assert identity.name == "alice" and identity.allowed is None
    assert GATE.check(hello_frame_body("cy", "t")).allowed == frozenset({"echo"})
    assert GATE.required and not HelloGate({}).required


@pytest.mark.parametrize(
    "frame",
    [
        hello_frame_body("alice", "wrong"),
        hello_frame_body("alice", ""),
        hello_frame_body("mallory", "s3cret"),
        hello_frame_body("bob", ""),  # its token variable is unset: it cannot connect
        etree.tostring(
            build_envelope("alice", None, new_thread_id(), Ping(text="hi").to_xml_tree())
        ),
        b'<hello xmlns="https://xml-pipeline.org/ns/core/v1"><client>alice</client><token>s3cret</token></hello>',
        b"<not xml",
        b"\xff" * 10,
        hello_frame_body("alice", "s3cret" + "x" * MAX_HELLO_BYTES),
    ],
)
def test_anything_else_is_unauthenticated(frame):
    with pytest.raises(Unauthenticated):
        GATE.check(frame)
