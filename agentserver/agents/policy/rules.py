"""The tool-call policy's rules as data: decisions, argument predicates, rates, rules, and
the call and payload view they are matched against (pure, no I/O)."""

from __future__ import annotations

import bisect
import enum
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from lxml import etree

from agentserver.core.xmlsafe import tag_of

DEFAULT_APPROVAL_TIMEOUT_S = 300.0


class Decision(enum.StrEnum):
    ALLOW = "allow"
    DENY = "deny"
    REQUIRE_APPROVAL = "require-approval"


class RateScope(enum.StrEnum):
    TURN = "turn"  # calls this rule allowed in the same Turn
    AGENT = "agent"  # calls this rule allowed in any Turn of the agent
    GLOBAL = "global"  # calls to the same target allowed by any agent's policy


@dataclass(frozen=True, slots=True)
class ArgPredicate:
    """One ``<arg>``: conditions on the text of the child element at ``path``."""

    path: tuple[str, ...]  # local names, from the payload's root down
    equals: str | None = None
    contains: str | None = None
    one_of: frozenset[str] | None = None
    regex: re.Pattern[str] | None = None
    min: float | None = None
    max: float | None = None
    max_length: int | None = None
    required: bool = False
    #: The conditions compiled, one cheap closure each (made at construction).
    checks: tuple[Callable[[str], bool], ...] = field(
        default=(), init=False, compare=False, repr=False
    )

    def holds(self, view: PayloadView) -> bool:
        text = view.text(self.path)
        if text is None:
            # Absent: only a predicate that tests no value (and does not require it) holds.
            return not self.required and not self.checks
        for check in self.checks:
            if not check(text):
                return False
        return True

    def __post_init__(self) -> None:
        object.__setattr__(self, "checks", tuple(self._compile()))

    def _compile(self) -> Iterator[Callable[[str], bool]]:
        """One cheap closure per condition, most selective first."""
        if self.equals is not None:
            equals = self.equals
            yield lambda t: t == equals
        if self.one_of is not None:
            one_of = self.one_of
            yield lambda t: t in one_of
        if self.regex is not None:
            fullmatch = self.regex.fullmatch
            yield lambda t: fullmatch(t) is not None
        if self.contains is not None:
            contains = self.contains
            yield lambda t: contains in t
        if self.max_length is not None:
            n = self.max_length
            yield lambda t: len(t) <= n
        if self.min is not None or self.max is not None:
            lo = float("-inf") if self.min is None else self.min
            hi = float("inf") if self.max is None else self.max

            def within(t: str) -> bool:
                try:
                    value = float(t)
                except ValueError:
                    return False
                return lo <= value <= hi  # NaN is never within bounds

            yield within


class PayloadView:
    """A call's payload as the rules read it, each part computed once per evaluation."""

    __slots__ = ("_kids", "_texts", "local", "payload", "tag")

    def __init__(self, payload: etree._Element) -> None:
        self.payload = payload
        self.tag: str = tag_of(payload)
        self.local: str = self.tag.rpartition("}")[2]
        self._texts: dict[tuple[str, ...], str | None] = {}
        self._kids: dict[str, etree._Element] | None = None

    def text(self, path: tuple[str, ...]) -> str | None:
        if path in self._texts:
            return self._texts[path]
        if self._kids is None:
            # One pass over the root's children (the first of each local name counts).
            kids: dict[str, etree._Element] = {}
            for child in self.payload:
                tag = child.tag
                if isinstance(tag, str):
                    kids.setdefault(tag.rpartition("}")[2], child)
            self._kids = kids
        node = self._kids.get(path[0])
        for step in path[1:]:
            if node is None:
                break
            node = child_named(node, step)
        if node is None:
            text = None
        elif len(node):
            text = "".join(node.itertext()).strip()
        else:
            text = (node.text or "").strip()
        self._texts[path] = text
        return text


def child_named(node: etree._Element, local: str) -> etree._Element | None:
    for child in node:
        tag = child.tag
        if isinstance(tag, str) and tag.rpartition("}")[2] == local:
            return child
    return None


@dataclass(frozen=True, slots=True)
class Rate:
    limit: int
    window_s: float
    scope: RateScope = RateScope.TURN

    def admits(self, times: Sequence[float], now: float) -> bool:
        """True when fewer than ``limit`` of ``times`` (ascending) lie in the window ending
        at ``now``."""
        return len(times) - bisect.bisect_right(times, now - self.window_s) < self.limit


@dataclass(frozen=True, slots=True)
class Rule:
    priority: int
    decision: Decision
    id: str | None = None
    target: str | None = None
    payload: str | None = None  # Clark ``{ns}tag`` or a bare local name
    min_step: int | None = None
    args: tuple[ArgPredicate, ...] = ()
    rate: Rate | None = None
    approver: str | None = None
    timeout_s: float = DEFAULT_APPROVAL_TIMEOUT_S
    line: int = 0
    #: ``target`` compiled (a glob as a regex), or None for any target.
    target_re: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        """How refusals and the step log name the rule: its id, else its priority."""
        return self.id if self.id else f"priority {self.priority}"

    @property
    def key(self) -> str:
        """Stable key of the rule for rate windows."""
        return self.id if self.id else f"#{self.priority}"

    def selects(self, target: str, view: PayloadView) -> bool:
        """The conditions that depend only on the target and the root tag."""
        if self.target_re is not None and self.target_re.fullmatch(target) is None:
            return False
        if self.payload is not None:
            return self.payload == (view.tag if self.payload[0] == "{" else view.local)
        return True

    def matches(self, call: CallInfo) -> bool:
        view = PayloadView(call.payload)
        if not self.selects(call.target, view):
            return False
        if self.min_step is not None and call.step < self.min_step:
            return False
        return all(a.holds(view) for a in self.args)


def child_text(kids: dict[str, etree._Element], path: tuple[str, ...]) -> str | None:
    """The text of the child at ``path`` (the first of each local name), as PayloadView reads it."""
    node = kids.get(path[0])
    for step in path[1:]:
        if node is None:
            return None
        node = child_named(node, step)
    if node is None:
        return None
    if len(node):
        return "".join(node.itertext()).strip()
    return (node.text or "").strip()


@dataclass(frozen=True, slots=True)
class CallInfo:
    """One tool call as the policy sees it. ``step`` is the Turn's step count."""

    agent: str
    target: str
    payload: etree._Element
    step: int
