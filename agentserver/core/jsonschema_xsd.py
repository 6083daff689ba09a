"""A tool's JSON Schema input as an XML payload type, and values between the two forms.

An MCP tool declares its arguments as a JSON Schema object; a listener takes an XML
payload validated by an XSD. :func:`convert` maps one to the other once, at load, and
the :class:`ToolShape` it returns turns a validated payload element into the JSON
arguments (:meth:`ToolShape.to_json`) and back (:meth:`ToolShape.to_element`, used by
tests and by examples shown to models).

The mapping (docs/mcp.md, "Payloads from JSON Schema"):

- the input object is the root element ``{namespace}tool``; each property is a child
  element of the same name, in an ``xs:all`` (any order), ``minOccurs="0"`` unless
  required;
- ``string`` → ``xs:string``; ``integer`` → ``xs:integer``; ``number`` → a finite
  ``xs:double``; ``boolean`` → ``xs:boolean``; an ``enum`` of strings → an enumeration;
- a nested ``object`` with ``properties`` → a child element with its own ``xs:all``
  (``"properties": {}``, a tool without arguments, is an empty element);
- an ``array`` → a wrapper element holding one ``<item>`` per value (so an empty array is
  ``<paths/>`` and stays distinct from an absent one), items mapped by these same rules;
- anything else (``oneOf``/``anyOf``, type lists, ``$ref``, free-form objects, property
  names that are not XML names, ...) is the **fallback**: an element of type ``json``
  whose text is the value as JSON, parsed when the call is made. :attr:`ToolShape.fallbacks`
  names the paths that got it (``agentserver check`` prints them).

Pure: no I/O. Bounded: a schema nested deeper than :data:`MAX_DEPTH` falls back to JSON
at that depth.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lxml import etree

from agentserver.core.errors import AgentServerError
from agentserver.core.namespaces import XSD_NS

_XS = f"{{{XSD_NS}}}"
#: Deeper than this, a value is carried as JSON text.
MAX_DEPTH = 8
#: The element holding one value of an array.
ITEM = "item"
#: The simple type of a fallback element (shown to models as its type name).
JSON_TYPE = "json"
_NUMBER_TYPE = "number"
#: A finite xs:double in its plain lexical form (no INF/NaN, which JSON cannot carry).
_NUMBER_PATTERN = r"[+\-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+\-]?[0-9]+)?"
_NCNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


class ArgumentError(AgentServerError):
    """A payload element that cannot be turned into the tool's JSON arguments (a
    fallback element whose text is not JSON, a number that is not finite)."""


@dataclass(frozen=True, slots=True)
class Node:
    """How one value maps: ``kind`` is string, integer, number, boolean, enum, object,
    array or json."""

    kind: str
    #: object: (property name, node, required), in declaration order.
    fields: tuple[tuple[str, Node, bool], ...] = ()
    #: array: the items' node.
    items: Node | None = None
    #: enum: the values.
    values: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True, slots=True)
class ToolShape:
    """A tool's input as XML: its XSD document, the root element and the mapping."""

    namespace: str
    local: str
    root: Node
    schema_doc: etree._Element
    #: Paths (``path.to.prop``) carried as JSON text: what could not be mapped.
    fallbacks: tuple[str, ...] = field(default=())

    def to_json(self, element: etree._Element) -> dict[str, Any]:
        """The JSON arguments of a payload that validated against :attr:`schema_doc`.
        Raises :class:`ArgumentError`."""
        value = _read(self.root, element)
        assert isinstance(value, dict)
        return value

    def to_element(self, arguments: Mapping[str, Any]) -> etree._Element:
        """The payload element of ``arguments`` (the inverse of :meth:`to_json`)."""
        root = etree.Element(f"{{{self.namespace}}}{self.local}", nsmap={None: self.namespace})
        _write(self.root, root, arguments, self.namespace)
        return root


def xml_name(name: str) -> str:
    """``name`` as an XML local name: characters outside ``[A-Za-z0-9_.-]`` become ``_``,
    and a name not starting with a letter or ``_`` gets a leading ``_``."""
    out = re.sub(r"[^A-Za-z0-9_.\-]", "_", name) or "_"
    return out if re.match(r"[A-Za-z_]", out) else "_" + out


def convert(
    schema: Mapping[str, Any], namespace: str, local: str, description: str = ""
) -> ToolShape:
    """The payload type of a tool whose ``inputSchema`` is ``schema``: root element
    ``{namespace}local``. Never raises for an odd schema: what cannot be mapped falls
    back to JSON text (see the module doc); a top-level schema that is not an object
    with properties is one ``<arguments>`` element of JSON."""
    fallbacks: list[str] = []
    root = _node(schema, 0, "", fallbacks)
    if root.kind != "object":
        fallbacks = ["arguments"]
        root = Node("object", (("arguments", Node(JSON_TYPE), False),))
    root = Node(root.kind, root.fields, description=description or root.description)
    doc = etree.Element(
        _XS + "schema",
        nsmap={"xs": XSD_NS, "tns": namespace},
        attrib={"targetNamespace": namespace, "elementFormDefault": "qualified"},
    )
    json_type = etree.SubElement(doc, _XS + "simpleType", name=JSON_TYPE)
    etree.SubElement(json_type, _XS + "restriction", base="xs:string")
    number = etree.SubElement(doc, _XS + "simpleType", name=_NUMBER_TYPE)
    etree.SubElement(
        etree.SubElement(number, _XS + "restriction", base="xs:double"),
        _XS + "pattern",
        value=_NUMBER_PATTERN,
    )
    el = etree.SubElement(doc, _XS + "element", name=local)
    _declare(root, el, namespace)
    return ToolShape(namespace, local, root, doc, tuple(fallbacks))


def _node(schema: Any, depth: int, path: str, fallbacks: list[str]) -> Node:
    def fallback() -> Node:
        fallbacks.append(path or "arguments")
        return Node(JSON_TYPE, description=description)

    if not isinstance(schema, Mapping):
        description = ""
        return fallback()
    said = schema.get("description")
    description = said if isinstance(said, str) else ""
    if depth > MAX_DEPTH or any(k in schema for k in ("oneOf", "anyOf", "allOf", "$ref", "not")):
        return fallback()
    kind = schema.get("type")
    if kind is None and "properties" in schema:
        kind = "object"
    if "enum" in schema:
        values = schema["enum"]
        if (
            kind in (None, "string")
            and isinstance(values, list)
            and values
            and all(isinstance(v, str) for v in values)
        ):
            return Node("enum", values=tuple(dict.fromkeys(values)), description=description)
        return fallback()
    if kind in ("string", "integer", "number", "boolean"):
        return Node(kind, description=description)
    if kind == "array":
        items = schema.get("items")
        if not isinstance(items, Mapping):
            return fallback()
        return Node(
            "array", items=_node(items, depth + 1, f"{path}[]", fallbacks), description=description
        )
    if kind == "object":
        props = schema.get("properties")
        if isinstance(props, Mapping) and not props and not schema.get("additionalProperties"):
            return Node("object", (), description=description)  # a tool without arguments
        if not isinstance(props, Mapping) or not props or ITEM in props:
            return fallback()
        if not all(isinstance(n, str) and _NCNAME.match(n) for n in props):
            return fallback()
        listed = schema.get("required")
        required = listed if isinstance(listed, list) else []
        return Node(
            "object",
            tuple(
                (
                    name,
                    _node(sub, depth + 1, f"{path}.{name}" if path else name, fallbacks),
                    name in required,
                )
                for name, sub in props.items()
            ),
            description=description,
        )
    return fallback()


def _document(el: etree._Element, text: str) -> None:
    if text:
        ann = etree.SubElement(el, _XS + "annotation")
        etree.SubElement(ann, _XS + "documentation").text = text


def _declare(node: Node, el: etree._Element, ns: str) -> None:
    """Give element declaration ``el`` the type of ``node``."""
    _document(el, node.description)
    if node.kind in ("string", "integer", "boolean"):
        el.set("type", f"xs:{node.kind}")
    elif node.kind == "number":
        el.set("type", f"tns:{_NUMBER_TYPE}")
    elif node.kind == JSON_TYPE:
        el.set("type", f"tns:{JSON_TYPE}")
    elif node.kind == "enum":
        restriction = etree.SubElement(
            etree.SubElement(el, _XS + "simpleType"), _XS + "restriction", base="xs:string"
        )
        for value in node.values:
            etree.SubElement(restriction, _XS + "enumeration", value=value)
    elif node.kind == "array":
        assert node.items is not None
        seq = etree.SubElement(etree.SubElement(el, _XS + "complexType"), _XS + "sequence")
        item = etree.SubElement(
            seq, _XS + "element", name=ITEM, minOccurs="0", maxOccurs="unbounded"
        )
        _declare(node.items, item, ns)
    else:  # object
        group = etree.SubElement(etree.SubElement(el, _XS + "complexType"), _XS + "all")
        for name, child, required in node.fields:
            sub = etree.SubElement(group, _XS + "element", name=name)
            if not required:
                sub.set("minOccurs", "0")
            _declare(child, sub, ns)


def _local(el: etree._Element) -> str:
    return etree.QName(el).localname


def _read(node: Node, el: etree._Element) -> Any:
    text = el.text or ""
    kind = node.kind
    if kind in ("string", "enum"):
        return text
    if kind == "integer":
        return int(text.strip())
    if kind == "number":
        value = float(text.strip())
        if not math.isfinite(value):
            raise ArgumentError(f"<{_local(el)}>: {text!r} is not a finite number")
        return value
    if kind == "boolean":
        return text.strip() in ("true", "1")
    if kind == JSON_TYPE:
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ArgumentError(f"<{_local(el)}> must hold JSON: {exc}") from None
    if kind == "array":
        assert node.items is not None
        return [_read(node.items, child) for child in el.iterchildren(etree.Element)]
    by_name = {name: child for name, child, _ in node.fields}
    out: dict[str, Any] = {}
    for child in el.iterchildren(etree.Element):
        name = _local(child)
        if name in by_name:
            out[name] = _read(by_name[name], child)
    return out


def _text(node: Node, value: Any) -> str:
    if node.kind == "boolean":
        return "true" if value else "false"
    if node.kind == "number":
        return repr(float(value))
    if node.kind == "integer":
        return str(int(value))
    return str(value)


def _write(node: Node, el: etree._Element, value: Any, ns: str) -> None:
    if node.kind == JSON_TYPE:
        el.text = json.dumps(value, ensure_ascii=False)
    elif node.kind == "array":
        assert node.items is not None
        for item in value:
            _write(node.items, etree.SubElement(el, f"{{{ns}}}{ITEM}"), item, ns)
    elif node.kind == "object":
        for name, child, _ in node.fields:
            if name in value:
                _write(child, etree.SubElement(el, f"{{{ns}}}{name}"), value[name], ns)
    else:
        el.text = _text(node, value)
