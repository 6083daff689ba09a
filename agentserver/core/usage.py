"""``usage_instructions``: what a listener may send to its peers, generated from their XSDs.

Runs once at pump start (xmlschema is slow but thorough; this is off the hot path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lxml import etree

from agentserver.core.payloads import PayloadType

if TYPE_CHECKING:
    from xmlschema.aliases import BaseXsdType
    from xmlschema.validators import XsdAnyElement, XsdComponent, XsdElement, XsdSimpleType

RESPOND_WARNING = (
    "When you respond (return to your caller), your call chain is pruned: any peers you "
    "called are terminated, their state and context (calculator memory, scratch space, "
    "etc.) is lost, and you cannot call them again in the same context after responding. "
    "Therefore: complete ALL sub-tasks before responding. If you need results from a peer, "
    "wait for their response first."
)


def describe_payload(ptype: PayloadType) -> str:
    """One payload type as readable lines: root tag, namespace, fields, an example."""
    # Imported here: xmlschema takes ~175 ms to import, and only a starting pump needs it
    # (not `send`, `check` or `console`).
    import xmlschema

    schema = xmlschema.XMLSchema(etree.tostring(ptype.schema_doc, encoding="unicode"))
    element = schema.elements[ptype.local]
    lines = [f'<{ptype.local} xmlns="{ptype.namespace}">']
    # A documented element (an MCP tool's description, docs/mcp.md) says what it does.
    lines.extend("  " + line for line in _documentation(element).splitlines())
    for attr_name, attr in element.attributes.items():
        need = "required" if attr.use == "required" else "optional"
        lines.append(f"  attribute {attr_name}: {_type_name(attr.type)} ({need})")
    text = _simple_content(element.type)
    if text is not None:
        lines.append(f"  text: {_type_name(text)}")
    else:
        for child in _children(element.type):
            lines.extend(_describe_child(child, "  "))
    lines.append(f"  example: {_example(element, ptype.namespace)}")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class TaskForm:
    """How a person types a payload of one type (the web console's task form).

    ``field`` is its one text field, which typed text fills: the local name of the root's
    only child element when that child holds a string (``<task><text>``), ``""`` when the
    root itself holds only a string, None when the payload has more than that (other
    elements, required attributes, a non-string value): it is then typed as XML, starting
    from ``example``."""

    tag: str
    namespace: str
    local: str
    field: str | None
    example: str


#: XSD types whose values are any text a person types (no enumeration, no pattern).
_TEXT_TYPES = frozenset({"string", "normalizedString", "token"})


def task_form(ptype: PayloadType) -> TaskForm:
    """``ptype`` as a :class:`TaskForm`. Compiles its XSD with xmlschema (milliseconds):
    callers keep the result."""
    import xmlschema  # see describe_payload
    from xmlschema.validators import XsdElement, XsdSimpleType

    schema = xmlschema.XMLSchema(etree.tostring(ptype.schema_doc, encoding="unicode"))
    element = schema.elements[ptype.local]
    example = _example(element, ptype.namespace)
    field = None
    if not any(a.use == "required" for a in element.attributes.values()):
        text = _simple_content(element.type)
        if text is not None:
            field = "" if _is_text(text) else None
        else:
            children = _children(element.type)
            # One child element (not a wildcard) holding text of a simple type.
            if len(children) == 1 and isinstance(children[0], XsdElement):
                child = children[0]
                if (
                    isinstance(child.type, XsdSimpleType)
                    and child.max_occurs == 1
                    and _is_text(child.type)
                ):
                    field = child.local_name
    return TaskForm(ptype.tag, ptype.namespace, ptype.local, field, example)


# The schema walk below: xmlschema's classes are imported where they are needed, once
# describe_payload or task_form has imported xmlschema.


def _simple_content(t: BaseXsdType) -> XsdSimpleType | None:
    """The simple type of an element of type ``t`` that holds text (with attributes or
    not); None when it holds elements, or nothing."""
    from xmlschema.validators import XsdSimpleType

    if isinstance(t, XsdSimpleType):
        return t
    if t.has_simple_content() and isinstance(t.content, XsdSimpleType):
        return t.content
    return None


def _children(t: BaseXsdType) -> list[XsdElement | XsdAnyElement]:
    """The child elements and wildcards (``xs:any``) an element of type ``t`` may hold."""
    from xmlschema.validators import XsdGroup, XsdSimpleType

    if isinstance(t, XsdSimpleType) or not isinstance(t.content, XsdGroup):
        return []
    return list(t.content.iter_elements())


def _is_text(t: XsdSimpleType) -> bool:
    """Whether any typed text is a valid value of simple type ``t`` (length aside)."""
    restricted = t.enumeration or t.patterns
    return not restricted and _type_name(t) in _TEXT_TYPES


def _documentation(el: XsdComponent) -> str:
    """The text of an element declaration's ``xs:documentation`` ("" without one)."""
    annotation = el.annotation
    docs = annotation.documentation if annotation is not None else ()
    return " ".join((d.text or "").strip() for d in docs).strip()


def _describe_child(child: XsdElement | XsdAnyElement, indent: str) -> list[str]:
    from xmlschema.validators import XsdAnyElement, XsdSimpleType

    occurs = _occurs(child)
    doc = _documentation(child)
    note = f" ({doc})" if doc else ""
    if isinstance(child, XsdAnyElement):
        # A wildcard has no name or type of its own: the namespaces its elements come
        # from (``##other``: any but the payload's) are all there is to say.
        spaces = " ".join(child.namespace) or "##any"
        return [f"{indent}any element of namespace {spaces}{occurs}{note}"]
    if isinstance(child.type, XsdSimpleType):
        return [f"{indent}<{child.local_name}>: {_type_name(child.type)}{occurs}{note}"]
    out = [f"{indent}<{child.local_name}>{occurs}:{note}"]
    for grandchild in _children(child.type):
        out.extend(_describe_child(grandchild, indent + "  "))
    return out


def _occurs(el: XsdElement | XsdAnyElement) -> str:
    if el.max_occurs is None:
        return " (zero or more)"
    if el.min_occurs == 0:
        return " (optional)"
    return ""


def _type_name(t: BaseXsdType | None) -> str:
    """A type's readable name: its values if enumerated, else the nearest named type
    it derives from ("text": none, as for an attribute declared without a type)."""
    from xmlschema.validators import XsdSimpleType

    enum = t.enumeration if isinstance(t, XsdSimpleType) else None
    if enum:
        return "one of " + ", ".join(repr(v) for v in enum)
    base: BaseXsdType | None = t
    while base is not None and base.local_name is None:
        base = base.base_type
    name = base.local_name if base is not None else None
    return name if name is not None else "text"


_SAMPLES = {
    "integer": "1",
    "double": "1.5",
    "decimal": "1.5",
    "boolean": "true",
    "dateTime": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "base64Binary": "aGk=",
}


def _example(element: XsdElement, ns: str) -> str:
    from xmlschema.validators import XsdElement

    def build(el: XsdElement, parent: etree._Element | None) -> etree._Element:
        tag = f"{{{ns}}}{el.local_name}"
        if parent is None:
            node = etree.Element(tag, nsmap={None: ns})
        else:
            node = etree.SubElement(parent, tag)
        text = _simple_content(el.type)
        if text is not None:
            enum = text.enumeration
            node.text = str(enum[0]) if enum else _SAMPLES.get(_type_name(text), "...")
        else:
            for child in _children(el.type):
                # A wildcard (xs:any) names no element to show.
                if isinstance(child, XsdElement) and (
                    child.min_occurs > 0 or child.max_occurs is None
                ):
                    build(child, node)
        return node

    root = build(element, None)
    return etree.tostring(root, encoding="unicode")


def usage_instructions(
    own_name: str,
    own_types: Iterable[PayloadType],
    peers: dict[str, list[PayloadType]],
    *,
    describe: Callable[[PayloadType], str] = describe_payload,
) -> str:
    """The text a listener (typically an agent) gets about how to talk to its peers.

    ``describe`` renders one payload type; pass a memoised :func:`describe_payload` when
    writing the instructions of several listeners that share peers."""
    parts = [f"You are the listener '{own_name}'."]
    own = list(own_types)
    if own:
        tags = ", ".join(f'<{p.local} xmlns="{p.namespace}">' for p in own)
        parts.append(
            f"Emitting your own root tag ({tags}) sends the message back to you (self-iteration)."
        )
    if peers:
        parts.append("Your peers, and the payloads each accepts:")
        for name, ptypes in sorted(peers.items()):
            for ptype in ptypes:
                parts.append(f"- peer '{name}' accepts:\n{describe(ptype)}")
    else:
        parts.append("You have no peers: you can only respond to your caller or end.")
    parts.append(RESPOND_WARNING)
    return "\n".join(parts)
