"""An MCP tool's JSON Schema as an XML payload type (agentserver.core.jsonschema_xsd):
instances generated from a JSON Schema validate against the generated XSD and round-trip
to the same JSON; what cannot be mapped is JSON text, and said so."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from agentserver.core.jsonschema_xsd import ArgumentError, convert, xml_name
from agentserver.core.payloads import PayloadType
from agentserver.core.usage import describe_payload
from agentserver.core.xsdpayload import schema_model
from agentserver.remote.mcp_spec import tool_listener_name

NS = "urn:agentserver:mcp:t"
NAMES = st.from_regex(r"[a-z][a-zA-Z0-9_]{0,8}", fullmatch=True).filter(lambda n: n != "item")
# XML 1.0 text: no control characters but tab/newline, no surrogates; no \r (normalised).
TEXT = st.text(
    st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\ufffe\uffff").filter(
        lambda c: c != "\r"
    )
    | st.sampled_from("\t\n"),
    max_size=12,
)


def leaf_schemas():
    return st.one_of(
        st.just({"type": "string"}),
        st.just({"type": "integer"}),
        st.just({"type": "number"}),
        st.just({"type": "boolean"}),
        st.lists(NAMES, min_size=1, max_size=4, unique=True).map(
            lambda v: {"type": "string", "enum": v}
        ),
        # unmappable: carried as JSON text
        st.just({"anyOf": [{"type": "string"}, {"type": "integer"}]}),
        st.just({"type": "object", "additionalProperties": {"type": "string"}}),
    )


def schemas(depth: int = 2):
    if depth == 0:
        return leaf_schemas()
    inner = schemas(depth - 1)
    return st.one_of(
        leaf_schemas(),
        inner.map(lambda s: {"type": "array", "items": s}),
        objects(inner),
    )


def objects(inner):
    return st.dictionaries(NAMES, inner, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required}
        )
    )


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(TEXT, children, max_size=3),
    max_leaves=6,
)


def instances(schema) -> st.SearchStrategy:
    """Values valid against ``schema`` (the subset generated above)."""
    kind = schema.get("type")
    if "anyOf" in schema or (kind == "object" and "properties" not in schema):
        return JSON_VALUES
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if kind == "string":
        return TEXT
    if kind == "integer":
        return st.integers(-(10**20), 10**20)
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(instances(schema["items"]), max_size=3)
    props = schema["properties"]
    required = schema.get("required", [])
    return st.fixed_dictionaries(
        {n: instances(props[n]) for n in required},
        optional={n: instances(s) for n, s in props.items() if n not in required},
    )


@st.composite
def schema_and_instance(draw):
    schema = draw(objects(schemas(2)))
    return schema, draw(instances(schema))


def normal(value):
    """JSON equality as the tool sees it (-0.0 is 0.0; 1.0 stays a float)."""
    if isinstance(value, float) and value == 0:
        return 0.0
    if isinstance(value, dict):
        return {k: normal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normal(v) for v in value]
    return value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema_and_instance())
def test_instances_validate_against_the_generated_xsd_and_round_trip(case):
    schema, instance = case
    shape = convert(schema, NS, "tool", "A tool.")
    compiled = etree.XMLSchema(shape.schema_doc)
    element = shape.to_element(instance)
    # serialised and parsed again, as the payload crosses the wire
    wire = etree.fromstring(etree.tostring(element))
    assert compiled.validate(wire), (compiled.error_log, etree.tostring(wire))
    back = shape.to_json(wire)
    assert normal(back) == normal(instance)


def test_mapped_types_and_the_documented_fallback():
    schema = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "Where the file is."},
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "force": {"type": "boolean"},
            "mode": {"enum": ["r", "w"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "owner": {
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
            },
            "either": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
            "free": {"type": "object"},
        },
        "required": ["path"],
    }
    shape = convert(schema, NS, "read_file", "Read a file.")
    assert shape.fallbacks == ("either", "free")
    compiled = etree.XMLSchema(shape.schema_doc)
    ok = etree.fromstring(
        f'<read_file xmlns="{NS}"><mode>w</mode><path>/a</path><tags><item>x</item></tags>'
        '<either>"s"</either><free>{"k": [1]}</free><ratio>2.5e3</ratio></read_file>'
    )
    assert compiled.validate(ok), compiled.error_log
    assert shape.to_json(ok) == {
        "mode": "w",
        "path": "/a",
        "tags": ["x"],
        "either": "s",
        "free": {"k": [1]},
        "ratio": 2500.0,
    }
    for bad in (
        f'<read_file xmlns="{NS}"/>',  # path is required
        f'<read_file xmlns="{NS}"><path>/a</path><mode>x</mode></read_file>',
        f'<read_file xmlns="{NS}"><path>/a</path><ratio>INF</ratio></read_file>',
        f'<read_file xmlns="{NS}"><path>/a</path><count>1.5</count></read_file>',
        f'<read_file xmlns="{NS}"><path>/a</path><owner/></read_file>',
    ):
        assert not compiled.validate(etree.fromstring(bad)), bad
    broken = etree.fromstring(f'<read_file xmlns="{NS}"><path>/a</path><free>{{</free></read_file>')
    assert compiled.validate(broken)
    with pytest.raises(ArgumentError, match="JSON"):
        shape.to_json(broken)


def test_a_tool_without_arguments_is_an_empty_element():
    shape = convert({"type": "object", "properties": {}}, NS, "pid")
    assert shape.fallbacks == ()
    el = etree.fromstring(f'<pid xmlns="{NS}"/>')
    assert etree.XMLSchema(shape.schema_doc).validate(el)
    assert shape.to_json(el) == {}
    assert not etree.XMLSchema(shape.schema_doc).validate(
        etree.fromstring(f'<pid xmlns="{NS}"><x>1</x></pid>')
    )


def test_a_schema_that_is_not_an_object_is_one_json_element():
    shape = convert({"type": "string"}, NS, "t")
    assert shape.fallbacks == ("arguments",)
    el = etree.fromstring(f'<t xmlns="{NS}"><arguments>{{"a": 1}}</arguments></t>')
    assert etree.XMLSchema(shape.schema_doc).validate(el)
    assert shape.to_json(el) == {"arguments": {"a": 1}}


def test_usage_instructions_carry_the_tool_description_and_field_notes():
    schema = {
        "type": "object",
        "properties": {"path": {"type": "string", "description": "Where the file is."}},
        "required": ["path"],
    }
    shape = convert(schema, NS, "read_file", "Read one file and return its text.")
    model = schema_model(shape.schema_doc, f"{{{NS}}}read_file", "mcp:t/read_file")
    text = describe_payload(PayloadType.from_model(model))
    assert "Read one file and return its text." in text
    assert "<path>: string (Where the file is.)" in text
    assert f'example: <read_file xmlns="{NS}"><path>...</path></read_file>' in text


def test_names():
    assert tool_listener_name("fs", "read_file") == "fs-read_file"
    assert tool_listener_name("fs", "readFile") == "fs-read_file"
    assert tool_listener_name("fs", "git.log") == "fs-git_log"
    assert len(tool_listener_name("fs", "x" * 100)) == 64
    assert xml_name("1st") == "_1st"
    assert xml_name("a b") == "a_b"
    assert math.isfinite(float("1e3"))
