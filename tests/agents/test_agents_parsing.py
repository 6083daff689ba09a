import itertools

import pytest
from agents_fakes import CALC, profile
from hypothesis import given
from hypothesis import strategies as st
from lxml import etree

from agentserver.agents.events import EventBus, TaskEvent
from agentserver.agents.reading.decide import (
    CallTools,
    Deliver,
    Feedback,
    SelfIterate,
    Submit,
    decide,
)
from agentserver.agents.reading.parsing import PayloadKind, extract_payloads
from agentserver.agents.reading.quoting import quoted_spans

ADD = '<add xmlns="urn:calc"><a>1</a><b>2</b></add>'


def kinds(text, p=None):
    r = extract_payloads(text, p or profile())
    return [x.kind for x in r.payloads], [e.hint for e in r.errors]


PROSE = [
    "a < b and b > c",
    "if x<y and y>z then",
    "use the <b> tag for bold",
    "Use <br> for a line break",
    "the stray </b> end tag",
    "`<teleport><to>mars</to></teleport>` is how you would write it",
    "``<b>with a ` inside</b>`` is code",
    "```html\n<div class='x'>hi</div>\n```",
    "~~~python\nprint('<b>bold</b>')\n~~~\nand after it, nothing",
    "```html\n<p>an unclosed fence quotes to the end</p>",
    "<b and c> y </b> is not well-formed",
    "5 <3 is false, <= and <> are operators",
    "<p>one & two</p> has a bare ampersand",
]


@pytest.mark.parametrize("text", PROSE)
def test_prose_that_mentions_tags_is_prose(text):
    assert kinds(text) == ([], [])
    p = profile()
    assert decide(text, extract_payloads(text, p), p) == Deliver(text.strip())


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("<teleport><to>mars</to></teleport>", ["<teleport>"]),
        ("  <teleport/>  ", ["<teleport>"]),
        ("Here you go: <b>bold</b>.", ["<b>"]),
        ("```xml\n<teleport to='mars'/>\n```", ["<teleport>"]),
        ("```\n<fly>x</fly>\n```", ["<fly>"]),
        (
            "I'll go: <teleport/> then <fly><to>x</to></fly> and <teleport/>",
            ["<teleport>", "<fly>"],
        ),
        ('<sum xmlns="urn:other">3</sum>', ["<sum>"]),  # not the calculator's result
        ("<x:jump xmlns:x='urn:j'/>", ["<x:jump>"]),
    ],
)
def test_unknown_elements_earn_one_huh_naming_what_may_be_sent(text, named):
    p = profile()
    r = extract_payloads(text, p)
    assert r.payloads == [] and len(r.errors) == 1
    hint = r.errors[0].hint
    for name in named:
        assert name in hint
    assert "nothing was sent" in hint
    assert '<add xmlns="urn:calc"> (a tool call to calculator)' in hint
    assert '<task xmlns="urn:agentserver:assistant">' in hint and "<submit_result>" in hint
    assert isinstance(decide(text, r, p), Feedback)


def test_a_quoted_tool_result_is_prose_but_only_for_the_agent_that_reads_it():
    text = 'The calculator said <sum xmlns="urn:calc">3</sum>, and <sum>3</sum> too.'
    assert kinds(text) == ([], [])
    errors = kinds(text, profile(quotable=()))[1]
    assert len(errors) == 1 and "<sum> is not a payload" in errors[0]


def test_an_unknown_element_stops_the_known_payloads_of_the_same_reply():
    text = f"<tool_call>{ADD}</tool_call> and {ADD}"
    p = profile()
    r = extract_payloads(text, p)
    assert [x.kind for x in r.payloads] == [PayloadKind.TOOL]  # the one outside
    assert len(r.errors) == 1 and "<tool_call>" in r.errors[0].hint
    assert isinstance(decide(text, r, p), Feedback)  # nothing is called


def test_many_unclosed_start_tags_do_not_hide_a_later_element():
    text = "<a>" * 100_000 + "<b/>"
    r = extract_payloads(text, profile())
    assert len(r.errors) == 1 and "<b>" in r.errors[0].hint


# -- properties --------------------------------------------------------------------------

KNOWN_LOCALS = {"add", "query", "task", "answer", "submit_result"}
names = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(
    lambda n: n not in KNOWN_LOCALS and not n.startswith("xml")
)
# Prose that cannot quote anything (no backticks or tildes) and writes no element of its
# own, though it may use "<" as prose does.
prose = st.lists(
    st.one_of(
        st.text(
            st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="<`~"),
            max_size=30,
        ),
        st.sampled_from([" a < b ", " x <= y ", " 3<4 ", " the <b> tag ", " </i> "]),
    ),
    max_size=4,
).map("".join)
xml_text = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="`~"),
    max_size=20,
)


@st.composite
def unknown_elements(draw):
    name = draw(names)
    el = etree.Element(name)
    if draw(st.booleans()):
        el.set("to", draw(xml_text))
    el.text = draw(xml_text)
    if draw(st.booleans()):
        etree.SubElement(el, draw(names)).text = draw(xml_text)
    return name, etree.tostring(el, encoding="unicode")


@given(before=prose, after=prose, element=unknown_elements())
def test_an_unknown_element_anywhere_in_prose_earns_exactly_one_error(before, after, element):
    name, xml = element
    r = extract_payloads(before + xml + after, profile())
    assert r.payloads == [] and len(r.errors) == 1
    assert f"<{name}>" in r.errors[0].hint


@given(before=prose, after=prose, element=unknown_elements(), ticks=st.integers(1, 3))
def test_the_same_element_in_inline_code_is_prose(before, after, element, ticks):
    _, xml = element
    text = before + "`" * ticks + xml + "`" * ticks + after
    assert kinds(text) == ([], [])


@given(before=prose, after=prose, a=st.integers(-99, 99))
def test_a_known_payload_in_any_prose_is_found(before, after, a):
    call = f'<add xmlns="urn:calc"><a>{a}</a><b>1</b></add>'
    r = extract_payloads(before + call + after, profile())
    assert [(x.kind, x.to) for x in r.payloads] == [(PayloadKind.TOOL, "calculator")]
    assert r.errors == [] and r.payloads[0].element.findtext("{urn:calc}a") == str(a)


@given(st.text(st.sampled_from("<>/`~ab \n=\"'&;:x"), max_size=60))
def test_any_text_is_classified_without_raising_and_errors_are_real_elements(text):
    r = extract_payloads(text, profile())
    for error in r.errors:
        assert error.raw in text
        if "nothing was sent" in error.hint:  # an unknown element: it parses on its own
            assert etree.fromstring(error.raw.encode()) is not None


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


@given(st.text(st.sampled_from("`~ \nab<>xml\t"), max_size=80))
def test_quoted_spans_are_disjoint_and_inside_the_text(text):
    spans = quoted_spans(text).as_list()
    for (_, end_1), (start_2, _) in itertools.pairwise(spans):
        assert end_1 <= start_2
    for start, end in spans:
        assert 0 <= start < end <= len(text)
        assert text[start] in "`~ "  # a backtick run or a fence line (maybe indented)
        assert start in quoted_spans(text) and end not in quoted_spans(text)


@given(code=st.text(st.characters(exclude_characters="`", exclude_categories=("Cs",)), min_size=1))
def test_an_inline_code_span_quotes_exactly_its_text(code):
    text = "say `" + code + "` now"
    assert quoted_spans(text).as_list() == [(4, 4 + len(code) + 2)]


def test_the_model_is_told_how_to_mention_markup():
    from agentserver.agents.reading.submit import usage_text

    assert "put it in backticks" in usage_text(())


def test_deeply_nested_malformed_markup_is_refused_not_read_for_ever():
    text = "<a>" * 3000 + "&" + "</a>" * 3000  # each level fails to parse, from inside
    r = extract_payloads(text, profile())
    assert r.payloads == [] and [e.reason.name for e in r.errors] == ["TOO_LARGE"]
    shallow = "<a>" * 20 + "&" + "</a>" * 20  # well within the budget: prose
    assert kinds(shallow) == ([], [])
