"""A policy compiled for matching: per (target, root tag), a plan of the rules that can
match, every condition kind tested at once for all of them as bit masks; and the verdicts,
built once. Pure, no I/O; the plan memo is bounded (``CANDIDATE_CACHE_MAX``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from lxml import etree

from agentserver.agents.policy.rules import CallInfo, Decision, PayloadView, Rule, child_text
from agentserver.core.xmlsafe import tag_of

CANDIDATE_CACHE_MAX = 4096


def _has(needle: str, text: str) -> bool:
    return needle in text


def _at_most(limit: int, text: str) -> bool:
    return len(text) <= limit


class PathPlan:
    """Every predicate the candidate rules put on one arg path, as bit masks (bit i: the
    i-th candidate), so the path's text is read once per call and each kind of condition
    is tested once for all rules at a time."""

    __slots__ = ("absent_fail", "eq_all", "eq_map", "numeric", "path", "slow")

    def __init__(self, path: tuple[str, ...]) -> None:
        self.path = path
        self.absent_fail = 0  # rules that fail when the path is absent
        self.eq_all = 0  # rules with ``equals`` (or ``one-of``) on this path
        self.eq_map: dict[str, int] = {}  # value → those of eq_all it satisfies
        self.numeric: list[tuple[int, float, float]] = []  # (bit, lo, hi)
        # (bit, check) for the rest, cheapest kind first; regexes last.
        self.slow: list[tuple[int, Callable[[str], bool]]] = []


class RulePlan:
    """The candidate rules for one (target, root tag), compiled for :meth:`Policy.match`."""

    __slots__ = ("all", "free", "paths", "regexes", "rules", "steps")

    def __init__(self, rules: tuple[Rule, ...]) -> None:
        self.rules = rules
        self.all = (1 << len(rules)) - 1
        self.steps: list[tuple[int, int]] = []  # (bit, min_step)
        by_path: dict[tuple[str, ...], PathPlan] = {}
        regexes: list[tuple[PathPlan, int, Callable[[str], object]]] = []
        for i, rule in enumerate(rules):
            bit = 1 << i
            if rule.min_step is not None:
                self.steps.append((bit, rule.min_step))
            for a in rule.args:
                pp = by_path.get(a.path)
                if pp is None:
                    pp = by_path[a.path] = PathPlan(a.path)
                if a.required or a.checks:
                    pp.absent_fail |= bit
                if a.equals is not None or a.one_of is not None:
                    # Both are set membership; a rule with both needs the intersection.
                    values = {a.equals} if a.equals is not None else set(a.one_of or ())
                    if a.one_of is not None:
                        values &= a.one_of
                    if pp.eq_all & bit:
                        # A second equality predicate on the same path: narrow the first.
                        for v, m in list(pp.eq_map.items()):
                            if m & bit and v not in values:
                                pp.eq_map[v] = m & ~bit
                    else:
                        pp.eq_all |= bit
                        for v in values:
                            pp.eq_map[v] = pp.eq_map.get(v, 0) | bit
                if a.min is not None or a.max is not None:
                    lo = float("-inf") if a.min is None else a.min
                    hi = float("inf") if a.max is None else a.max
                    pp.numeric.append((bit, lo, hi))
                if a.contains is not None:
                    needle = a.contains
                    pp.slow.append((bit, functools.partial(_has, needle)))
                if a.max_length is not None:
                    limit = a.max_length
                    pp.slow.append((bit, functools.partial(_at_most, limit)))
                if a.regex is not None:
                    regexes.append((pp, bit, a.regex.fullmatch))
        self.paths = tuple(by_path.values())
        self.regexes = tuple(regexes)
        # Rules without any arg predicate or step bound: they hold whatever the call says.
        self.free = self.all
        for bit, _ in self.steps:
            self.free &= ~bit
        for pp in self.paths:
            self.free &= ~(pp.absent_fail | pp.eq_all | sum(b for b, *_ in pp.numeric))
            self.free &= ~sum(b for b, _ in pp.slow)
        for _, bit, _ in self.regexes:
            self.free &= ~bit

    def first(self, payload: etree._Element, step: int) -> Rule | None:
        rules = self.rules
        free = self.free
        if free & 1:  # the first candidate needs nothing more: the common cheap case
            return rules[0]
        alive = self.all
        for bit, min_step in self.steps:
            if step < min_step:
                alive &= ~bit
        texts: dict[tuple[str, ...], str | None] = {}
        kids: dict[str, etree._Element] | None = None
        # Cheap conditions first for every rule, so costly ones run only for survivors.
        for pp in self.paths:
            if not alive & ~free:
                break
            path = pp.path
            if kids is None:
                kids = {}
                for child in payload:
                    tag = child.tag
                    if isinstance(tag, str):
                        kids.setdefault(tag.rpartition("}")[2], child)
            text = child_text(kids, path)
            texts[path] = text
            if text is None:
                alive &= ~pp.absent_fail
                continue
            if pp.eq_all:
                alive &= ~pp.eq_all | pp.eq_map.get(text, 0)
            if pp.numeric:
                try:
                    value = float(text)
                except ValueError:
                    value = float("nan")  # within no bounds
                for bit, lo, hi in pp.numeric:
                    if alive & bit and not lo <= value <= hi:
                        alive &= ~bit
            for bit, check in pp.slow:
                if alive & bit and not check(text):
                    alive &= ~bit
        for pp, bit, fullmatch in self.regexes:
            if alive & bit:
                text = texts[pp.path]
                if text is not None and fullmatch(text) is None:
                    alive &= ~bit
        if not alive:
            return None
        return rules[(alive & -alive).bit_length() - 1]


@dataclass(frozen=True, slots=True)
class Policy:
    default: Decision
    rules: tuple[Rule, ...]  # sorted by priority
    # (target, root tag) → a plan of the rules whose target and payload conditions hold, in
    # order: a memo (peers times their root tags: few), so a call tries only the rules that
    # can match it, each condition kind at once for all of them.
    _candidates: dict[tuple[str, str], RulePlan] = field(
        default_factory=dict, compare=False, repr=False
    )
    # Verdicts are immutable and depend only on the rule: built once, not per call.
    #: ``id(rule)`` → its verdict, and its rate-limited verdict (None without a rate).
    verdicts: dict[int, tuple[Verdict, Verdict | None]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    #: The verdict when no rule matches.
    default_verdict: Verdict = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        verdicts: dict[int, tuple[Verdict, Verdict | None]] = {}
        for rule in self.rules:
            limited = None
            if rule.decision == Decision.ALLOW and rule.rate is not None:
                r = rule.rate
                limited = Verdict(
                    Decision.DENY,
                    rule,
                    f"rule {rule.name}: rate limit of {r.limit} per {r.window_s:g} s "
                    f"({r.scope}) reached",
                )
            verdicts[id(rule)] = (
                Verdict(rule.decision, rule, f"rule {rule.name}: {rule.decision}"),
                limited,
            )
        object.__setattr__(self, "verdicts", verdicts)
        object.__setattr__(
            self,
            "default_verdict",
            Verdict(
                self.default, None, f"the policy's default is {self.default} (no rule matched)"
            ),
        )

    def match(self, call: CallInfo) -> Rule | None:
        payload = call.payload
        key = (call.target, tag_of(payload))
        plan = self._candidates.get(key)
        if plan is None:
            view = PayloadView(payload)
            plan = RulePlan(tuple(r for r in self.rules if r.selects(call.target, view)))
            if len(self._candidates) >= CANDIDATE_CACHE_MAX:
                self._candidates.clear()
            self._candidates[key] = plan
        return plan.first(payload, call.step)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome for one call. ``rule`` is None when the default decided."""

    decision: Decision
    rule: Rule | None
    reason: str

    @property
    def rule_name(self) -> str:
        return self.rule.name if self.rule is not None else "default"
