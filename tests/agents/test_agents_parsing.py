from agents_fakes import CALC, profile
from lxml import etree

from agentserver.agents.decide import CallTools, Deliver, Feedback, SelfIterate, Submit, decide
from agentserver.agents.events import EventBus, TaskEvent
from agentserver.agents.parsing import PayloadKind, extract_payloads


def kinds(text, p=None):
    r = extract_payloads(text, p or profile())
    return [x.kind for x in r.payloads], [e.hint for e in r.errors]


def test_prose_and_unknown_tags_are_not_payloads():
    assert kinds("a < b and <b>bold</b> <sum xmlns='urn:x'>3</sum>") == ([], [])


def test_payloads_with_and_without_namespace():
    text = 'call <add xmlns="urn:calc"><a>1</a></add> then <query><q>x</q></query>'
    r = extract_payloads(text, profile())
    assert [p.kind for p in r.payloads] == [PayloadKind.TOOL, PayloadKind.TOOL]
    q = r.payloads[1]
    assert q.to == "search" and q.element.tag == "{urn:search}query"
    assert q.element[0].tag == "{urn:search}q"  # children follow the resolved namespace


def test_ambiguous_wrong_namespace_and_malformed_payloads_are_errors():
    p = profile(peers={CALC: "calculator", "{urn:other}add": "adder"})
    assert kinds("<add>1</add>", p)[1] == ["<add> is ambiguous: write its namespace"]
    assert "not a payload" in kinds('<add xmlns="urn:wrong"/>')[1][0]
    assert "not closed" in kinds("<add xmlns='urn:calc'><a>1</a>")[1][0]
    assert "not well-formed" in kinds("<add xmlns='urn:calc'>&xxe;</add>")[1][0]


def test_entities_are_never_expanded():
    text = '<!DOCTYPE x [<!ENTITY e "boom">]><add xmlns="urn:calc">&e;</add>'
    _, errors = kinds(text)
    assert errors  # undefined entity: refused, not expanded


def test_nested_same_name_and_self_closing():
    r = extract_payloads(
        '<task><text><task>inner</task></text></task> <add xmlns="urn:calc"/>', profile()
    )
    assert [p.kind for p in r.payloads] == [PayloadKind.SELF, PayloadKind.TOOL]


def test_decide_rules():
    p = profile()
    d = decide("x", extract_payloads("<task><text>go</text></task>", p), p)
    assert isinstance(d, SelfIterate)
    mixed = "<task><text>go</text></task><add xmlns='urn:calc'/>"
    assert isinstance(decide(mixed, extract_payloads(mixed, p), p), Feedback)
    two = "<add xmlns='urn:calc'/><query xmlns='urn:search'/>"
    assert isinstance(decide(two, extract_payloads(two, p), p), CallTools)
    ans = "<answer><text> 42 </text></answer>"
    assert decide(ans, extract_payloads(ans, p), p) == Deliver("42")
    sub = "<submit_result>1</submit_result>"
    assert isinstance(decide(sub, extract_payloads(sub, p), p), Submit)
    assert isinstance(decide(sub * 2, extract_payloads(sub * 2, p), p), Feedback)


async def test_event_bus_is_bounded_and_never_blocks():
    bus = EventBus()
    sub = bus.subscribe(capacity=2)
    for i in range(5):
        bus.publish(TaskEvent("a", str(i), "succeeded", "b", "c"))
    assert [e.agent_turn_id for e in sub.drain()] == ["0", "1"] and sub.dropped == 3
    sub.close()
    bus.publish(TaskEvent("a", "x", "succeeded", "b", "c"))  # no subscriber: fine
    assert etree  # keep the import used
