"""usage_instructions are generated from the peers' schemas."""

from __future__ import annotations

from conftest import Add, Note, Ping, Sum
from lxml import etree

from agentserver.core.listener import Listener
from agentserver.core.payloads import PayloadType
from agentserver.core.usage import RESPOND_WARNING, describe_payload
from agentserver.pump.pump import open_pump


async def h(p, m):
    return None


def test_describe_payload_lists_fields_and_a_valid_example():
    ptype = PayloadType.from_model(Add)
    text = describe_payload(ptype)
    assert '<add xmlns="urn:test:pump">' in text
    assert "<a>: integer" in text and "<b>: integer" in text
    example = text.split("example: ", 1)[1]
    assert ptype.schema.validate(etree.fromstring(example))


async def test_instructions_name_every_peer_and_end_with_the_warning():
    listeners = [
        Listener("agent", (Note,), h, peers=("calc", "echo")),
        Listener("calc", (Add,), h, responses=(Sum,)),
        Listener("echo", (Ping,), h),
    ]
    async with open_pump(listeners) as pump:
        text = pump.usage_instructions("agent")
        lonely = pump.usage_instructions("echo")
    assert "peer 'calc'" in text and "peer 'echo'" in text
    assert "<note" in text  # its own root tag, for self-iteration
    assert text.endswith(RESPOND_WARNING)
    assert "no peers" in lonely and lonely.endswith(RESPOND_WARNING)


async def test_each_peer_type_is_described_once_however_many_listeners_name_it(monkeypatch):
    import agentserver.pump.roster as pump_module

    described: list[str] = []

    def counting(ptype: PayloadType) -> str:
        described.append(ptype.local)
        return describe_payload(ptype)

    monkeypatch.setattr(pump_module, "describe_payload", counting)
    listeners = [
        Listener("a", (Note,), h, peers=("calc", "echo")),
        Listener("b", (Sum,), h, peers=("calc", "echo")),
        Listener("calc", (Add,), h, peers=("echo",)),
        Listener("echo", (Ping,), h),
    ]
    async with open_pump(listeners) as pump:
        assert "peer 'calc'" in pump.usage_instructions("b")
        assert "peer 'echo'" in pump.usage_instructions("calc")
    assert sorted(described) == ["add", "ping"]
