"""The one hardened XML parser, and canonical serialisation.

Every byte string that enters the server is parsed here. The parser resolves no entities,
loads no DTD, touches no network, keeps libxml2's default size and depth limits
(``huge_tree=False``: depth is capped at 256 levels) and drops comments and processing
instructions. Any document that declares a DTD is refused outright, even an internal one,
so entity tricks (billion laughs, quadratic blowup, external entities) never get started.
"""

from __future__ import annotations

from collections.abc import Callable

from lxml import etree

from agentserver.core.errors import HuhReason, InputRefused

DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024


def make_parser() -> etree.XMLParser:
    """Return a new hardened parser. lxml parsers are not thread-safe: one per thread."""
    return etree.XMLParser(
        resolve_entities=False,
        no_network=True,
        load_dtd=False,
        dtd_validation=False,
        huge_tree=False,
        remove_comments=True,
        remove_pis=True,
        collect_ids=False,
        compact=True,
    )


class SafeParser:
    """Parse untrusted bytes into an element, or raise :class:`InputRefused`.

    Not thread-safe (it owns one lxml parser); the pump runs it on the trio thread only.
    """

    __slots__ = ("_parser", "max_bytes")

    def __init__(self, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._parser = make_parser()
        self.max_bytes = max_bytes

    def parse(self, data: bytes) -> etree._Element:
        if len(data) > self.max_bytes:
            raise InputRefused(HuhReason.TOO_LARGE, f"{len(data)} bytes")
        # Refuse before parsing: a DOCTYPE is the door to every entity attack, and we
        # have no use for one. The docinfo check below catches spellings this misses.
        if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
            raise InputRefused(HuhReason.MALFORMED, "DTD present")
        try:
            root = etree.fromstring(data, self._parser)
        except etree.XMLSyntaxError as exc:
            raise InputRefused(HuhReason.MALFORMED, str(exc)) from None
        except ValueError as exc:  # e.g. unicode strings with encoding declarations
            raise InputRefused(HuhReason.MALFORMED, str(exc)) from None
        if root is None:
            raise InputRefused(HuhReason.MALFORMED, "empty document")
        docinfo = root.getroottree().docinfo
        if docinfo.doctype or docinfo.internalDTD is not None:
            raise InputRefused(HuhReason.MALFORMED, "DTD present")
        return root


def canonicalize(element: etree._Element) -> bytes:
    """Exclusive C14N of ``element``. Call only on trees that have been validated."""
    return etree.tostring(element, method="c14n", exclusive=True)


def canonical_or_empty(element: etree._Element) -> bytes:
    """:func:`canonicalize`, or ``b""`` for a tree that cannot be canonicalised (for the
    ``original-attempt`` of a refused output, which may be any tree a handler built)."""
    try:
        return canonicalize(element)
    except Exception:
        return b""


def tag_of(element: etree._Element) -> str:
    """An element's tag (``{ns}local``): a str for every element parsed or built here.
    lxml's annotations also allow the bytes or QName a program may assign to ``.tag``
    (stored as given), which nothing in the package does; a comment's or processing
    instruction's tag is not a str either, so those raise TypeError."""
    tag = element.tag
    if not isinstance(tag, str):
        raise TypeError(f"not an element: its tag is {tag!r}")
    return tag


#: ``copy_tree(element, None)`` is ``element.__deepcopy__(None)``: a deep copy of a prepared
#: tree, without copy.deepcopy's generic dispatch (which costs as much as the copy). lxml
#: defines the method, its annotations (types-lxml) do not (hence getattr): the one place
#: that is said.
copy_tree: Callable[[etree._Element, None], etree._Element] = getattr(  # noqa: B009
    etree._Element, "__deepcopy__"
)
