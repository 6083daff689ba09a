"""Find the XML payloads in a model's text (pure; no I/O).

Models write prose with payloads in it. Only elements whose local name is one the agent
knows (its own root tags, its peers' root tags, its answer tag, ``submit_result``) are taken
as payloads; any other ``<tag>`` is prose (so a model may quote a tool's result). Each
candidate is parsed on its own with the project's hardened parser (no entities, no DTD, no
network, ``huge_tree=False``). A payload written without a namespace is resolved when its
local name matches exactly one known root tag; otherwise it is an error the model sees as
a ``<huh>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from lxml import etree

from agentserver.agents.profile import SUBMIT_RESULT, AgentProfile
from agentserver.errors import HuhReason, InputRefused
from agentserver.primitives.core import huh
from agentserver.xmlsafe import SafeParser

MAX_TEXT_CHARS = 1_000_000
MAX_PAYLOADS = 16
_MAX_ATTEMPT_BYTES = 2048

_START = re.compile(r"<(?:([A-Za-z_][\w.\-]*):)?([A-Za-z_][\w.\-]*)(?=[\s/>])")


class PayloadKind(StrEnum):
    TOOL = "tool"
    SELF = "self"
    SUBMIT = "submit"
    ANSWER = "answer"


@dataclass(frozen=True, slots=True)
class FoundPayload:
    kind: PayloadKind
    element: etree._Element
    tag: str  # Clark notation, after namespace resolution
    to: str | None  # peer listener for TOOL
    raw: str


@dataclass(frozen=True, slots=True)
class PayloadError:
    reason: HuhReason
    hint: str  # shown to the model, never sent on the wire
    raw: str


@dataclass(slots=True)
class ParseResult:
    payloads: list[FoundPayload] = field(default_factory=list)
    errors: list[PayloadError] = field(default_factory=list)


def make_huh(reason: HuhReason, raw: str) -> etree._Element:
    """The pump's ``<huh>`` for a payload the worker refused itself, for the model's eyes
    only (never sent); the model sees at most ``_MAX_ATTEMPT_BYTES`` of its attempt."""
    return huh(reason, raw.encode("utf-8", "replace")[:_MAX_ATTEMPT_BYTES])


def _find_end(text: str, start: int, qname: str) -> int | None:
    """Index just past the element opened at ``start`` (``qname`` as written), or None."""
    gt = text.find(">", start)
    if gt < 0:
        return None
    if text[gt - 1] == "/":
        return gt + 1
    pattern = re.compile(r"<(/?)" + re.escape(qname) + r"(?=[\s/>])[^>]*?(/?)>")
    depth = 1
    for m in pattern.finditer(text, gt + 1):
        if m.group(1):
            depth -= 1
        elif not m.group(2):
            depth += 1
        if depth == 0:
            return m.end()
    return None


def _in_namespace(element: etree._Element, ns: str) -> etree._Element:
    """Copy of ``element`` with every un-namespaced element moved into ``ns``."""

    def tag_of(el: etree._Element) -> str:
        q = etree.QName(el)
        return etree.QName(ns, q.localname).text if q.namespace is None else el.tag

    root = etree.Element(tag_of(element), dict(element.attrib), nsmap={None: ns})
    root.text = element.text

    def copy_children(src: etree._Element, dst: etree._Element) -> None:
        for child in src:
            if not isinstance(child.tag, str):
                continue
            new = etree.SubElement(dst, tag_of(child), dict(child.attrib))
            new.text, new.tail = child.text, child.tail
            copy_children(child, new)

    copy_children(element, root)
    return root


def extract_payloads(text: str, profile: AgentProfile) -> ParseResult:
    """Every payload in ``text``, in order, and every candidate that failed.

    Never raises on model input: every problem becomes a :class:`PayloadError`.
    """
    result = ParseResult()
    if len(text) > MAX_TEXT_CHARS:
        result.errors.append(PayloadError(HuhReason.TOO_LARGE, "reply too long", text[:200]))
        return result
    by_local: dict[str, list[str]] = {}
    for tag in profile.known_roots:
        by_local.setdefault(etree.QName(tag).localname, []).append(tag)
    by_local.setdefault(SUBMIT_RESULT, [])
    parser = SafeParser()
    pos = 0
    while True:
        m = _START.search(text, pos)
        if m is None:
            break
        prefix, local = m.group(1), m.group(2)
        if local not in by_local:
            pos = m.end()
            continue
        qname = f"{prefix}:{local}" if prefix else local
        end = _find_end(text, m.start(), qname)
        if end is None:
            raw = text[m.start() : m.start() + 500]
            result.errors.append(PayloadError(HuhReason.MALFORMED, f"<{qname}> is not closed", raw))
            pos = m.end()
            continue
        raw = text[m.start() : end]
        pos = end
        if len(result.payloads) + len(result.errors) >= MAX_PAYLOADS:
            result.errors.append(PayloadError(HuhReason.TOO_LARGE, "too many payloads", raw))
            break
        _classify(raw, parser, profile, by_local, result)
    return result


def _classify(
    raw: str,
    parser: SafeParser,
    profile: AgentProfile,
    by_local: dict[str, list[str]],
    result: ParseResult,
) -> None:
    try:
        element = parser.parse(raw.encode("utf-8"))
    except InputRefused as exc:
        result.errors.append(PayloadError(exc.reason, f"not well-formed: {exc.detail}", raw))
        return
    q = etree.QName(element)
    if q.localname == SUBMIT_RESULT and q.namespace is None:
        result.payloads.append(FoundPayload(PayloadKind.SUBMIT, element, element.tag, None, raw))
        return
    tag = element.tag
    if q.namespace is None:
        candidates = by_local.get(q.localname, [])
        if len(candidates) != 1:
            hint = (
                f"<{q.localname}> is ambiguous: write its namespace"
                if candidates
                else f"<{q.localname}> is not a payload you can send"
            )
            result.errors.append(PayloadError(HuhReason.INVALID_PAYLOAD, hint, raw))
            return
        tag = candidates[0]
        element = _in_namespace(element, etree.QName(tag).namespace or "")
    if tag in profile.own_roots:
        kind, to = PayloadKind.SELF, None
    elif tag in profile.peers:
        kind, to = PayloadKind.TOOL, profile.peers[tag]
    elif tag == profile.answer_tag:
        kind, to = PayloadKind.ANSWER, None
    else:
        hint = f"{tag} is not a payload you can send"
        result.errors.append(PayloadError(HuhReason.INVALID_PAYLOAD, hint, raw))
        return
    result.payloads.append(FoundPayload(kind, element, tag, to, raw))
