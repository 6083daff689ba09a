"""An agent's reply format as a GBNF grammar (llama.cpp's), generated from its peers' XSDs.

The reply is free text (no ``<``), then optionally exactly one tool call: an element whose
XML validates against one of the peers' payload schemas. Text alone is the final answer.
The grammar comes from the very schema documents the pump compiles and validates with
(:attr:`PayloadType.schema_doc`), walked here with xmlschema, once, off the hot path.

What one payload's grammar accepts is the payload as a serializer writes it:

- the root start tag carries ``xmlns="<its namespace>"``; children inherit it (an
  unqualified local element says ``xmlns=""``); no prefixes, no comments, no CDATA;
- attributes in declaration order, double-quoted, one space before each; a required one
  is always there, an optional one may be left out; ``fixed`` values are literal;
- child elements in the content model's order (``sequence``), one of (``choice``), each
  as often as ``minOccurs``/``maxOccurs`` allow, with up to 8 whitespace characters
  between them;
- values in their canonical lexical form: integers without ``+`` or leading zeros, within
  the type's range and its ``min/maxInclusive/Exclusive`` facets (exactly: the range is
  written digit by digit); decimals, floats and doubles as ``-?digits(.digits)?`` (an
  exponent, ``INF`` and ``NaN`` for floats); booleans ``true``/``false``/``1``/``0``; base64 in whole
  quanta with exact padding; enumerations as their values; strings as characters other
  than ``<``, ``&``, ``>`` and control characters (quotes, tabs and newlines also excluded
  in attributes), with ``length``/``minLength``/``maxLength`` on ``string``.

So every document the grammar accepts is valid, and every valid document written that
way is accepted (``tests/test_xsd_gbnf.py`` holds the two together with hypothesis). What
cannot be written that way raises :class:`GrammarUnsupported` naming the construct:
patterns, wildcards (``any``, ``anyAttribute``), ``all`` groups, mixed content, lists and
unions, identity constraints, length facets on whitespace-collapsing types, qualified
attributes, XSD 1.1 assertions.

Pure (no I/O). xmlschema is imported in the call (slow to import).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from lxml import etree

from agentserver.core.errors import ConfigurationError
from agentserver.core.payloads import PayloadType

__all__ = [
    "GrammarUnsupported",
    "document_grammar",
    "int_range",
    "payload_grammar",
    "reply_grammar",
]

#: Whitespace allowed between child elements (bounded: a small model must not loop on it).
WS_RULE = "ws ::= [ \\t\\n]{0,8}"
#: Free text before the call (or the whole answer): anything but the start of markup.
PROSE_RULE = "prose ::= [^<]*"
#: A character of text content / of an attribute value (see the module doc).
_TEXT_CHAR = "[^<&>\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f]"
_ATTR_CHAR = '[^<&>"\\x00-\\x1f]'
#: A character of a whitespace-collapsing type's canonical value (no whitespace at all).
_WORD_CHAR = "[^<&> \\x00-\\x1f]"
_WORD_ATTR_CHAR = '[^<&>" \\x00-\\x1f]'

_INT_BOUNDS: dict[str, tuple[int | None, int | None]] = {
    "integer": (None, None),
    "nonNegativeInteger": (0, None),
    "positiveInteger": (1, None),
    "nonPositiveInteger": (None, 0),
    "negativeInteger": (None, -1),
    "long": (-(2**63), 2**63 - 1),
    "int": (-(2**31), 2**31 - 1),
    "short": (-(2**15), 2**15 - 1),
    "byte": (-(2**7), 2**7 - 1),
    "unsignedLong": (0, 2**64 - 1),
    "unsignedInt": (0, 2**32 - 1),
    "unsignedShort": (0, 2**16 - 1),
    "unsignedByte": (0, 2**8 - 1),
}
_STRINGS = frozenset({"string", "anySimpleType"})
_COLLAPSED = frozenset({"token", "normalizedString"})
_DECIMALS = frozenset({"decimal"})
_FLOATS = frozenset({"float", "double"})
_B64 = "[A-Za-z0-9+/]"
_XS = "http://www.w3.org/2001/XMLSchema"


class GrammarUnsupported(ConfigurationError):
    """An XSD construct the reply grammar cannot express. ``construct`` names it,
    ``where`` says in which payload type (and the agent, when known)."""

    def __init__(self, construct: str, where: str) -> None:
        self.construct = construct
        self.where = where
        super().__init__(
            f"{where}: the XSD uses {construct}, which the local model's reply grammar "
            "cannot express; simplify the schema, or turn the constraint off for this "
            'backend (<backend ... constrain="false">)'
        )


def literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _xml_text(value: str, attribute: bool) -> str:
    """``value`` escaped as a serializer writes it in content or in an attribute."""
    value = value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return value.replace('"', "&quot;") if attribute else value


# -- integers ------------------------------------------------------------------


def _positive_pieces(lo: int, hi: int) -> list[str]:
    """GBNF alternatives for the canonical decimal numerals of ``lo..hi`` (``lo`` >= 1)."""
    out: list[str] = []
    start = lo
    while start <= hi:
        k = 0
        while start % 10 ** (k + 1) == 0 and start + 10 ** (k + 1) - 1 <= hi:
            k += 1
        step = 10**k
        end = start + step - 1
        while end + step <= hi and (end + step) // (step * 10) == start // (step * 10):
            end += step
        head, first, last = start // (step * 10), (start // step) % 10, (end // step) % 10
        parts = []
        if head:
            parts.append(literal(str(head)))
        parts.append(literal(str(first)) if first == last else f"[{first}-{last}]")
        if k:
            parts.append("[0-9]" if k == 1 else f"[0-9]{{{k}}}")
        out.append(" ".join(parts))
        start = end + 1
    return _merge_decades(out)


def _merge_decades(pieces: list[str]) -> list[str]:
    """``[1-9]``, ``[1-9] [0-9]``, ``[1-9] [0-9]{2}`` ... in a row become one
    ``[1-9] [0-9]{a,b}``: fewer alternatives for llama.cpp's grammar sampler to track."""

    def digits(piece: str) -> int | None:
        if piece == "[1-9]":
            return 0
        if piece == "[1-9] [0-9]":
            return 1
        if piece.startswith("[1-9] [0-9]{") and piece.endswith("}") and "," not in piece:
            return int(piece[len("[1-9] [0-9]{") : -1])
        return None

    out: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if len(run) == 1:
            out.append("[1-9]" if run[0] == 0 else f"[1-9] [0-9]{{{run[0]}}}")
        elif run:
            out.append(f"[1-9] [0-9]{{{run[0]},{run[-1]}}}")
        run.clear()

    for piece in pieces:
        k = digits(piece)
        if k is not None and (not run or k == run[-1] + 1):
            run.append(k)
            continue
        flush()
        if k is not None:
            run.append(k)
        else:
            out.append(piece)
    flush()
    return out


def _positive_at_least(lo: int) -> list[str]:
    """Alternatives for every canonical numeral >= ``lo`` (``lo`` >= 1): those of up to
    ``lo``'s digit count exactly, then any longer one."""
    digits = len(str(lo))
    out = _positive_pieces(lo, 10**digits - 1)
    out.append(f"[1-9] [0-9]{{{digits},}}")
    return out


def int_range(lo: int | None, hi: int | None) -> str:
    """A GBNF expression for the canonical numerals of the integers in ``[lo, hi]``
    (None: unbounded). Raises ValueError for an empty range."""
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"empty integer range [{lo}, {hi}]")
    alts: list[str] = []
    # Negative part: "-" then a positive numeral in [max(1, -hi), -lo].
    if lo is None or lo < 0:
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        if lo is None:
            pieces = _positive_at_least(neg_lo)
        else:
            pieces = _positive_pieces(neg_lo, -lo)
        alts.append('"-" (' + " | ".join(pieces) + ")")
    if (lo is None or lo <= 0) and (hi is None or hi >= 0):
        alts.append('"0"')
    if hi is None or hi >= 1:
        pos_lo = 1 if lo is None or lo < 1 else lo
        pieces = _positive_at_least(pos_lo) if hi is None else _positive_pieces(pos_lo, hi)
        alts.extend(pieces)
    return "(" + " | ".join(alts) + ")"


# -- the walk ------------------------------------------------------------------


@dataclass
class _Builder:
    prefix: str
    where: str
    rules: dict[str, str] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    counter: int = 0
    #: A long simple-type expression → the one rule holding it, shared by every payload
    #: type of one grammar (the calculator's four payloads share one ``xs:long``).
    shared: dict[str, str] = field(default_factory=dict)
    shared_rules: dict[str, str] = field(default_factory=dict)

    def value(self, t: Any, attribute: bool) -> str:
        expr = self.simple(t, attribute)
        if len(expr) < 48:
            return expr
        name = self.shared.get(expr)
        if name is None:
            name = self.shared[expr] = f"v-{len(self.shared) + 1}"
            self.shared_rules[name] = expr
        return name

    def fail(self, construct: str) -> GrammarUnsupported:
        return GrammarUnsupported(construct, self.where)

    def new_rule(self, hint: str) -> str:
        self.counter += 1
        safe = "".join(c if c.isalnum() else "-" for c in hint)[:24].strip("-") or "x"
        return f"{self.prefix}-{self.counter}-{safe}"

    # -- simple types --

    def simple(self, t: Any, attribute: bool) -> str:
        """A GBNF expression for the canonical values of simple type ``t``."""
        if getattr(t, "is_list", lambda: False)() or getattr(t, "is_union", lambda: False)():
            raise self.fail("a list or union simple type")
        if _user_types(t, "patterns"):
            raise self.fail("an xs:pattern facet")
        if getattr(t, "assertions", None):
            raise self.fail("an XSD 1.1 assertion")
        enum = getattr(t, "enumeration", None)
        if enum:
            values = sorted({_xml_text(str(v), attribute) for v in enum})
            return "(" + " | ".join(literal(v) for v in values) + ")"
        base = _builtin_name(t)
        facets = _facets(t)
        if base in _INT_BOUNDS:
            lo, hi = _INT_BOUNDS[base]
            lo, hi = _narrow(lo, hi, facets, self)
            return int_range(lo, hi)
        if base in _DECIMALS or base in _FLOATS:
            if facets.keys() - {"whiteSpace"}:
                raise self.fail(f"a {sorted(facets)[0]} facet on xs:{base}")
            number = '"-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)?'
            if base in _FLOATS:
                return f'({number} ([eE] "-"? [0-9]+)? | "INF" | "-INF" | "NaN")'
            return f"({number})"
        if base == "boolean":
            return '("true" | "false" | "1" | "0")'
        if base == "base64Binary":
            if facets.keys() - {"whiteSpace"}:
                raise self.fail("a length facet on xs:base64Binary")
            # Whole quanta; a last one of 2 or 1 characters is padded, its last
            # character carrying only the bits it can (XSD's B16 and B04).
            return f'({_B64}{{4}})* ({_B64}{{2}} [AEIMQUYcgkosw048] "=" | {_B64} [AQgw] "==")?'
        if base in _STRINGS or base in _COLLAPSED:
            lengths = {k: v for k, v in facets.items() if k in ("length", "minLength", "maxLength")}
            if base in _COLLAPSED or _collapses(t):
                if lengths:
                    raise self.fail(f"a {sorted(lengths)[0]} facet on a whitespace-collapsing type")
                word = _WORD_ATTR_CHAR if attribute else _WORD_CHAR
                return f'({word}+ (" " {word}+)*)?'
            char = _ATTR_CHAR if attribute else _TEXT_CHAR
            if "length" in lengths:
                n = int(lengths["length"])
                return f"{char}{{{n}}}"
            lo = int(lengths.get("minLength", 0))
            hi = lengths.get("maxLength")
            if hi is None:
                return f"{char}{{{lo},}}" if lo else f"{char}*"
            return f"{char}{{{lo},{int(hi)}}}"
        raise self.fail(f"the simple type xs:{base}")

    # -- elements --

    def element(self, el: Any, root_ns: str | None, root: bool) -> str:
        """The rule name of element declaration ``el`` (made once per declaration)."""
        key = id(el)
        if key in self.names:
            return self.names[key]
        name = self.new_rule(el.local_name)
        self.names[key] = name
        if getattr(el, "identities", None):
            raise self.fail(f"an identity constraint on <{el.local_name}>")
        if getattr(el, "abstract", False):
            raise self.fail(f"an abstract element <{el.local_name}>")
        ns = el.target_namespace if (root or el.qualified) else ""
        ns = ns or ""
        start = "<" + el.local_name
        if root:
            start += f' xmlns="{ns}"'
        elif ns != (root_ns or ""):
            start += f' xmlns="{ns}"'
        t = el.type
        attrs = self.attributes(t) if not t.is_simple() else ""
        end = literal(f"</{el.local_name}>")
        if t.is_simple():
            body = self.value(t, attribute=False)
            content = f'(">" {body} {end} | "/>")' if _may_be_empty(t) else f'">" {body} {end}'
        elif getattr(t, "mixed", False):
            raise self.fail(f"mixed content in <{el.local_name}>")
        elif t.has_simple_content():
            body = self.value(t.content, attribute=False)
            content = (
                f'(">" {body} {end} | "/>")' if _may_be_empty(t.content) else f'">" {body} {end}'
            )
        elif t.is_empty() or t.content is None or not len(t.content):
            content = f'("/>" | ">" {end})'
        else:
            group = self.group(t.content, ns)
            nullable = t.content.is_emptiable()
            inner = f'">" {group} ws {end}'
            content = f'("/>" | {inner})' if nullable else inner
        self.rules[name] = " ".join(p for p in (literal(start), attrs, content) if p)
        return name

    def attributes(self, t: Any) -> str:
        parts = []
        for attr_name, attr in t.attributes.items():
            if attr_name is None or getattr(attr, "local_name", None) is None:
                raise self.fail("an attribute wildcard (xs:anyAttribute)")
            if attr_name.startswith("{"):
                raise self.fail(f"a qualified attribute {attr_name}")
            if attr.use == "prohibited":
                continue
            if attr.fixed is not None:
                value = literal(_xml_text(str(attr.fixed), True))
            else:
                value = self.value(attr.type, attribute=True)
            one = f'" {attr_name}=\\"" {value} "\\""'
            parts.append(one if attr.use == "required" else f"({one})?")
        return " ".join(parts)

    def group(self, g: Any, ns: str) -> str:
        """A model group (sequence or choice) as an expression."""
        model = getattr(g, "model", None)
        if model == "all":
            raise self.fail("an xs:all group")
        items = []
        for particle in g:
            if hasattr(particle, "model"):
                expr = "(" + self.group(particle, ns) + ")"
            elif type(particle).__name__ == "XsdAnyElement":
                raise self.fail("an element wildcard (xs:any)")
            else:
                expr = "ws " + self.element(particle, ns, root=False)
            items.append(_occurs(expr, particle.min_occurs, particle.max_occurs))
        if not items:
            return '""'
        if model == "choice":
            body = "(" + " | ".join(items) + ")"
        else:
            body = " ".join(items)
        return body


def _occurs(expr: str, lo: int, hi: int | None) -> str:
    if lo == 1 and hi == 1:
        return expr
    wrapped = f"({expr})"
    if lo == 0 and hi == 1:
        return wrapped + "?"
    if hi is None:
        return wrapped + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}")
    return wrapped + f"{{{lo},{hi}}}"


def _builtin_name(t: Any) -> str:
    """The nearest XSD built-in type ``t`` derives from."""
    base = t
    while base is not None:
        name = getattr(base, "local_name", None)
        ns = getattr(base, "target_namespace", None)
        if name and ns == _XS:
            return name
        if name and getattr(base, "is_builtin", lambda: False)():
            return name
        base = getattr(base, "base_type", None)
    return "anySimpleType"


def _user_types(t: Any, attribute: str) -> list[Any]:
    """The restrictions between ``t`` and its built-in base that set ``attribute`` (a
    built-in's own patterns, such as xs:double's lexical one, are its definition)."""
    out = []
    base = t
    while base is not None and getattr(base, "target_namespace", None) != _XS:
        if getattr(base, attribute, None):
            out.append(base)
        base = getattr(base, "base_type", None)
    return out


def _collapses(t: Any) -> bool:
    ws = _facets(t).get("whiteSpace")
    return ws in ("collapse", "replace")


def _facets(t: Any) -> dict[str, Any]:
    """The facets of ``t`` and its restriction ancestors (nearest wins), by local name."""
    out: dict[str, Any] = {}
    chain = []
    base = t
    while base is not None and getattr(base, "facets", None) is not None:
        chain.append(base)
        base = getattr(base, "base_type", None)
    for ty in reversed(chain):
        if getattr(ty, "target_namespace", None) == _XS:
            continue  # a built-in's own facets are its definition, not a restriction
        for key, facet in ty.facets.items():
            if key is None:
                continue
            local = etree.QName(key).localname
            if local == "enumeration" or local == "pattern":
                continue
            value = getattr(facet, "value", facet)
            out[local] = value
    return out


def _narrow(lo: int | None, hi: int | None, facets: dict[str, Any], b: _Builder) -> tuple:
    for key, value in facets.items():
        if key == "whiteSpace":
            continue
        try:
            number = Decimal(str(value))
        except InvalidOperation:
            raise b.fail(f"the {key} facet {value!r}") from None
        if key == "minInclusive":
            bound = int(number.to_integral_value(rounding="ROUND_CEILING"))
            lo = bound if lo is None else max(lo, bound)
        elif key == "minExclusive":
            bound = int(number.to_integral_value(rounding="ROUND_FLOOR")) + 1
            lo = bound if lo is None else max(lo, bound)
        elif key == "maxInclusive":
            bound = int(number.to_integral_value(rounding="ROUND_FLOOR"))
            hi = bound if hi is None else min(hi, bound)
        elif key == "maxExclusive":
            bound = int(number.to_integral_value(rounding="ROUND_CEILING")) - 1
            hi = bound if hi is None else min(hi, bound)
        else:
            raise b.fail(f"a {key} facet on an integer type")
    if lo is not None and hi is not None and lo > hi:
        raise b.fail(f"an empty integer range [{lo}, {hi}]")
    return lo, hi


def _may_be_empty(t: Any) -> bool:
    """Whether the empty string is a valid value of simple type ``t`` (then ``<x/>``)."""
    try:
        t.validate("")
    except Exception:
        return False
    return True


def _compile(ptype: PayloadType) -> Any:
    import xmlschema

    return xmlschema.XMLSchema(etree.tostring(ptype.schema_doc, encoding="unicode"))


def payload_grammar(
    ptype: PayloadType,
    *,
    prefix: str,
    where: str = "",
    shared: dict[str, str] | None = None,
    shared_rules: dict[str, str] | None = None,
) -> tuple[str, list[str]]:
    """``(root rule name, rule lines)`` for one payload type; long value expressions go to
    ``shared_rules`` (keyed by rule name; pass the same dicts for every type of one
    grammar, and write ``shared_rules`` once). Raises :class:`GrammarUnsupported`."""
    where = where or f"payload type {ptype.tag}"
    schema = _compile(ptype)
    element = schema.elements[ptype.local]
    b = _Builder(
        prefix,
        where,
        shared={} if shared is None else shared,
        shared_rules={} if shared_rules is None else shared_rules,
    )
    root = b.element(element, ptype.namespace, root=True)
    return root, [f"{name} ::= {body}" for name, body in b.rules.items()]


def _grammar(head: str, ptypes: Sequence[PayloadType], agent: str) -> str:
    lines: list[str] = []
    roots: list[str] = []
    shared: dict[str, str] = {}
    shared_rules: dict[str, str] = {}
    for i, ptype in enumerate(ptypes):
        where = f"payload type {ptype.tag}" + (f" (a peer of agent {agent!r})" if agent else "")
        root, rules = payload_grammar(
            ptype, prefix=f"p{i}", where=where, shared=shared, shared_rules=shared_rules
        )
        roots.append(root)
        lines.extend(rules)
    lines.extend(f"{name} ::= {body}" for name, body in shared_rules.items())
    call = " | ".join(roots)
    if head == "reply":
        top = ["root ::= prose" + (f" ({call})?" if roots else ""), PROSE_RULE]
    else:
        top = ["root ::= " + (call or '""')]
    return "\n".join([*top, WS_RULE, *lines]) + "\n"


def reply_grammar(peers: Iterable[PayloadType], *, agent: str = "") -> str:
    """The GBNF grammar of an agent's reply: free text, then at most one element that
    validates against one of ``peers``' schemas. Raises :class:`GrammarUnsupported`
    naming the construct, the payload type and ``agent``."""
    return _grammar("reply", sorted(peers, key=lambda p: p.tag), agent)


def document_grammar(ptypes: Sequence[PayloadType]) -> str:
    """A grammar for exactly one payload of ``ptypes`` (no prose): for tests and tools."""
    return _grammar("document", ptypes, "")
