"""Derive an XSD from a pydantic-xml model, so a payload type is declared exactly once.

The supported subset is what a message payload needs: elements and attributes of simple
types (str, int, float, bool, Decimal, date/datetime, Literal and str-valued Enum), optional
fields, homogeneous lists, nested models, and element text. Length, range and pattern
constraints declared on a field become XSD facets. Anything else raises
:class:`SchemaDerivationError` at registration, naming the field: a schema that silently
accepted more or less than the model would split the single source of truth in two.

The generated schema uses anonymous types only, so the schemas of several models of one
namespace can be merged into one document by concatenating their global elements.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import types
import typing
from typing import Any

import annotated_types
from lxml import etree
from pydantic_xml import BaseXmlModel
from pydantic_xml.serializers.factories import homogeneous, model, primitive

from agentserver.core.errors import SchemaDerivationError
from agentserver.core.namespaces import XSD_NS

_XS = f"{{{XSD_NS}}}"

# The model's serializers (``__xml_serializer__`` and its field serializers' ``_element_name``,
# ``_attr_name``, ``_inner_serializer``, ``_model``) are pydantic-xml internals: it offers no
# public API for the tags and nested models a schema needs, hence the ``noqa: SLF001`` on
# each line that reads them (tests/test_xsdgen.py fails first if a release renames them).

_SIMPLE_TYPES: dict[type, str] = {
    str: "xs:string",
    int: "xs:integer",
    float: "xs:double",
    bool: "xs:boolean",
    decimal.Decimal: "xs:decimal",
    datetime.datetime: "xs:dateTime",
    datetime.date: "xs:date",
    datetime.time: "xs:time",
}


class XsdType:
    """Annotation marker that overrides the XSD simple type of a str field.

    ``Annotated[str, XsdType("xs:base64Binary")]`` keeps the Python value a str while the
    schema checks the lexical form.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def split_tag(tag: str) -> tuple[str, str]:
    """``{ns}local`` → ``(ns, local)``; an unqualified tag has namespace ``""``."""
    if tag.startswith("{"):
        ns, _, local = tag[1:].partition("}")
        return ns, local
    return "", tag


def model_root_tag(model_cls: type[BaseXmlModel]) -> str:
    """The Clark-notation root tag a model serialises to."""
    return model_cls.__xml_serializer__._element_name  # type: ignore[union-attr]  # noqa: SLF001


def derive_schema(model_cls: type[BaseXmlModel]) -> etree._Element:
    """Return an ``xs:schema`` element declaring ``model_cls`` as a global element."""
    if not (isinstance(model_cls, type) and issubclass(model_cls, BaseXmlModel)):
        raise SchemaDerivationError(f"{model_cls!r} is not a pydantic-xml model")
    tag = model_root_tag(model_cls)
    ns, local = split_tag(tag)
    if not ns:
        raise SchemaDerivationError(f"{model_cls.__name__}: a payload must have a namespace")
    schema = etree.Element(
        _XS + "schema",
        nsmap={"xs": XSD_NS},
        targetNamespace=ns,
        elementFormDefault="qualified",
        attributeFormDefault="unqualified",
    )
    schema.append(_element_decl(model_cls, local, ns, path=model_cls.__name__))
    return schema


def merge_schemas(schemas: list[etree._Element]) -> etree._Element:
    """Merge schemas of one target namespace into one document (for export to clients)."""
    if not schemas:
        raise ValueError("nothing to merge")
    target = schemas[0].get("targetNamespace")
    merged = etree.Element(_XS + "schema", nsmap={"xs": XSD_NS}, attrib=dict(schemas[0].attrib))
    seen: set[tuple[str, str | None]] = set()
    for s in schemas:
        if s.get("targetNamespace") != target:
            raise ValueError("schemas of different namespaces cannot be merged")
        for decl in s:
            # By kind and name: a schema file may name a type and an element alike.
            # (lxml's stubs type a tag as any name it accepts; read back, it is a str.)
            key = (str(decl.tag), decl.get("name"))
            if key in seen:
                continue
            seen.add(key)
            merged.append(_copy(decl))
    return merged


def _copy(el: etree._Element) -> etree._Element:
    return etree.fromstring(etree.tostring(el))


def _element_decl(model_cls: type[BaseXmlModel], local: str, ns: str, path: str) -> etree._Element:
    decl = etree.Element(_XS + "element", name=local)
    decl.append(_complex_type(model_cls, ns, path))
    return decl


def _complex_type(model_cls: type[BaseXmlModel], ns: str, path: str) -> etree._Element:
    serializer = model_cls.__xml_serializer__
    fields = model_cls.model_fields
    ctype = etree.Element(_XS + "complexType")
    sequence = etree.Element(_XS + "sequence")
    attributes: list[etree._Element] = []
    text_type: etree._Element | None = None
    for name, fser in serializer._field_serializers.items():  # type: ignore[union-attr]  # noqa: SLF001
        info = fields[name]
        where = f"{path}.{name}"
        optional = not info.is_required()
        annotation, metadata = _unwrap(info.annotation, list(info.metadata), where)
        if isinstance(fser, primitive.AttributeSerializer):
            attr_ns, attr_local = split_tag(fser._attr_name)  # noqa: SLF001
            if attr_ns:
                raise SchemaDerivationError(f"{where}: namespaced attributes are not supported")
            attr = etree.SubElement(etree.Element("x"), _XS + "attribute", name=attr_local)
            attr.set("use", "optional" if optional else "required")
            _attach_simple(attr, annotation, metadata, where)
            attributes.append(attr)
        elif isinstance(fser, primitive.ElementSerializer):
            sequence.append(_simple_element(fser._element_name, ns, annotation, metadata, where))  # noqa: SLF001
            if optional:
                sequence[-1].set("minOccurs", "0")
        elif isinstance(fser, primitive.TextSerializer):
            text_type = etree.Element("x")
            _attach_simple(text_type, annotation, metadata, where)
        elif isinstance(fser, homogeneous.ElementSerializer):
            inner = fser._inner_serializer  # noqa: SLF001
            item_type, item_meta = _list_item(annotation, where)
            if isinstance(inner, primitive.ElementSerializer):
                el = _simple_element(inner._element_name, ns, item_type, item_meta, where)  # noqa: SLF001
            elif isinstance(inner, model.ModelProxySerializer):
                el = _nested_element(inner._element_name, ns, inner._model, where)  # noqa: SLF001
            else:
                raise SchemaDerivationError(f"{where}: unsupported list item")
            el.set("minOccurs", "0")
            el.set("maxOccurs", "unbounded")
            sequence.append(el)
        elif isinstance(fser, model.ModelProxySerializer):
            el = _nested_element(fser._element_name, ns, fser._model, where)  # noqa: SLF001
            if optional:
                el.set("minOccurs", "0")
            sequence.append(el)
        else:
            raise SchemaDerivationError(
                f"{where}: {type(fser).__module__}.{type(fser).__name__} has no XSD mapping"
            )
    if text_type is not None:
        if len(sequence):
            raise SchemaDerivationError(
                f"{path}: text together with child elements is not supported"
            )
        simple = etree.SubElement(ctype, _XS + "simpleContent")
        ext = etree.SubElement(simple, _XS + "extension")
        _move_simple(text_type, ext)
        for attr in attributes:
            ext.append(attr)
        return ctype
    if len(sequence):
        ctype.append(sequence)
    for attr in attributes:
        ctype.append(attr)
    return ctype


def _nested_element(tag: str, ns: str, nested: type[BaseXmlModel], where: str) -> etree._Element:
    el_ns, local = split_tag(tag)
    el = etree.Element(_XS + "element", name=local)
    _set_form(el, el_ns, ns, where)
    el.append(_complex_type(nested, ns, where))
    return el


def _simple_element(
    tag: str, ns: str, annotation: Any, metadata: list[Any], where: str
) -> etree._Element:
    el_ns, local = split_tag(tag)
    el = etree.Element(_XS + "element", name=local)
    _set_form(el, el_ns, ns, where)
    _attach_simple(el, annotation, metadata, where)
    return el


def _set_form(el: etree._Element, el_ns: str, target_ns: str, where: str) -> None:
    if el_ns == target_ns:
        return
    if el_ns == "":
        el.set("form", "unqualified")
        return
    raise SchemaDerivationError(f"{where}: child elements must share the payload's namespace")


def _unwrap(annotation: Any, metadata: list[Any], where: str) -> tuple[Any, list[Any]]:
    """Strip Optional[...] and Annotated[...], collecting constraint metadata."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            args = typing.get_args(annotation)
            annotation = args[0]
            metadata = [*metadata, *args[1:]]
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(members) != 1:
                raise SchemaDerivationError(f"{where}: unions are not supported")
            annotation = members[0]
        else:
            return annotation, metadata


def _list_item(annotation: Any, where: str) -> tuple[Any, list[Any]]:
    if typing.get_origin(annotation) not in (list, tuple, set, frozenset):
        raise SchemaDerivationError(f"{where}: unsupported collection {annotation!r}")
    args = typing.get_args(annotation)
    if not args:
        raise SchemaDerivationError(f"{where}: untyped collection")
    return _unwrap(args[0], [], where)


def _attach_simple(el: etree._Element, annotation: Any, metadata: list[Any], where: str) -> None:
    """Give ``el`` a ``type=`` or an inline ``xs:simpleType`` for ``annotation``."""
    base, enumeration = _base_type(annotation, metadata, where)
    facets = _facets(metadata, where)
    if enumeration is None and not facets:
        el.set("type", base)
        return
    simple = etree.SubElement(el, _XS + "simpleType")
    restriction = etree.SubElement(simple, _XS + "restriction", base=base)
    for value in enumeration or ():
        etree.SubElement(restriction, _XS + "enumeration", value=value)
    for name, value in facets:
        etree.SubElement(restriction, _XS + name, value=value)


def _move_simple(src: etree._Element, ext: etree._Element) -> None:
    """Turn the type chosen by :func:`_attach_simple` into an ``xs:extension`` base."""
    base = src.get("type")
    if base:
        ext.set("base", base)
        return
    raise SchemaDerivationError("constrained element text is not supported")


def _base_type(annotation: Any, metadata: list[Any], where: str) -> tuple[str, list[str] | None]:
    for m in metadata:
        if isinstance(m, XsdType):
            return m.name, None
    if typing.get_origin(annotation) is typing.Literal:
        literals = typing.get_args(annotation)
        if not all(isinstance(v, str) for v in literals):
            raise SchemaDerivationError(f"{where}: only str literals are supported")
        return "xs:string", list(literals)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        values = [m.value for m in annotation]
        if not all(isinstance(v, str) for v in values):
            raise SchemaDerivationError(f"{where}: only str-valued enums are supported")
        return "xs:string", values
    if isinstance(annotation, type):
        for py, xs in _SIMPLE_TYPES.items():
            # bool is a subclass of int: look it up exactly first.
            if annotation is py:
                return xs, None
    raise SchemaDerivationError(f"{where}: type {annotation!r} has no XSD mapping")


def _facets(metadata: list[Any], where: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for m in metadata:
        if isinstance(m, XsdType):
            continue
        if isinstance(m, annotated_types.MinLen):
            out.append(("minLength", str(m.min_length)))
        elif isinstance(m, annotated_types.MaxLen):
            out.append(("maxLength", str(m.max_length)))
        elif isinstance(m, annotated_types.Ge):
            out.append(("minInclusive", str(m.ge)))
        elif isinstance(m, annotated_types.Gt):
            out.append(("minExclusive", str(m.gt)))
        elif isinstance(m, annotated_types.Le):
            out.append(("maxInclusive", str(m.le)))
        elif isinstance(m, annotated_types.Lt):
            out.append(("maxExclusive", str(m.lt)))
        elif getattr(m, "pattern", None) is not None:
            # Python regexes are searched, XSD patterns are anchored: only accept the
            # common, unambiguous form ^...$ and strip the anchors.
            pattern = m.pattern
            if not (pattern.startswith("^") and pattern.endswith("$")):
                raise SchemaDerivationError(f"{where}: patterns must be anchored with ^...$")
            out.append(("pattern", pattern[1:-1]))
        elif type(m).__name__ in ("Strict", "FieldInfo", "XmlEntityInfo"):
            continue
        else:
            raise SchemaDerivationError(f"{where}: constraint {m!r} has no XSD mapping")
    return out
