"""Routing decisions, as pure functions over the topology."""

from __future__ import annotations

import pytest
from conftest import Add, Note, Ping, Pong

from agentserver.core.errors import ConfigurationError, DeliveryRefused, InputRefused
from agentserver.core.listener import Listener
from agentserver.core.payloads import PayloadRegistry
from agentserver.core.routing import SELF_CALL, Forward, RoutingTable


async def h(p, m):
    return None


def table(*listeners):
    reg = PayloadRegistry()
    for lst in listeners:
        for m in lst.payload_types:
            reg.add(m)
    reg.add(Pong)
    return RoutingTable(listeners, {p.model: p for p in reg}), {p.model: p.tag for p in reg}


def test_inbound_by_tag_and_by_to():
    t, tag = table(Listener("echo", (Ping,), h), Listener("calc", (Add,), h))
    assert t.inbound(tag[Ping], None) == ("echo",)
    assert t.inbound(tag[Ping], "echo") == ("echo",)
    for args in [(tag[Ping], "calc"), (tag[Ping], "ghost"), (tag[Pong], None)]:
        with pytest.raises(InputRefused) as info:
            t.inbound(*args)
        assert info.value.reason.name == "INVALID_PAYLOAD"


def test_outbound_rules():
    t, tag = table(
        Listener("agent", (Note,), h, peers=("calc",)),
        Listener("calc", (Add,), h),
        Listener("echo", (Ping,), h),
    )
    assert t.outbound("agent", tag[Note], None) is SELF_CALL
    assert t.outbound("agent", tag[Note], "agent") is SELF_CALL
    assert t.outbound("agent", tag[Add], "calc") == Forward(("calc",))
    assert t.outbound("agent", tag[Add], None) == Forward(("calc",))
    with pytest.raises(DeliveryRefused):
        t.outbound("agent", tag[Ping], "echo")  # not a peer
    with pytest.raises(DeliveryRefused):
        t.outbound("agent", tag[Ping], None)
    with pytest.raises(DeliveryRefused):
        t.outbound("calc", tag[Ping], "echo")  # a listener without peers cannot forward
    with pytest.raises(InputRefused):
        t.outbound("agent", tag[Ping], "calc")  # a peer that does not take the tag
    with pytest.raises(InputRefused):
        t.outbound("agent", tag[Pong], None)  # nobody takes it


def test_broadcast_fan_out_limited_to_peers():
    t, tag = table(
        Listener("b1", (Ping,), h, broadcast=True),
        Listener("b2", (Ping,), h, broadcast=True),
        Listener("src", (Note,), h, peers=("b2",)),
    )
    assert t.inbound(tag[Ping], None) == ("b1", "b2")
    assert t.outbound("src", tag[Ping], None) == Forward(("b2",))


def test_shared_tag_without_broadcast_is_refused():
    with pytest.raises(ConfigurationError):
        table(Listener("x", (Ping,), h), Listener("y", (Ping,), h, broadcast=True))


@pytest.mark.parametrize("name", ["Upper", "dot.ted", "system", "", "a" * 65, "sp ace"])
def test_listener_names_are_checked(name):
    with pytest.raises(ConfigurationError):
        Listener(name, (Ping,), h)
