"""The sans-IO side of reply acknowledgement: the hello's ``ack`` attribute and the
``<ack>`` frames the server consumes (docs/wire.md, "Reply acknowledgement")."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lxml import etree

from agentserver.core.envelope import build_envelope
from agentserver.core.handshake import (
    MAX_ACK_IDS,
    AckReader,
    Credential,
    HelloGate,
    Unauthenticated,
    ack_frame_body,
    hello_frame_body,
)
from agentserver.core.namespaces import CORE_NS
from agentserver.core.threads import new_thread_id
from agentserver.listeners.echo import Ping

READER = AckReader(1 << 20)


@given(st.lists(st.integers(min_value=1, max_value=2**62), max_size=MAX_ACK_IDS))
def test_an_ack_frame_gives_back_its_ids(ids):
    assert READER.ids(ack_frame_body("alice", ids)) == ids


@given(st.binary(max_size=512))
def test_any_bytes_are_an_ack_or_not_never_an_error(data):
    got = READER.ids(data)
    assert got is None or all(isinstance(i, int) for i in got)


def test_frames_that_are_not_acks_go_on_to_the_pump():
    too_many = ack_frame_body("alice", list(range(1, MAX_ACK_IDS + 2)))
    other_ns = etree.Element("{urn:x}ack")
    etree.SubElement(other_ns, "{urn:x}id").text = "1"
    bad_id = etree.Element(f"{{{CORE_NS}}}ack")
    etree.SubElement(bad_id, f"{{{CORE_NS}}}id").text = "one"
    for frame in (
        too_many,
        hello_frame_body("alice", "t", ack=True),
        etree.tostring(build_envelope("alice", None, new_thread_id(), other_ns)),
        etree.tostring(build_envelope("alice", None, new_thread_id(), bad_id)),
        etree.tostring(
            build_envelope("alice", "echo", new_thread_id(), Ping(text="x").to_xml_tree())
        ),
        ack_frame_body("alice", [1])
        .replace(b"<message", b"<massage")
        .replace(b"message>", b"massage>"),
    ):
        assert READER.ids(frame) is None, frame


def test_the_hello_asks_for_acks_only_when_told():
    gate = HelloGate({"alice": Credential("t")})
    assert gate.check(hello_frame_body("alice", "t", ack=True)).ack is True
    plain = hello_frame_body("alice", "t")
    assert b"ack" not in plain and gate.check(plain).ack is False
    with pytest.raises(Unauthenticated):
        gate.check(plain.replace(b"<hello ", b'<hello ack="maybe" '))


def test_a_certificate_named_client_may_ask_for_acks_with_a_hello():
    """With mutual TLS the certificate names the client; a hello (token unchecked, even
    empty) only negotiates acknowledgement, and must name the same client."""
    gate = HelloGate({"alice": Credential(None)})
    assert gate.certificate_hello(hello_frame_body("alice", "", ack=True), "alice") is True
    assert gate.certificate_hello(hello_frame_body("alice", "anything"), "alice") is False
    with pytest.raises(Unauthenticated):
        gate.certificate_hello(hello_frame_body("mallory", "", ack=True), "alice")
    request = etree.tostring(
        build_envelope("alice", "echo", new_thread_id(), Ping(text="hi").to_xml_tree())
    )
    assert gate.certificate_hello(request, "alice") is None  # a request: for the reader
    assert gate.certificate_hello(b"\x00garbage", "alice") is None
