"""The XSD → GBNF conversion (agentserver/core/xsd_gbnf.py) against the XSDs themselves.

For the project's own payload types and for schemas hypothesis makes up:

- completeness: every document the XSD accepts, written as a serializer writes it
  (canonical values, declared order), is accepted by the grammar;
- soundness: every string the grammar accepts (documents mutated at random, and
  documents breaking one rule on purpose) parses and validates against the XSD.

Grammar acceptance is decided by tests/gbnf.py, a small GBNF matcher; that llama.cpp
itself reads the grammars is tests/test_local_model.py's business.
"""

from __future__ import annotations

import base64
import string

import pytest
from gbnf import Matcher
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from agentserver.core.payloads import PayloadType
from agentserver.core.xsd_gbnf import (
    GrammarUnsupported,
    document_grammar,
    int_range,
    reply_grammar,
)
from agentserver.listeners import assistant, calculator, echo
from agentserver.primitives import approval, core

XS = "http://www.w3.org/2001/XMLSchema"
NS = "urn:test:gbnf"

PROJECT_MODELS = [
    calculator.Add,
    calculator.Subtract,
    calculator.Multiply,
    calculator.Divide,
    calculator.Sum,
    calculator.CalculatorError,
    echo.Ping,
    assistant.Task,
    assistant.Answer,
    core.Huh,
    core.SystemErrorPayload,
    core.Hello,
    core.Boot,
    core.Serve,
    core.Outcome,
    approval.ApprovalRequest,
    approval.ApprovalDecision,
]


# -- valid documents, from the schema ------------------------------------------------

_WORD = st.text(
    alphabet=string.ascii_letters + string.digits + "_.,;:!?'()[]{}é€", min_size=1, max_size=6
)
_TEXT_ALPHABET = string.ascii_letters + string.digits + " _.,;:!?'\"()é€\t\n"
_ATTR_ALPHABET = string.ascii_letters + string.digits + " _.,;:!?'()é€"


def _xsd_schema(ptype: PayloadType):
    import xmlschema

    return xmlschema.XMLSchema(etree.tostring(ptype.schema_doc, encoding="unicode"))


def _builtin(t) -> str:
    base = t
    while base is not None:
        if getattr(base, "target_namespace", None) == XS and base.local_name:
            return base.local_name
        base = getattr(base, "base_type", None)
    return "string"


def _facet(t, name):
    base = t
    while base is not None and getattr(base, "facets", None) is not None:
        if getattr(base, "target_namespace", None) != XS:
            f = base.facets.get(f"{{{XS}}}{name}")
            if f is not None:
                return f.value
        base = getattr(base, "base_type", None)
    return None


_RANGES = {
    "long": (-(2**63), 2**63 - 1),
    "int": (-(2**31), 2**31 - 1),
    "short": (-(2**15), 2**15 - 1),
    "byte": (-128, 127),
    "unsignedByte": (0, 255),
    "unsignedInt": (0, 2**32 - 1),
    "nonNegativeInteger": (0, 10**30),
    "positiveInteger": (1, 10**30),
    "integer": (-(10**30), 10**30),
}


def simple_value(t, attribute: bool) -> st.SearchStrategy[str]:
    enum = getattr(t, "enumeration", None)
    if enum:
        return st.sampled_from([str(v) for v in enum])
    base = _builtin(t)
    if base in _RANGES:
        lo, hi = _RANGES[base]
        if (v := _facet(t, "minInclusive")) is not None:
            lo = max(lo, int(v))
        if (v := _facet(t, "maxInclusive")) is not None:
            hi = min(hi, int(v))
        return st.integers(lo, hi).map(str)
    if base == "boolean":
        return st.sampled_from(["true", "false", "1", "0"])
    if base in ("decimal", "double", "float"):
        return st.tuples(st.integers(-(10**9), 10**9), st.none() | st.integers(0, 999)).map(
            lambda p: str(p[0]) + ("" if p[1] is None else f".{p[1]}")
        )
    if base == "base64Binary":
        return st.binary(max_size=12).map(lambda b: base64.b64encode(b).decode())
    if base == "token":
        return st.lists(_WORD, max_size=3).map(" ".join)
    lo = _facet(t, "minLength") or 0
    hi = _facet(t, "maxLength")
    alphabet = _ATTR_ALPHABET if attribute else _TEXT_ALPHABET
    if attribute:
        alphabet = alphabet.replace('"', "")
    return st.text(alphabet=alphabet, min_size=lo, max_size=8 if hi is None else hi)


@st.composite
def element_of(draw, decl, ns: str, parent: etree._Element | None = None) -> etree._Element:
    tag = f"{{{ns}}}{decl.local_name}"
    el = etree.Element(tag, nsmap={None: ns}) if parent is None else etree.SubElement(parent, tag)
    t = decl.type
    if t.is_simple():
        el.text = draw(simple_value(t, False)) or None
        return el
    for name, attr in t.attributes.items():
        if attr.use == "required" or draw(st.booleans()):
            el.set(name, draw(simple_value(attr.type, True)))
    if t.has_simple_content():
        el.text = draw(simple_value(t.content, False)) or None
    elif t.content is not None and len(t.content):
        draw(group_of(t.content, ns, el))
    return el


@st.composite
def group_of(draw, group, ns: str, parent: etree._Element) -> None:
    particles = list(group)
    if group.model == "choice":
        particles = [draw(st.sampled_from(particles))]
    for particle in particles:
        hi = particle.max_occurs if particle.max_occurs is not None else particle.min_occurs + 2
        n = draw(st.integers(particle.min_occurs, min(hi, particle.min_occurs + 2)))
        for _ in range(n):
            if hasattr(particle, "model"):
                draw(group_of(particle, ns, parent))
            else:
                draw(element_of(particle, ns, parent))


def document(ptype: PayloadType) -> st.SearchStrategy[etree._Element]:
    schema = _xsd_schema(ptype)
    return element_of(schema.elements[ptype.local], ptype.namespace)


def written(el: etree._Element) -> str:
    return etree.tostring(el, encoding="unicode")


def valid(ptype: PayloadType, text: str) -> bool:
    try:
        el = etree.fromstring(text.encode())
    except etree.XMLSyntaxError:
        return False
    return ptype.schema.validate(el)


# -- mutations -------------------------------------------------------------------------

_NOISE = st.sampled_from([*'0123456789-</>"= ab.x', "</a>", "<a>", "&amp;", "  "])


@st.composite
def mutated(draw, text: str) -> str:
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        if op == "insert":
            text = text[:i] + draw(_NOISE) + text[i:]
        elif op == "delete" and text:
            j = min(len(text), i + draw(st.integers(1, 4)))
            text = text[:i] + text[j:]
        elif text:
            j = min(len(text), i + 1)
            text = text[:i] + draw(_NOISE) + text[j:]
    return text


#: Values put in place of a value: canonical in every type that accepts them, so the
#: serialization stays one the grammar is meant to accept exactly when the XSD does.
_VALUES = ["", "0", "-1", "x", "true", "99999999999999999999", "a b", "AA==", "1.5"]


@st.composite
def broken(draw, el: etree._Element) -> etree._Element:
    """``el`` with one to three rules of its schema likely broken, as a tree (so it is
    written canonically): an attribute removed, changed or added, an element removed,
    repeated or moved, a value replaced."""
    import copy

    el = copy.deepcopy(el)
    for _ in range(draw(st.integers(1, 3))):
        nodes = [el, *el.iterdescendants()]
        node = draw(st.sampled_from(nodes))
        op = draw(
            st.sampled_from(["drop-attr", "set-attr", "new-attr", "drop", "repeat", "swap", "text"])
        )
        if op == "drop-attr" and node.attrib:
            del node.attrib[draw(st.sampled_from(sorted(node.attrib)))]
        elif op == "set-attr" and node.attrib:
            node.set(draw(st.sampled_from(sorted(node.attrib))), draw(st.sampled_from(_VALUES)))
        elif op == "new-attr":
            node.set("zz", "1")
        elif op in ("drop", "repeat", "swap") and node is not el:
            parent = node.getparent()
            if op == "drop":
                parent.remove(node)
            elif op == "repeat":
                node.addnext(copy.deepcopy(node))
            else:
                nxt = node.getnext()
                if nxt is not None:
                    nxt.addnext(node)
        elif op == "text" and len(node) == 0:
            node.text = draw(st.sampled_from(_VALUES)) or None
    return el


# -- the project's payload types -------------------------------------------------------

PROJECT_TYPES = [PayloadType.from_model(m) for m in PROJECT_MODELS]
_GRAMMARS = {p.tag: Matcher(document_grammar([p])) for p in PROJECT_TYPES}

_FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("ptype", PROJECT_TYPES, ids=lambda p: p.local)
@_FAST
@given(data=st.data())
def test_every_valid_project_payload_is_accepted(ptype, data):
    el = data.draw(document(ptype))
    text = written(el)
    assert ptype.schema.validate(el), text  # the generator makes valid documents
    assert _GRAMMARS[ptype.tag].accepts(text), text


@pytest.mark.parametrize("ptype", PROJECT_TYPES, ids=lambda p: p.local)
@_FAST
@given(data=st.data())
def test_what_the_grammar_accepts_of_a_project_payload_validates(ptype, data):
    text = data.draw(mutated(written(data.draw(document(ptype)))))
    if _GRAMMARS[ptype.tag].accepts(text):
        assert valid(ptype, text), text


@pytest.mark.parametrize("ptype", PROJECT_TYPES, ids=lambda p: p.local)
@_FAST
@given(data=st.data())
def test_a_broken_project_payload_is_refused_exactly_when_its_xsd_refuses_it(ptype, data):
    el = data.draw(broken(data.draw(document(ptype))))
    text = written(el)
    assert _GRAMMARS[ptype.tag].accepts(text) == ptype.schema.validate(el), text


def test_the_calculator_grammar_refuses_what_its_xsd_refuses():
    add = PayloadType.from_model(calculator.Add)
    g = Matcher(document_grammar([add]))
    ok = '<add xmlns="urn:agentserver:calculator"><a>2</a><b>-3</b></add>'
    assert g.accepts(ok) and valid(add, ok)
    for bad in [
        '<add xmlns="urn:agentserver:calculator"><a>2</a></add>',  # b is required
        '<add xmlns="urn:agentserver:calculator"><b>2</b><a>3</a></add>',  # order
        '<add xmlns="urn:agentserver:calculator"><a>2.5</a><b>3</b></add>',  # not an integer
        '<add xmlns="urn:agentserver:calculator"><a>9223372036854775808</a><b>3</b></add>',
        '<add xmlns="urn:other"><a>2</a><b>3</b></add>',  # namespace
        '<add xmlns="urn:agentserver:calculator"><a>2</a><b>3</b><c>4</c></add>',
    ]:
        assert not g.accepts(bad), bad
        assert not valid(add, bad), bad


def test_an_enumeration_and_an_optional_attribute():
    error = PayloadType.from_model(calculator.CalculatorError)
    g = Matcher(document_grammar([error]))
    schema = _xsd_schema(error)
    decl = schema.elements[error.local]
    # whatever the enumeration is, a value outside it is refused by both
    for name, attr in decl.type.attributes.items():
        if getattr(attr.type, "enumeration", None):
            doc = etree.Element(error.tag, nsmap={None: error.namespace})
            doc.set(name, "no-such-value")
            assert not g.accepts(written(doc))


def test_the_reply_grammar_is_prose_then_at_most_one_call():
    types = [PayloadType.from_model(m) for m in (calculator.Add, calculator.Multiply)]
    g = Matcher(reply_grammar(types, agent="assistant"))
    call = '<multiply xmlns="urn:agentserver:calculator"><a>6</a><b>7</b></multiply>'
    assert g.accepts("The answer is 42.")
    assert g.accepts("")
    assert g.accepts("Let me compute. " + call)
    assert not g.accepts("Let me compute. " + call + " done")  # nothing after the call
    assert not g.accepts(call + call)  # one call
    assert not g.accepts("a <b>bold</b> claim")  # no other markup
    assert not g.accepts('<sum xmlns="urn:agentserver:calculator"><value>5</value></sum>')


@pytest.mark.parametrize(
    ("lo", "hi"),
    [(0, 255), (-128, 127), (5, 1234), (None, None), (1, None), (None, -1), (-50, -7), (37, 37)],
)
def test_integer_ranges_are_exact(lo, hi):
    g = Matcher("root ::= " + int_range(lo, hi))
    for n in [*range(-1300, 1300, 7), 99, 100, 101, 999, 1000, 1001, 10**6, -(10**6)]:
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert g.accepts(str(n)) == inside, n
    assert not g.accepts("007") and not g.accepts("-0") and not g.accepts("+5")


# -- generated schemas -----------------------------------------------------------------

_SIMPLE_TYPES = [
    "long",
    "int",
    "short",
    "unsignedByte",
    "integer",
    "nonNegativeInteger",
    "positiveInteger",
    "boolean",
    "string",
    "token",
    "decimal",
    "double",
    "base64Binary",
]


def _xs(parent: etree._Element, kind: str, **attrs: str) -> etree._Element:
    return etree.SubElement(parent, f"{{{XS}}}{kind}", attrs)


@st.composite
def simple_type(draw, parent: etree._Element, attr: str = "type") -> None:
    """Give ``parent`` a simple type: a built-in by name, or a restriction."""
    kind = draw(st.sampled_from(["builtin", "builtin", "enum", "range", "length"]))
    if kind == "builtin":
        parent.set(attr, "xs:" + draw(st.sampled_from(_SIMPLE_TYPES)))
        return
    simple = _xs(parent, "simpleType")
    if kind == "enum":
        r = _xs(simple, "restriction", base="xs:string")
        for v in draw(
            st.lists(
                st.text(string.ascii_lowercase, min_size=1, max_size=5),
                min_size=1,
                max_size=4,
                unique=True,
            )
        ):
            _xs(r, "enumeration", value=v)
    elif kind == "range":
        r = _xs(
            simple, "restriction", base="xs:" + draw(st.sampled_from(["long", "integer", "int"]))
        )
        lo = draw(st.integers(-5000, 5000))
        _xs(r, "minInclusive", value=str(lo))
        _xs(r, "maxInclusive", value=str(lo + draw(st.integers(0, 20000))))
    else:
        r = _xs(simple, "restriction", base="xs:string")
        lo = draw(st.integers(0, 3))
        _xs(r, "minLength", value=str(lo))
        _xs(r, "maxLength", value=str(lo + draw(st.integers(0, 5))))


@st.composite
def complex_type(draw, element: etree._Element, depth: int, names: list[str]) -> None:
    ct = _xs(element, "complexType")
    group = _xs(ct, draw(st.sampled_from(["sequence", "choice"])))
    for _ in range(draw(st.integers(1, 3))):
        if depth < 2 and draw(st.integers(0, 5)) == 0:
            inner = _xs(group, draw(st.sampled_from(["sequence", "choice"])))
            target = inner
        else:
            target = group
        names.append(f"e{len(names)}")
        child = _xs(target, "element", name=names[-1])
        lo = draw(st.integers(0, 2))
        hi = draw(st.sampled_from([lo, lo + 1, lo + 2, None]))
        if lo != 1:
            child.set("minOccurs", str(lo))
        if hi is None:
            child.set("maxOccurs", "unbounded")
        elif hi != 1:
            child.set("maxOccurs", str(max(hi, 1)))
        if depth < 2 and draw(st.integers(0, 3)) == 0:
            draw(complex_type(child, depth + 1, names))
        else:
            draw(simple_type(child))
    for i in range(draw(st.integers(0, 2))):
        a = _xs(ct, "attribute", name=f"a{i}")
        if draw(st.booleans()):
            a.set("use", "required")
        draw(simple_type(a))


@st.composite
def generated_type(draw) -> PayloadType:
    root = etree.Element(
        f"{{{XS}}}schema",
        {"targetNamespace": NS, "elementFormDefault": "qualified"},
        nsmap={"xs": XS},
    )
    top = _xs(root, "element", name="r")
    draw(complex_type(top, 0, []))
    doc = etree.fromstring(etree.tostring(root))
    return PayloadType(None, f"{{{NS}}}r", NS, "r", doc, etree.XMLSchema(doc))  # type: ignore[arg-type]


_GENERATED = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_GENERATED
@given(data=st.data())
def test_generated_schemas_accept_every_valid_document_and_refuse_invalid_ones(data):
    ptype = data.draw(generated_type())
    g = Matcher(document_grammar([ptype]))
    for _ in range(3):
        el = data.draw(document(ptype))
        text = written(el)
        assert ptype.schema.validate(el), (text, ptype.schema.error_log)
        assert g.accepts(text), text
        other = data.draw(mutated(text))
        if g.accepts(other):
            assert valid(ptype, other), (other, etree.tostring(ptype.schema_doc))
        changed = data.draw(broken(el))
        assert g.accepts(written(changed)) == ptype.schema.validate(changed), (
            written(changed),
            etree.tostring(ptype.schema_doc),
        )


# -- what cannot be expressed ----------------------------------------------------------


def _type_from(body: str) -> PayloadType:
    text = (
        f'<xs:schema xmlns:xs="{XS}" targetNamespace="{NS}" elementFormDefault="qualified">'
        f"{body}</xs:schema>"
    )
    doc = etree.fromstring(text.encode())
    return PayloadType(None, f"{{{NS}}}r", NS, "r", doc, etree.XMLSchema(doc))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "construct"),
    [
        (
            '<xs:element name="r"><xs:simpleType><xs:restriction base="xs:string">'
            '<xs:pattern value="[a-z]+"/></xs:restriction></xs:simpleType></xs:element>',
            "xs:pattern",
        ),
        (
            '<xs:element name="r"><xs:complexType><xs:sequence><xs:any processContents="lax"/>'
            "</xs:sequence></xs:complexType></xs:element>",
            "xs:any",
        ),
        (
            '<xs:element name="r"><xs:complexType><xs:all><xs:element name="a" type="xs:int"/>'
            "</xs:all></xs:complexType></xs:element>",
            "xs:all",
        ),
        (
            '<xs:element name="r"><xs:complexType mixed="true"><xs:sequence>'
            '<xs:element name="a" type="xs:int"/></xs:sequence></xs:complexType></xs:element>',
            "mixed content",
        ),
        (
            '<xs:element name="r"><xs:complexType><xs:anyAttribute/></xs:complexType></xs:element>',
            "xs:anyAttribute",
        ),
    ],
)
def test_a_construct_the_grammar_cannot_express_is_named_with_the_agent(body, construct):
    with pytest.raises(GrammarUnsupported) as caught:
        reply_grammar([_type_from(body)], agent="helper")
    message = str(caught.value)
    assert construct in message and "'helper'" in message and f"{{{NS}}}r" in message
