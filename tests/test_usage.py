"""usage_instructions are generated from the peers' schemas."""

from __future__ import annotations

from conftest import Add, Note, Ping, Sum
from lxml import etree

from agentserver.core.listener import Listener
from agentserver.core.payloads import PayloadType
from agentserver.core.usage import RESPOND_WARNING, describe_payload, task_form
from agentserver.core.xsdpayload import schema_model
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


_SCHEMA = b"""<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema" targetNamespace="urn:s"
    xmlns="urn:s" elementFormDefault="qualified">
  <xs:element name="query" type="xs:string"/>
  <xs:element name="note">
    <xs:complexType><xs:sequence>
      <xs:element name="text" type="xs:string"/>
      <xs:any namespace="##other" processContents="lax" minOccurs="0"/>
    </xs:sequence></xs:complexType>
  </xs:element>
  <xs:element name="bag">
    <xs:complexType><xs:sequence><xs:any namespace="##other"/></xs:sequence></xs:complexType>
  </xs:element>
</xs:schema>"""


def test_a_schema_payload_with_a_text_root_or_a_wildcard_is_described():
    # A payload declared by an XSD file may have a root of a simple type, or an xs:any
    # among its children: both were read as if neither could be (AttributeError).
    doc = etree.fromstring(_SCHEMA)
    query, note, bag = (
        PayloadType.from_model(schema_model(doc, f"{{urn:s}}{name}", "s.xsd"))
        for name in ("query", "note", "bag")
    )
    text = describe_payload(query)
    assert "  text: string" in text
    assert query.schema.validate(etree.fromstring(text.split("example: ", 1)[1]))
    assert task_form(query).field == ""
    text = describe_payload(note)
    assert "  <text>: string\n  any element of namespace ##other (optional)\n" in text
    assert note.schema.validate(etree.fromstring(text.split("example: ", 1)[1]))
    assert task_form(note).field is None  # more than its text
    assert "  any element of namespace ##other\n" in describe_payload(bag)
    assert task_form(bag).field is None


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
