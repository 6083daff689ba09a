"""A payload type's XSD as an MCP tool's JSON Schema input, and JSON arguments back to
the payload element (the other way round from :mod:`agentserver.core.jsonschema_xsd`).

The mapping (docs/mcp.md, "Our listeners as MCP tools"): the payload's attributes and
child elements are the properties (required unless optional); a child of simple type is
a string, integer, number or boolean (an enumeration keeps its values); a child with
children is a nested object; a child that may repeat is an array. What does not fit
(mixed content, text beside attributes, an attribute and a child of one name, ...) is
the fallback: one required ``xml`` property holding the payload as XML text.

Pure (no I/O); reads the schema with xmlschema (slow to import: imported in the call).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lxml import etree

from agentserver.core.errors import AgentServerError
from agentserver.core.payloads import PayloadType
from agentserver.core.xmlsafe import SafeParser

_INTEGERS = frozenset(
    {
        "integer",
        "int",
        "long",
        "short",
        "byte",
        "nonNegativeInteger",
        "positiveInteger",
        "nonPositiveInteger",
        "negativeInteger",
        "unsignedLong",
        "unsignedInt",
        "unsignedShort",
        "unsignedByte",
    }
)
_NUMBERS = frozenset({"double", "float", "decimal"})
#: The property of the fallback input.
XML_PROPERTY = "xml"


class ArgumentsRefused(AgentServerError):
    """Tool arguments that do not make a payload (the caller is told why)."""


class _Unmappable(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kind: str  # string, integer, number, boolean, object
    attribute: bool = False
    required: bool = True
    repeated: bool = False
    enum: tuple[str, ...] = ()
    fields: tuple[_Field, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolInput:
    """One payload type as a tool's input: :attr:`schema` (JSON Schema) and
    :meth:`element` (arguments → payload)."""

    namespace: str
    local: str
    schema: dict[str, Any]
    #: None: the fallback (``{"xml": "..."}``).
    fields: tuple[_Field, ...] | None = field(default=None)

    def element(
        self, arguments: dict[str, Any], parser: SafeParser | None = None
    ) -> etree._Element:
        """The payload of ``arguments`` (validated later, by the pump, like any message).
        Raises :class:`ArgumentsRefused`."""
        if self.fields is None:
            text = arguments.get(XML_PROPERTY)
            if not isinstance(text, str):
                raise ArgumentsRefused(f"the argument {XML_PROPERTY!r} must be the payload as XML")
            try:
                return (parser or SafeParser()).parse(text.encode("utf-8"))
            except Exception as exc:
                raise ArgumentsRefused(f"{XML_PROPERTY!r} is not an XML element: {exc}") from None
        root = etree.Element(f"{{{self.namespace}}}{self.local}", nsmap={None: self.namespace})
        _fill(root, self.fields, arguments, self.namespace)
        return root


def tool_input(ptype: PayloadType) -> ToolInput:
    """The tool input of payload type ``ptype`` (see the module doc)."""
    import xmlschema

    schema = xmlschema.XMLSchema(etree.tostring(ptype.schema_doc, encoding="unicode"))
    element = schema.elements[ptype.local]
    try:
        fields = _fields(element.type, 0)
    except _Unmappable:
        return ToolInput(
            ptype.namespace,
            ptype.local,
            {
                "type": "object",
                "properties": {
                    XML_PROPERTY: {
                        "type": "string",
                        "description": f'the payload as XML: <{ptype.local} xmlns="{ptype.namespace}">...',
                    }
                },
                "required": [XML_PROPERTY],
            },
        )
    return ToolInput(ptype.namespace, ptype.local, _object_schema(fields), fields)


def _leaf(t: Any) -> tuple[str, tuple[str, ...]]:
    enum = getattr(t, "enumeration", None)
    if enum:
        return "string", tuple(str(v) for v in enum)
    base = t
    while base is not None and base.local_name is None:
        base = getattr(base, "base_type", None)
    name = base.local_name if base is not None else "string"
    while base is not None and name not in _INTEGERS | _NUMBERS | {"boolean"}:
        base = getattr(base, "base_type", None)
        if base is None or base.local_name is None:
            break
        name = base.local_name
    if name in _INTEGERS:
        return "integer", ()
    if name in _NUMBERS:
        return "number", ()
    if name == "boolean":
        return "boolean", ()
    return "string", ()


def _fields(t: Any, depth: int) -> tuple[_Field, ...]:
    if depth > 8 or t.is_simple() or t.has_simple_content() or getattr(t, "mixed", False):
        raise _Unmappable
    out: list[_Field] = []
    for name, attr in t.attributes.items():
        if name is None or name.startswith("{"):
            raise _Unmappable
        kind, enum = _leaf(attr.type)
        out.append(_Field(name, kind, attribute=True, required=attr.use == "required", enum=enum))
    content = t.content
    if content is not None and hasattr(content, "iter_elements"):
        for child in content.iter_elements():
            repeated = child.max_occurs is None or child.max_occurs > 1
            required = child.min_occurs > 0
            if child.type.is_simple():
                kind, enum = _leaf(child.type)
                out.append(
                    _Field(child.local_name, kind, required=required, repeated=repeated, enum=enum)
                )
            else:
                sub = _fields(child.type, depth + 1)
                out.append(
                    _Field(
                        child.local_name, "object", required=required, repeated=repeated, fields=sub
                    )
                )
    names = [f.name for f in out]
    if len(names) != len(set(names)):
        raise _Unmappable
    return tuple(out)


def _object_schema(fields: tuple[_Field, ...]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for f in fields:
        one: dict[str, Any] = _object_schema(f.fields) if f.kind == "object" else {"type": f.kind}
        if f.enum:
            one["enum"] = list(f.enum)
        props[f.name] = {"type": "array", "items": one} if f.repeated else one
    schema: dict[str, Any] = {"type": "object", "properties": props}
    required = [f.name for f in fields if f.required]
    if required:
        schema["required"] = required
    return schema


def _text(kind: str, value: Any) -> str:
    if kind == "boolean":
        if not isinstance(value, bool):
            raise ArgumentsRefused(f"{value!r} is not a boolean")
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        raise ArgumentsRefused(f"{value!r} is not a {kind}")
    return str(value)


def _fill(el: etree._Element, fields: tuple[_Field, ...], value: Any, ns: str) -> None:
    if not isinstance(value, dict):
        raise ArgumentsRefused(f"expected an object, got {value!r}")
    for f in fields:
        if f.name not in value:
            continue
        given = value[f.name]
        if f.attribute:
            el.set(f.name, _text(f.kind, given))
            continue
        items = given if f.repeated else [given]
        if f.repeated and not isinstance(given, list):
            raise ArgumentsRefused(f"{f.name!r} must be an array")
        for item in items:
            child = etree.SubElement(el, f"{{{ns}}}{f.name}")
            if f.kind == "object":
                _fill(child, f.fields, item, ns)
            else:
                child.text = _text(f.kind, item)
