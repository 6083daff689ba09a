"""A small GBNF matcher for tests: does a grammar (llama.cpp's syntax, the subset
agentserver/core/xsd_gbnf.py writes) accept a whole string?

Rules one per line (``name ::= expr``); literals ``"..."``; classes ``[...]`` and
``[^...]`` with ranges and ``\\x..``/``\\n``/``\\t``/``\\r``/``\\\\``/``\\"``/``\\]``
escapes; groups; ``|``; postfix ``* + ? {m} {m,} {m,n}``. Matching computes, for each
expression and start position, the set of end positions (memoised; the grammars have no
left recursion).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))


@dataclass(frozen=True)
class Lit:
    text: str


@dataclass(frozen=True)
class Cls:
    ranges: tuple[tuple[int, int], ...]
    negated: bool

    def has(self, ch: str) -> bool:
        c = ord(ch)
        inside = any(lo <= c <= hi for lo, hi in self.ranges)
        return inside != self.negated


@dataclass(frozen=True)
class Ref:
    name: str


@dataclass(frozen=True)
class Seq:
    items: tuple


@dataclass(frozen=True)
class Alt:
    options: tuple


@dataclass(frozen=True)
class Rep:
    item: object
    lo: int
    hi: int | None


class GrammarSyntaxError(ValueError):
    pass


_ESC = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "]": "]", "[": "["}


class _Parser:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self.i += 1

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def char(self) -> str:
        ch = self.s[self.i]
        if ch != "\\":
            self.i += 1
            return ch
        nxt = self.s[self.i + 1]
        if nxt == "x":
            value = chr(int(self.s[self.i + 2 : self.i + 4], 16))
            self.i += 4
            return value
        if nxt in _ESC:
            self.i += 2
            return _ESC[nxt]
        raise GrammarSyntaxError(f"unknown escape \\{nxt}")

    def expr(self) -> object:
        options = [self.seq()]
        while True:
            self.ws()
            if self.peek() == "|":
                self.i += 1
                options.append(self.seq())
            else:
                break
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def seq(self) -> object:
        items = []
        while True:
            self.ws()
            ch = self.peek()
            if ch in ("", "|", ")"):
                break
            items.append(self.postfix(self.primary()))
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def primary(self) -> object:
        ch = self.peek()
        if ch == '"':
            self.i += 1
            out = []
            while self.peek() != '"':
                if not self.peek():
                    raise GrammarSyntaxError("unterminated literal")
                out.append(self.char())
            self.i += 1
            return Lit("".join(out))
        if ch == "[":
            self.i += 1
            negated = self.peek() == "^"
            if negated:
                self.i += 1
            ranges = []
            while self.peek() != "]":
                if not self.peek():
                    raise GrammarSyntaxError("unterminated class")
                lo = self.char()
                hi = lo
                if self.peek() == "-" and self.s[self.i + 1] != "]":
                    self.i += 1
                    hi = self.char()
                ranges.append((ord(lo), ord(hi)))
            self.i += 1
            return Cls(tuple(ranges), negated)
        if ch == "(":
            self.i += 1
            inner = self.expr()
            self.ws()
            if self.peek() != ")":
                raise GrammarSyntaxError(
                    f"expected ) at {self.i}: {self.s[self.i : self.i + 20]!r}"
                )
            self.i += 1
            return inner
        start = self.i
        while self.peek() and (self.peek().isalnum() or self.peek() == "-"):
            self.i += 1
        if start == self.i:
            raise GrammarSyntaxError(f"unexpected {ch!r} at {self.i}")
        return Ref(self.s[start : self.i])

    def postfix(self, item: object) -> object:
        while True:
            ch = self.peek()
            if ch == "*":
                item, self.i = Rep(item, 0, None), self.i + 1
            elif ch == "+":
                item, self.i = Rep(item, 1, None), self.i + 1
            elif ch == "?":
                item, self.i = Rep(item, 0, 1), self.i + 1
            elif ch == "{":
                end = self.s.index("}", self.i)
                body = self.s[self.i + 1 : end]
                self.i = end + 1
                if "," in body:
                    a, b = body.split(",", 1)
                    item = Rep(item, int(a), int(b) if b.strip() else None)
                else:
                    item = Rep(item, int(body), int(body))
            else:
                return item


def parse(grammar: str) -> dict[str, object]:
    rules: dict[str, object] = {}
    for line in grammar.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, body = line.partition("::=")
        if not sep:
            raise GrammarSyntaxError(f"not a rule: {line!r}")
        p = _Parser(body)
        rules[name.strip()] = p.expr()
        p.ws()
        if p.i != len(body):
            raise GrammarSyntaxError(f"trailing text in {line!r}: {body[p.i :]!r}")
    for rule in rules.values():
        _check_refs(rule, rules)
    return rules


def _check_refs(node: object, rules: dict[str, object]) -> None:
    if isinstance(node, Ref):
        if node.name not in rules:
            raise GrammarSyntaxError(f"undefined rule {node.name}")
    elif isinstance(node, Seq):
        for n in node.items:
            _check_refs(n, rules)
    elif isinstance(node, Alt):
        for n in node.options:
            _check_refs(n, rules)
    elif isinstance(node, Rep):
        _check_refs(node.item, rules)


class Matcher:
    def __init__(self, grammar: str) -> None:
        self.rules = parse(grammar)

    def accepts(self, text: str, root: str = "root") -> bool:
        memo: dict[tuple[int, int], frozenset[int]] = {}
        return len(text) in self._ends(self.rules[root], text, 0, memo)

    def _ends(self, node: object, s: str, i: int, memo: dict) -> frozenset[int]:
        key = (id(node), i)
        got = memo.get(key)
        if got is not None:
            return got
        memo[key] = frozenset()  # a guard against (unexpected) left recursion
        if isinstance(node, Lit):
            out = frozenset([i + len(node.text)]) if s.startswith(node.text, i) else frozenset()
        elif isinstance(node, Cls):
            out = frozenset([i + 1]) if i < len(s) and node.has(s[i]) else frozenset()
        elif isinstance(node, Ref):
            out = self._ends(self.rules[node.name], s, i, memo)
        elif isinstance(node, Seq):
            cur = frozenset([i])
            for item in node.items:
                nxt: set[int] = set()
                for p in cur:
                    nxt |= self._ends(item, s, p, memo)
                cur = frozenset(nxt)
                if not cur:
                    break
            out = cur
        elif isinstance(node, Alt):
            acc: set[int] = set()
            for option in node.options:
                acc |= self._ends(option, s, i, memo)
            out = frozenset(acc)
        elif isinstance(node, Rep):

            def step(positions: set[int]) -> set[int]:
                out: set[int] = set()
                for p in positions:
                    out |= self._ends(node.item, s, p, memo)
                return out

            cur = {i}
            for _ in range(node.lo):
                cur = step(cur)
            acc = set(cur)
            if node.hi is None:
                frontier = set(cur)
                while frontier:
                    frontier = step(frontier) - acc
                    acc |= frontier
            else:
                for _ in range(node.hi - node.lo):
                    cur = step(cur)
                    if not cur:
                        break
                    acc |= cur
            out = frozenset(acc)
        else:  # pragma: no cover
            raise TypeError(node)
        memo[key] = out
        return out


def accepts(grammar: str, text: str) -> bool:
    return Matcher(grammar).accepts(text)
