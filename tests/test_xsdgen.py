"""XSDs derived from pydantic-xml models accept what the model serialises, and nothing else."""

from __future__ import annotations

import datetime
import decimal
import enum
from typing import Annotated, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lxml import etree
from pydantic import Field
from pydantic_xml import BaseXmlModel, attr, element, wrapped

from agentserver.core.errors import SchemaDerivationError
from agentserver.core.payloads import PayloadRegistry, PayloadType
from agentserver.core.schemas_export import core_xsd_bytes, schema_path
from agentserver.core.xsdgen import XsdType, derive_schema

NS = {"": "urn:test:xsd"}


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Inner(BaseXmlModel, tag="inner", nsmap=NS):
    v: float = element()


class Rich(BaseXmlModel, tag="rich", nsmap=NS):
    name: Annotated[str, Field(min_length=1, max_length=8)] = element()
    count: Annotated[int, Field(ge=0, le=10)] = element()
    ratio: float | None = element(default=None)
    flag: bool = element(default=False)
    amount: decimal.Decimal = element(default=decimal.Decimal("1.5"))
    when: datetime.date = element(default=datetime.date(2026, 1, 1))
    tags: list[str] = element(tag="tag", default=[])
    items: list[Inner] = element(tag="inner", default=[])
    color: Color = attr(default=Color.RED)
    mode: Literal["a", "b"] = attr(default="a")
    blob: Annotated[str, XsdType("xs:base64Binary")] = element(default="aGk=")
    code: Annotated[str, Field(pattern=r"^[A-Z]{3}$")] = element(default="ABC")


class Text(BaseXmlModel, tag="text", nsmap=NS):
    lang: str = attr()
    value: str


def schema_of(model) -> etree.XMLSchema:
    return PayloadType.from_model(model).schema


def test_model_output_validates():
    s = schema_of(Rich)
    m = Rich(name="x", count=3, ratio=None, tags=["a", "b"], items=[Inner(v=1.0)])
    assert s.validate(m.to_xml_tree(exclude_none=True)), s.error_log


@pytest.mark.parametrize(
    "xml",
    [
        "<rich xmlns='urn:test:xsd'><name>x</name></rich>",  # count missing
        "<rich xmlns='urn:test:xsd'><name>toolongname</name><count>1</count></rich>",
        "<rich xmlns='urn:test:xsd'><name>x</name><count>11</count></rich>",
        "<rich xmlns='urn:test:xsd'><name>x</name><count>one</count></rich>",
        "<rich xmlns='urn:test:xsd' color='green'><name>x</name><count>1</count></rich>",
        "<rich xmlns='urn:test:xsd'><name>x</name><count>1</count><code>abcd</code></rich>",
        "<rich xmlns='urn:test:xsd'><name>x</name><count>1</count><extra/></rich>",
        "<rich xmlns='urn:test:xsd'><count>1</count><name>x</name></rich>",  # order
        "<rich><name>x</name><count>1</count></rich>",  # namespace
    ],
)
def test_schema_rejects_what_the_model_rejects(xml):
    assert not schema_of(Rich).validate(etree.fromstring(xml))


def test_text_content_with_attributes():
    s = schema_of(Text)
    assert s.validate(Text(lang="en", value="hi").to_xml_tree())
    assert not s.validate(etree.fromstring("<text xmlns='urn:test:xsd'>hi</text>"))


def test_unsupported_constructs_fail_at_registration():
    class Union(BaseXmlModel, tag="u", nsmap=NS):
        v: int | str = element()

    class Dict(BaseXmlModel, tag="d", nsmap=NS):
        v: dict[str, str] = element()

    class Wrapped(BaseXmlModel, tag="w", nsmap=NS):
        v: str = wrapped("outer", element(tag="inner"))

    class NoNs(BaseXmlModel, tag="nons"):
        v: str = element()

    for model in (Union, Dict, Wrapped, NoNs):
        with pytest.raises(SchemaDerivationError):
            derive_schema(model)


def test_registry_refuses_two_models_for_one_tag():
    class A(BaseXmlModel, tag="same", nsmap=NS):
        v: str = element()

    class B(BaseXmlModel, tag="same", nsmap=NS):
        w: str = element()

    reg = PayloadRegistry()
    reg.add(A)
    assert reg.add(A) is reg.get(A.__xml_serializer__._element_name)
    with pytest.raises(Exception, match="declared by both"):
        reg.add(B)


def test_checked_in_core_xsd_is_the_generated_one():
    assert schema_path("core.xsd").read_bytes() == core_xsd_bytes()


@settings(max_examples=60, deadline=None)
@given(
    name=st.text(
        st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=8
    ),
    count=st.integers(0, 10),
    tags=st.lists(
        st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=5),
        max_size=3,
    ),
)
def test_any_valid_model_instance_validates(name, count, tags):
    s = schema_of(Rich)
    m = Rich(name=name, count=count, tags=tags)
    tree = m.to_xml_tree(exclude_none=True)
    assert s.validate(tree), s.error_log
