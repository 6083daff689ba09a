"""Payload types declared by an XSD file instead of a Python model.

``<accepts schema="schemas/search.xsd" root="{urn:search}query"/>`` in boot.xml declares a
remote listener's payload without any Python of ours: a runner in another language only
has to agree on the schema. The loader turns each (file, root) pair into a
:class:`SchemaPayload` subclass, so everything that handles payload types (the registry,
routing, the XSD export, the usage instructions agents read) handles it as a model; its
schema is the file itself rather than one derived from fields (payloads.PayloadType).

A schema file is configuration from disk, so it is read as hostile input: bounded size,
no DTD, no entities, no network, and no ``xs:include``/``xs:import``/``xs:redefine``/
``xs:override`` (a payload schema is one self-contained file; following references would
let a boot file make the server read arbitrary files or URLs).
"""

from __future__ import annotations

import copy
import pathlib
import re
import types
from typing import TYPE_CHECKING, Any, ClassVar, Self, cast

from lxml import etree
from pydantic import PrivateAttr
from pydantic_xml import BaseXmlModel

from agentserver.core.errors import ConfigurationError
from agentserver.core.namespaces import XSD_NS
from agentserver.core.xmlsafe import make_parser

if TYPE_CHECKING:
    # What pydantic-xml's annotations name; at run time its elements are lxml's (see
    # core/payloads.py's model_from_tree and model_tree, the ways in and out of it).
    from xml.etree.ElementTree import Element as AnnotatedElement

#: A payload schema file larger than this is refused.
MAX_SCHEMA_BYTES = 1 << 20
_XS = f"{{{XSD_NS}}}"
_REFERENCES = frozenset(_XS + t for t in ("include", "import", "redefine", "override"))


class SchemaPayload(BaseXmlModel):
    """Base of payload types declared by an XSD file. Such a type has no fields: a
    non-raw handler given one gets an instance whose :attr:`element` is the validated
    payload (remote listeners and agents take raw elements anyway)."""

    #: The ``xs:schema`` document (the whole file, as read).
    __xsd_doc__: ClassVar[etree._Element | None] = None
    #: Where it came from, for messages.
    __xsd_source__: ClassVar[str] = ""
    _element: Any = PrivateAttr(default=None)

    @property
    def element(self) -> etree._Element:
        return self._element

    @classmethod
    def from_xml_tree(
        cls,
        root: AnnotatedElement,
        context: dict[str, Any] | None = None,
        empty_as_string: bool = False,
    ) -> Self:
        """An instance holding ``root`` (an lxml element: see ``AnnotatedElement``)."""
        instance = cls()
        instance._element = root
        return instance

    def to_xml_tree(
        self, *, skip_empty: bool = False, exclude_none: bool = False, exclude_unset: bool = False
    ) -> AnnotatedElement:
        """A copy of the element it holds (lxml's, as ``from_xml_tree`` was given)."""
        if self._element is None:
            raise ValueError(f"{type(self).__qualname__}: no element to serialise")
        return copy.deepcopy(self._element)


def schema_doc_of(model: type[BaseXmlModel]) -> etree._Element | None:
    """The XSD document of a file-declared type (None for a Python model)."""
    if isinstance(model, type) and issubclass(model, SchemaPayload):
        return model.__xsd_doc__
    return None


def read_schema(path: pathlib.Path) -> etree._Element:
    """Read and check a payload schema file. Raises :class:`ConfigurationError` saying
    what is wrong (missing, too large, not XML, hostile, does not compile)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_SCHEMA_BYTES + 1)
    except OSError as exc:
        raise ConfigurationError(f"schema file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_SCHEMA_BYTES:
        raise ConfigurationError(f"schema file {path}: larger than {MAX_SCHEMA_BYTES} bytes")
    try:
        tree = etree.ElementTree(etree.fromstring(data, make_parser()))
    except etree.XMLSyntaxError as exc:
        raise ConfigurationError(f"schema file {path}: not well-formed XML: {exc}") from None
    if tree.docinfo.doctype or tree.docinfo.internalDTD is not None:
        raise ConfigurationError(f"schema file {path}: a DOCTYPE is not allowed")
    root = tree.getroot()
    if root.tag != _XS + "schema":
        raise ConfigurationError(f"schema file {path}: the root element is not xs:schema")
    for el in root.iter(etree.Element):
        if el.tag in _REFERENCES:
            raise ConfigurationError(
                f"schema file {path}: line {el.sourceline}: {etree.QName(el).localname} is "
                "not allowed (a payload schema must be one self-contained file)"
            )
        if isinstance(el, etree._Entity):
            raise ConfigurationError(f"schema file {path}: entities are not allowed")
    try:
        etree.XMLSchema(root)
    except etree.XMLSchemaParseError as exc:
        raise ConfigurationError(f"schema file {path}: not a valid XSD: {exc}") from None
    return root


_ROOT_RE = re.compile(r"^\{([^{}]+)\}([A-Za-z_][\w.\-]*)$")


def schema_model(doc: etree._Element, root: str, source: str) -> type[SchemaPayload]:
    """The payload type of global element ``root`` (``{ns}local``) of schema ``doc``.
    Raises :class:`ConfigurationError` if ``root`` is malformed or not declared there."""
    match = _ROOT_RE.match(root)
    if match is None:
        raise ConfigurationError(
            f"root {root!r}: write it as {{namespace}}name (a payload must have a namespace)"
        )
    ns, local = match.groups()
    target = doc.get("targetNamespace")
    declared = {el.get("name") for el in doc.iterchildren(_XS + "element")}
    if target != ns or local not in declared:
        found = ", ".join(sorted(f"{{{target}}}{n}" for n in declared if n)) or "none"
        raise ConfigurationError(
            f"{source} declares no global element {root} (its global elements: {found})"
        )
    name = re.sub(r"\W", "_", local) or "payload"
    # types.new_class is typed as making any class; this one derives from SchemaPayload.
    model = cast(
        "type[SchemaPayload]",
        types.new_class(
            name, (SchemaPayload,), {"tag": local, "nsmap": {"": ns}}, lambda _ns: None
        ),
    )
    model.__qualname__ = f"{source}#{local}"
    model.__xsd_doc__ = doc
    model.__xsd_source__ = source
    return model
