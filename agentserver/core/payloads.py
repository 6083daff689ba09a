"""Payload types: a pydantic-xml model, the XSD derived from it, and the compiled validator."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

from lxml import etree
from pydantic_xml import BaseXmlModel

from agentserver.core.errors import ConfigurationError
from agentserver.core.xsdgen import derive_schema, merge_schemas, model_root_tag, split_tag
from agentserver.core.xsdpayload import schema_doc_of

M = TypeVar("M", bound=BaseXmlModel)


def model_from_tree(model: type[M], element: etree._Element) -> M:
    """``model.from_xml_tree(element)``. pydantic-xml reads lxml elements here (its lxml
    backend, chosen at import), but its annotations name xml.etree's: the one place the
    checker is told so."""
    return model.from_xml_tree(element)  # type: ignore[arg-type]


def model_xml(instance: BaseXmlModel) -> bytes:
    """``instance.to_xml()``: bytes from lxml's serialiser (annotated as str or bytes)."""
    xml = instance.to_xml()
    return xml.encode("utf-8") if isinstance(xml, str) else xml


def model_tree(instance: BaseXmlModel, *, exclude_none: bool = False) -> etree._Element:
    """``instance.to_xml_tree()``, an lxml element (see :func:`model_from_tree`)."""
    return instance.to_xml_tree(exclude_none=exclude_none)  # type: ignore[return-value]


@dataclass(frozen=True, slots=True, eq=False)
class PayloadType:
    """One payload type. ``schema`` is an lxml ``XMLSchema``: safe to share, not to mutate."""

    model: type[BaseXmlModel]
    tag: str
    namespace: str
    local: str
    schema_doc: etree._Element
    schema: etree.XMLSchema

    @classmethod
    def from_model(cls, model: type[BaseXmlModel]) -> PayloadType:
        """Derive and compile the schema. Raises :class:`ConfigurationError` if it cannot."""
        # A type declared by an XSD file brings its schema; a model's is derived.
        doc = schema_doc_of(model)
        if doc is None:
            doc = derive_schema(model)
        try:
            compiled = etree.XMLSchema(doc)
        except etree.XMLSchemaParseError as exc:  # a bug in derivation, not user input
            raise ConfigurationError(
                f"{model.__name__}: derived XSD does not compile: {exc}"
            ) from exc
        tag = model_root_tag(model)
        ns, local = split_tag(tag)
        return cls(model, tag, ns, local, doc, compiled)

    def is_valid(self, element: etree._Element) -> bool:
        """Validate ``element`` (a payload root, possibly inside an envelope tree)."""
        return self.schema.validate(element)


class PayloadRegistry:
    """Root tag → payload type. One model per tag; registering the same model again is a no-op."""

    def __init__(self) -> None:
        self._by_tag: dict[str, PayloadType] = {}
        #: ``lookup(tag) -> PayloadType | None``, as :meth:`get` without a Python call
        #: (for the pump's hot path).
        self.lookup = self._by_tag.get

    def add(self, model: type[BaseXmlModel]) -> PayloadType:
        tag = model_root_tag(model)
        existing = self._by_tag.get(tag)
        if existing is not None:
            if existing.model is model:
                return existing
            raise ConfigurationError(
                f"root tag {tag} is declared by both {existing.model.__qualname__} "
                f"and {model.__qualname__}"
            )
        ptype = PayloadType.from_model(model)
        self._by_tag[tag] = ptype
        return ptype

    def get(self, tag: str) -> PayloadType | None:
        return self._by_tag.get(tag)

    def __iter__(self) -> Iterator[PayloadType]:
        return iter(self._by_tag.values())

    def __len__(self) -> int:
        return len(self._by_tag)

    def namespace_schemas(self) -> dict[str, etree._Element]:
        """One merged ``xs:schema`` per namespace, for clients."""
        grouped: dict[str, list[etree._Element]] = {}
        for ptype in self._by_tag.values():
            grouped.setdefault(ptype.namespace, []).append(ptype.schema_doc)
        return {ns: merge_schemas(docs) for ns, docs in grouped.items()}
