"""The envelope wire format: parse and validate inbound bytes, build outbound trees. Pure."""

from __future__ import annotations

import re
from typing import Protocol, TypeAlias, cast

from lxml import etree

from agentserver.core.errors import HuhReason, InputRefused
from agentserver.core.namespaces import CORE_NS, ENVELOPE_NS
from agentserver.core.payloads import PayloadRegistry, PayloadType
from agentserver.core.schemas_export import schema_path
from agentserver.core.xmlsafe import SafeParser, canonicalize

_E = f"{{{ENVELOPE_NS}}}"
MESSAGE = _E + "message"
META = _E + "meta"
FROM = _E + "from"
TO = _E + "to"
THREAD = _E + "thread"
_CORE_PREFIX = f"{{{CORE_NS}}}"
#: The envelope's optional attribute naming a task's double-texting mode (docs/runs.md).
MULTITASK = "multitask"
#: The double-texting modes, the first the default: the one list the envelope's refusal,
#: ``<agent multitask>``, ``POST /v1/messages?multitask=`` and the runtime check against
#: (``schemas/envelope.xsd`` enumerates them too, and a test holds the two together).
MULTITASK_MODES = ("enqueue", "reject", "interrupt", "rollback")


def load_envelope_schema() -> etree.XMLSchema:
    return etree.XMLSchema(etree.parse(str(schema_path("envelope.xsd")), parser=None))


#: A validated inbound message: ``(to, thread, payload, ptype)``. ``payload`` is still
#: attached to its envelope tree. There is no ``from``: the pump replaces it with the
#: sender's identity. (A plain tuple: one is built per inbound message.)
Inbound: TypeAlias = tuple[str | None, str, etree._Element, PayloadType]


def guess_thread(root: etree._Element | None) -> str | None:
    """Best-effort thread of a message that failed validation, to address the ``<huh>``."""
    if root is None or root.tag != MESSAGE:
        return None
    el = root.find(f"{META}/{THREAD}")
    text = (el.text or "").strip() if el is not None else ""
    return text if 0 < len(text) <= 128 else None


class EnvelopeCodec:
    """Parse → validate envelope → validate payload, in that order; nothing reads the tree
    before it has been validated. Not thread-safe (owns a parser)."""

    __slots__ = ("_env_schema", "_parser", "_ptype_of", "parse_root")

    def __init__(self, registry: PayloadRegistry, *, max_bytes: int) -> None:
        self._parser = SafeParser(max_bytes)
        self._env_schema = load_envelope_schema()
        self._ptype_of = registry.lookup
        #: ``parse_root(data) -> element``: the hardened parse (raises InputRefused).
        self.parse_root = self._parser.parse

    @property
    def max_bytes(self) -> int:
        return self._parser.max_bytes

    def decode(self, root: etree._Element) -> Inbound:
        """Validate a parsed document. Raises :class:`InputRefused`.

        Core-namespace payloads are refused here: they may only come from the pump.
        """
        # The schema has one global element, so a valid root is <message>.
        if not self._env_schema.validate(root):
            # Read only once the envelope failed (the valid path pays nothing): a mode the
            # sender misspelt gets a text naming the modes, not the generic one.
            mode = root.get(MULTITASK) if root.tag == MESSAGE else None
            if mode is not None and mode not in MULTITASK_MODES:
                raise InputRefused(HuhReason.INVALID_MULTITASK, f"multitask={mode!r}")
            # The most common slip: a payload without a namespace (the envelope takes only
            # elements of another namespace than its own). Said in the log, not the <huh>.
            tag = _unqualified_payload(root)
            if tag is not None:
                raise InputRefused(
                    HuhReason.INVALID_ENVELOPE, f"payload `{tag}` has no namespace", payload_tag=tag
                )
            raise InputRefused(HuhReason.INVALID_ENVELOPE)
        # The schema fixed the shape: meta is (from, [to], thread), then one payload.
        meta = root[0]
        payload = root[1]
        ptype = self.validate_payload(payload)
        # xs:token values are whitespace-collapsed by the validator's view, not in the tree.
        # The schema made each non-empty, so there is text (`or ""` is for the type only).
        return (
            (meta[1].text or "").strip() if len(meta) == 3 else None,
            (meta[-1].text or "").strip(),
            payload,
            ptype,
        )

    def validate_payload(self, payload: etree._Element) -> PayloadType:
        """Validate a payload (inbound, or one a handler produced): no core namespace, a
        registered root tag, valid against its XSD. Raises :class:`InputRefused`."""
        tag = payload.tag
        if not isinstance(tag, str):
            raise InputRefused(HuhReason.INVALID_PAYLOAD, "not an element")
        if tag.startswith(_CORE_PREFIX):
            raise InputRefused(HuhReason.RESERVED_NAMESPACE, tag)
        ptype = self._ptype_of(tag)
        if ptype is None:
            raise InputRefused(
                HuhReason.INVALID_PAYLOAD, f"unknown root tag {tag}", payload_tag=tag
            )
        if not ptype.schema.validate(payload):
            raise InputRefused(HuhReason.INVALID_PAYLOAD, schema_reason(ptype.schema, tag))
        return ptype


def _unqualified_payload(root: etree._Element) -> str | None:
    """The local name of a ``<message>``'s payload written without a namespace of its own,
    else None. Such a payload is in no namespace, or, far more often, in the envelope's
    (``<add>`` inside ``<message xmlns="...envelope/v1">`` inherits it)."""
    if root.tag != MESSAGE:
        return None
    for child in root:
        tag = child.tag
        if not isinstance(tag, str) or tag == META:
            continue
        if not tag.startswith("{"):
            return tag
        if tag.startswith(_E):
            return tag[len(_E) :]
    return None


_CLARK = re.compile(r"'?\{[^}\s']+\}([^\s',)]+)'?")


def schema_reason(schema: etree.XMLSchema, tag: str) -> str:
    """Why ``schema`` refused ``tag`` (its last error, element names without their
    namespace), for the log and ``--explain-refusals``: e.g. ``<add>: Missing child
    element(s). Expected is ( <b> ).``"""
    entry = schema.error_log.last_error
    if entry is None:
        return f"{tag} fails its XSD"
    message = _CLARK.sub(r"<\1>", entry.message).replace("Element <", "<", 1)
    return f"{tag} fails its XSD: {message}"


def envelope_multitask(payload: etree._Element) -> str | None:
    """The ``multitask`` mode of the envelope ``payload`` arrived in, or None (none given,
    or a payload no longer in a client's envelope: a broadcast's copy, a listener's call).

    :meth:`EnvelopeCodec.decode` validated it and leaves the payload in its envelope, and
    the pump hands a raw listener that very element: read here, by the one listener that
    cares (an agent's intake), instead of carried with every delivery."""
    parent = payload.getparent()
    if parent is None or parent.tag != MESSAGE:
        return None
    return parent.get(MULTITASK)


def _template(with_to: bool) -> etree._Element:
    root = etree.Element(MESSAGE, nsmap={None: ENVELOPE_NS})
    meta = etree.SubElement(root, META)
    etree.SubElement(meta, FROM)
    if with_to:
        etree.SubElement(meta, TO)
    etree.SubElement(meta, THREAD)
    return root


class _Template(Protocol):
    """An envelope tree to copy: lxml's elements have ``__deepcopy__``, which their stubs
    leave out."""

    def __deepcopy__(self, memo: None, /) -> etree._Element: ...


# Copying a prepared tree is ~3x faster than creating its namespaced elements one by one.
_TEMPLATE_TO = cast(_Template, _template(True))
_TEMPLATE_NO_TO = cast(_Template, _template(False))


def build_envelope(
    from_id: str, to: str | None, thread: str, payload: etree._Element
) -> etree._Element:
    """A new envelope tree around ``payload`` (which is moved into it)."""
    # __deepcopy__ directly: copy.deepcopy's generic machinery costs as much as the copy.
    root = (_TEMPLATE_TO if to is not None else _TEMPLATE_NO_TO).__deepcopy__(None)
    meta = root[0]
    meta[0].text = from_id
    if to is not None:
        meta[1].text = to
    meta[-1].text = thread
    root.append(payload)
    return root


def encode(from_id: str, to: str | None, thread: str, payload: etree._Element) -> bytes:
    """Serialise a message for the wire: exclusive C14N of the (validated) envelope."""
    return canonicalize(build_envelope(from_id, to, thread, payload))
