"""Find the XML payloads in a model's text (pure; no I/O).

Models write prose with payloads in it. An element whose local name is one the agent
knows (its own root tags, its peers' root tags, its answer tag, ``submit_result``) is a
payload candidate wherever it is. Each candidate is parsed on its own with the project's
hardened parser (no entities, no DTD, no network, ``huge_tree=False``). A payload written
without a namespace is resolved when its local name matches exactly one known root tag;
otherwise it is an error the model sees as a ``<huh>``.

Any other markup is prose as long as it only *mentions* tags: a start tag that is never
closed (``use the <b> tag``), anything in inline code or in a fenced block that names a
language other than XML (:mod:`agentserver.agents.reading.quoting`), text such as ``a < b``,
markup that is not well-formed, and an element the model read and may quote: a peer's
answer or a primitive (``AgentProfile.quotable``; without a namespace, by local name).
But a well-formed element with an unknown name written outside such quotes
(``<teleport><to>mars</to></teleport>``, ``<b>bold</b>``, ``<br/>``) is an attempt to send
something the agent cannot send: all of them together earn one error, whose hint names
the payloads the model may send.

Cost: elements are matched to their end tags in one pass over the text with a stack per
name; unknown candidates that turn out not to be well-formed are re-read from inside, so
the bytes parsed for them are bounded (``_PARSE_BUDGET`` per character of the reply), past
which the reply is refused as too large rather than read for ever.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from lxml import etree

from agentserver.agents.profile.agent import SUBMIT_RESULT, AgentProfile
from agentserver.agents.reading.quoting import quoted_spans
from agentserver.core.errors import HuhReason, InputRefused
from agentserver.core.xmlsafe import SafeParser
from agentserver.core.xmlsafe import tag_of as xml_tag
from agentserver.primitives.core import huh

MAX_TEXT_CHARS = 1_000_000
MAX_PAYLOADS = 16
_MAX_ATTEMPT_BYTES = 2048

_MAX_UNKNOWN_NAMED = 5  # unknown elements named in the hint; the rest are counted
_PARSE_BUDGET = 4  # bytes parsed for unknown candidates, per character of the reply

_START = re.compile(r"<(?:([A-Za-z_][\w.\-]*):)?([A-Za-z_][\w.\-]*)(?=[\s/>])")
# Any start, end or empty-element tag (as the payload finder reads them: up to the first
# ``>``), with its qualified name as written.
_TAG = re.compile(r"<(/?)((?:[A-Za-z_][\w.\-]*:)?[A-Za-z_][\w.\-]*)(?=[\s/>])[^>]*?(/?)>")


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


def element_ends(text: str) -> dict[int, int]:
    """Start index of each element in ``text`` that is closed → the index just past its end.

    An empty-element tag ends itself; a start tag ends at the end tag of the same qualified
    name that brings that name's nesting back to its level (a stack per name); a start tag
    that no end tag closes is absent, as are stray end tags.
    """
    ends: dict[int, int] = {}
    open_: dict[str, list[int]] = {}
    for m in _TAG.finditer(text):
        closing, name, empty = m.group(1), m.group(2), m.group(3)
        if closing:
            stack = open_.get(name)
            if stack:
                ends[stack.pop()] = m.end()
        elif empty:
            ends[m.start()] = m.end()
        else:
            open_.setdefault(name, []).append(m.start())
    return ends


def _sendable(profile: AgentProfile) -> str:
    """The payloads the model may write, for a hint."""

    def written(tag: str) -> str:
        q = etree.QName(tag)
        return f'<{q.localname} xmlns="{q.namespace}">' if q.namespace else f"<{q.localname}>"

    parts = [f"{written(t)} (a tool call to {to})" for t, to in profile.peers.items()]
    parts += [f"{written(t)} (to think again, as yourself)" for t in profile.own_roots]
    parts.append(f"{written(profile.answer_tag)} (your answer)")
    parts.append(f"<{SUBMIT_RESULT}> (your result)")
    return "You can send: " + ", ".join(parts) + "."


def _in_namespace(element: etree._Element, ns: str) -> etree._Element:
    """Copy of ``element`` with every un-namespaced element moved into ``ns``."""

    def tag_of(el: etree._Element) -> str:
        q = etree.QName(el)
        return etree.QName(ns, q.localname).text if q.namespace is None else xml_tag(el)

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
    quotable = set(profile.quotable)
    quotable_local = {etree.QName(tag).localname for tag in profile.quotable}
    parser = SafeParser()
    ends = element_ends(text)
    quoted = quoted_spans(text)
    unknown: list[str] = []  # raw text of each unknown element written as markup
    budget = _PARSE_BUDGET * len(text) + 65536
    pos = 0
    while True:
        m = _START.search(text, pos)
        if m is None:
            break
        prefix, local = m.group(1), m.group(2)
        qname = f"{prefix}:{local}" if prefix else local
        end = ends.get(m.start())
        if local not in by_local:
            pos = m.end()
            if end is None or m.start() in quoted:
                continue  # a mention: an unclosed start tag, or quoted as code
            raw = text[m.start() : end]
            budget -= end - m.start()
            if budget < 0:
                hint = "too much nested markup to read; write less XML"
                result.errors.append(PayloadError(HuhReason.TOO_LARGE, hint, raw[:200]))
                break
            try:
                element = parser.parse(raw.encode("utf-8"))
            except InputRefused:
                continue  # not well-formed: prose that happens to contain "<"
            q = etree.QName(element)
            if element.tag in quotable or (q.namespace is None and q.localname in quotable_local):
                pos = end
                continue  # a tool's result (or a refusal) quoted: the model read it
            unknown.append(raw)
            pos = end  # what it contains is part of the same attempt
            continue
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
    if unknown:
        result.errors.append(_unknown_error(unknown, profile))
    return result


def _unknown_error(raws: list[str], profile: AgentProfile) -> PayloadError:
    """One error for every unknown element of a reply (the model gets one ``<huh>``)."""
    names: list[str] = []
    for raw in raws:
        found = _START.match(raw)
        if found is None:  # each raw is an element's text, which a start tag opens
            continue
        name = f"<{found.group(0)[1:]}>"
        if name not in names:
            names.append(name)
    shown = ", ".join(names[:_MAX_UNKNOWN_NAMED])
    if len(names) > _MAX_UNKNOWN_NAMED:
        shown += f" and {len(names) - _MAX_UNKNOWN_NAMED} more"
    verb = "is not a payload" if len(names) == 1 else "are not payloads"
    hint = (
        f"{shown} {verb} you can send, so nothing was sent. {_sendable(profile)} "
        "To show markup as text, put it in backticks."
    )
    return PayloadError(HuhReason.INVALID_PAYLOAD, hint, raws[0])


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
        result.payloads.append(
            FoundPayload(PayloadKind.SUBMIT, element, xml_tag(element), None, raw)
        )
        return
    tag = xml_tag(element)
    if q.namespace is None:
        candidates = by_local.get(q.localname, [])
        if len(candidates) != 1:
            hint = (
                f"<{q.localname}> is ambiguous: write its namespace"
                if candidates
                else f"<{q.localname}> is not a payload you can send. {_sendable(profile)}"
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
        hint = f"{tag} is not a payload you can send. {_sendable(profile)}"
        result.errors.append(PayloadError(HuhReason.INVALID_PAYLOAD, hint, raw))
        return
    result.payloads.append(FoundPayload(kind, element, tag, to, raw))
