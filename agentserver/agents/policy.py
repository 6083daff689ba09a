"""Tool-call policy: boot.xml's ``<policy>`` as data, and its evaluation (pure, no I/O).

A policy is a default decision and rules ordered by ``priority`` (lowest first; the first
rule whose conditions all hold decides). Conditions: the target listener (a glob), the
payload's root tag (``{ns}tag`` or a bare local name), the Turn's step count (``min-step``)
and argument predicates on the payload's child elements (``<arg path=...>``). An allowing
rule may carry a sliding-window rate limit; the caller supplies the times of the calls the
window already holds (the store keeps them), so time is an argument, never read here.

The peers list is checked before the policy (by the parser and the pump): a policy can
only narrow what an agent may call, never widen it.
"""

from __future__ import annotations

import bisect
import enum
import fnmatch
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from lxml import etree

from agentserver.core.namespaces import BOOT_NS

DEFAULT_APPROVAL_TIMEOUT_S = 300.0
_B = f"{{{BOOT_NS}}}"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class Decision(enum.StrEnum):
    ALLOW = "allow"
    DENY = "deny"
    REQUIRE_APPROVAL = "require-approval"


class RateScope(enum.StrEnum):
    TURN = "turn"  # calls this rule allowed in the same Turn
    AGENT = "agent"  # calls this rule allowed in any Turn of the agent
    GLOBAL = "global"  # calls to the same target allowed by any agent's policy


class PolicyError(ValueError):
    """A malformed ``<policy>``; ``line`` is the boot.xml line of the offending element."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line


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
    _checks: tuple[Callable[[str], bool], ...] = field(default=(), compare=False, repr=False)

    def holds(self, view: _View) -> bool:
        text = view.text(self.path)
        if text is None:
            # Absent: only a predicate that tests no value (and does not require it) holds.
            return not self.required and not self._checks
        for check in self._checks:
            if not check(text):
                return False
        return True

    def __post_init__(self) -> None:
        object.__setattr__(self, "_checks", tuple(self._compile()))

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


class _View:
    """A call's payload as the rules read it, each part computed once per evaluation."""

    __slots__ = ("_kids", "_texts", "local", "payload", "tag")

    def __init__(self, payload: etree._Element) -> None:
        self.payload = payload
        self.tag: str = payload.tag
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
            node = _child(node, step)
        if node is None:
            text = None
        elif len(node):
            text = "".join(node.itertext()).strip()
        else:
            text = (node.text or "").strip()
        self._texts[path] = text
        return text


def _child(node: etree._Element, local: str) -> etree._Element | None:
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
    _target_re: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        """How refusals and the step log name the rule: its id, else its priority."""
        return self.id if self.id else f"priority {self.priority}"

    @property
    def key(self) -> str:
        """Stable key of the rule for rate windows."""
        return self.id if self.id else f"#{self.priority}"

    def selects(self, target: str, view: _View) -> bool:
        """The conditions that depend only on the target and the root tag."""
        if self._target_re is not None and self._target_re.fullmatch(target) is None:
            return False
        if self.payload is not None:
            return self.payload == (view.tag if self.payload[0] == "{" else view.local)
        return True

    def matches(self, call: CallInfo) -> bool:
        view = _View(call.payload)
        if not self.selects(call.target, view):
            return False
        if self.min_step is not None and call.step < self.min_step:
            return False
        return all(a.holds(view) for a in self.args)


_CANDIDATE_CACHE_MAX = 4096


class _PathPlan:
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


class _Plan:
    """The candidate rules for one (target, root tag), compiled for :meth:`Policy.match`."""

    __slots__ = ("all", "free", "paths", "regexes", "rules", "steps")

    def __init__(self, rules: tuple[Rule, ...]) -> None:
        self.rules = rules
        self.all = (1 << len(rules)) - 1
        self.steps: list[tuple[int, int]] = []  # (bit, min_step)
        by_path: dict[tuple[str, ...], _PathPlan] = {}
        regexes: list[tuple[_PathPlan, int, Callable[[str], bool]]] = []
        for i, rule in enumerate(rules):
            bit = 1 << i
            if rule.min_step is not None:
                self.steps.append((bit, rule.min_step))
            for a in rule.args:
                pp = by_path.get(a.path)
                if pp is None:
                    pp = by_path[a.path] = _PathPlan(a.path)
                if a.required or a._checks:
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
                    pp.slow.append((bit, lambda t, n=needle: n in t))
                if a.max_length is not None:
                    limit = a.max_length
                    pp.slow.append((bit, lambda t, n=limit: len(t) <= n))
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
            text = _text(kids, path)
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


def _text(kids: dict[str, etree._Element], path: tuple[str, ...]) -> str | None:
    """The text of the child at ``path`` (the first of each local name), as _View reads it."""
    node = kids.get(path[0])
    for step in path[1:]:
        if node is None:
            return None
        node = _child(node, step)
    if node is None:
        return None
    if len(node):
        return "".join(node.itertext()).strip()
    return (node.text or "").strip()


@dataclass(frozen=True, slots=True)
class Policy:
    default: Decision
    rules: tuple[Rule, ...]  # sorted by priority
    # (target, root tag) → a plan of the rules whose target and payload conditions hold, in
    # order: a memo (peers times their root tags: few), so a call tries only the rules that
    # can match it, each condition kind at once for all of them.
    _candidates: dict[tuple[str, str], _Plan] = field(
        default_factory=dict, compare=False, repr=False
    )
    # Verdicts are immutable and depend only on the rule: built once, not per call.
    _verdicts: dict[int, tuple[Verdict, Verdict | None]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _default_verdict: Verdict | None = field(default=None, compare=False, repr=False)

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
        object.__setattr__(self, "_verdicts", verdicts)
        object.__setattr__(
            self,
            "_default_verdict",
            Verdict(
                self.default, None, f"the policy's default is {self.default} (no rule matched)"
            ),
        )

    def match(self, call: CallInfo) -> Rule | None:
        payload = call.payload
        key = (call.target, payload.tag)
        plan = self._candidates.get(key)
        if plan is None:
            view = _View(payload)
            plan = _Plan(tuple(r for r in self.rules if r.selects(call.target, view)))
            if len(self._candidates) >= _CANDIDATE_CACHE_MAX:
                self._candidates.clear()
            self._candidates[key] = plan
        return plan.first(payload, call.step)


@dataclass(frozen=True, slots=True)
class CallInfo:
    """One tool call as the policy sees it. ``step`` is the Turn's step count."""

    agent: str
    target: str
    payload: etree._Element
    step: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome for one call. ``rule`` is None when the default decided."""

    decision: Decision
    rule: Rule | None
    reason: str

    @property
    def rule_name(self) -> str:
        return self.rule.name if self.rule is not None else "default"


def evaluate(policy: Policy, call: CallInfo, window: Sequence[float], now: float) -> Verdict:
    """The decision for ``call``. ``window`` holds the times of the calls already counted
    against the matching rule's rate (ignored when it has none; see :func:`rate_key`)."""
    rule = policy.match(call)
    if rule is None:
        return policy._default_verdict  # type: ignore[return-value]
    verdict, limited = policy._verdicts[id(rule)]
    if limited is not None and not rule.rate.admits(window, now):  # type: ignore[union-attr]
        return limited
    return verdict


def rate_key(agent: str, rule: Rule, target: str, turn_id: str) -> str:
    """Which calls share ``rule``'s window (the store counts allowed calls by this key)."""
    assert rule.rate is not None
    scope = rule.rate.scope
    if scope == RateScope.GLOBAL:
        return f"global|{target}"
    if scope == RateScope.AGENT:
        return f"agent|{agent}|{rule.key}"
    return f"turn|{turn_id}|{rule.key}"


# -- boot.xml --------------------------------------------------------------------------


def parse_duration(raw: str) -> float:
    m = _DURATION.match(raw)
    if m is None:
        raise ValueError(f"{raw!r} is not a duration (e.g. 60s, 5m, 1h, 0.5)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_rate(raw: str, scope: RateScope) -> Rate:
    count, sep, window = raw.partition("/")
    if not sep or not count.strip().isdigit() or int(count) < 1:
        raise ValueError(f"rate={raw!r} is not COUNT/DURATION (e.g. 3/60s)")
    seconds = parse_duration(window)
    if seconds <= 0:
        raise ValueError(f"rate={raw!r}: the window must be longer than 0")
    return Rate(int(count), seconds, scope)


_ARG_ATTRS = {"path", "equals", "contains", "one-of", "regex", "min", "max", "max-length"}
_ARG_ATTRS |= {"required"}
_RULE_ATTRS = {"priority", "decision", "id", "target", "payload", "min-step", "rate"}
_RULE_ATTRS |= {"scope", "approver", "timeout"}


def parse_arg(el: etree._Element) -> ArgPredicate:
    line = el.sourceline or 0

    def fail(message: str) -> PolicyError:
        return PolicyError(line, f"<arg>: {message}")

    unknown = set(el.attrib) - _ARG_ATTRS
    if unknown:
        raise fail(f"unknown attribute {sorted(unknown)[0]!r}")
    path = (el.get("path") or "").strip()
    steps = tuple(path.split("/")) if path else ()
    if not steps or any(not re.fullmatch(r"[A-Za-z_][\w.\-]*", s) for s in steps):
        raise fail(f"path={path!r} is not a child path such as 'b' or 'config/mode'")
    regex = None
    if (raw := el.get("regex")) is not None:
        try:
            regex = re.compile(raw)
        except re.error as exc:
            raise fail(f"regex={raw!r} does not compile: {exc}") from None

    def number(attr: str) -> float | None:
        raw = el.get(attr)
        if raw is None:
            return None
        try:
            value = float(raw)
        except ValueError:
            raise fail(f"{attr}={raw!r} is not a number") from None
        if value != value:
            raise fail(f"{attr}={raw!r} is not a number")
        return value

    lo, hi = number("min"), number("max")
    if lo is not None and hi is not None and lo > hi:
        raise fail(f"min={lo:g} is greater than max={hi:g}")
    max_length = None
    if (raw := el.get("max-length")) is not None:
        if not raw.strip().isdigit():
            raise fail(f"max-length={raw!r} is not a non-negative integer")
        max_length = int(raw)
    one_of = None
    if (raw := el.get("one-of")) is not None:
        if not raw.split():
            raise fail("one-of is empty")
        one_of = frozenset(raw.split())
    required = el.get("required", "false")
    if required not in ("true", "false", "1", "0"):
        raise fail(f"required={required!r} is not true or false")
    return ArgPredicate(
        path=steps,
        equals=el.get("equals"),
        contains=el.get("contains"),
        one_of=one_of,
        regex=regex,
        min=lo,
        max=hi,
        max_length=max_length,
        required=required in ("true", "1"),
    )


def parse_rule(el: etree._Element) -> Rule:
    line = el.sourceline or 0

    def fail(message: str) -> PolicyError:
        return PolicyError(line, f"<rule>: {message}")

    unknown = set(el.attrib) - _RULE_ATTRS
    if unknown:
        raise fail(f"unknown attribute {sorted(unknown)[0]!r}")
    raw_priority = el.get("priority")
    if raw_priority is None:
        raise fail("priority is required")
    try:
        priority = int(raw_priority)
    except ValueError:
        raise fail(f"priority={raw_priority!r} is not an integer") from None
    raw_decision = el.get("decision")
    try:
        decision = Decision(raw_decision or "")
    except ValueError:
        raise fail(f"unknown decision {raw_decision!r} (allow, deny or require-approval)") from None
    min_step = None
    if (raw := el.get("min-step")) is not None:
        if not raw.strip().isdigit():
            raise fail(f"min-step={raw!r} is not a non-negative integer")
        min_step = int(raw)
    raw_scope = el.get("scope")
    try:
        scope = RateScope(raw_scope or "turn")
    except ValueError:
        raise fail(f"unknown scope {raw_scope!r} (turn, agent or global)") from None
    rate = None
    if (raw := el.get("rate")) is not None:
        if decision != Decision.ALLOW:
            raise fail(f"rate= applies to an allowing rule, not to decision={decision}")
        try:
            rate = parse_rate(raw, scope)
        except ValueError as exc:
            raise fail(str(exc)) from None
    elif raw_scope is not None:
        raise fail("scope= needs rate=")
    approver = el.get("approver")
    timeout = DEFAULT_APPROVAL_TIMEOUT_S
    if decision == Decision.REQUIRE_APPROVAL:
        if not approver:
            raise fail("decision=require-approval needs approver= (a client or a listener)")
        if (raw := el.get("timeout")) is not None:
            try:
                timeout = parse_duration(raw)
            except ValueError as exc:
                raise fail(f"timeout: {exc}") from None
            if timeout <= 0:
                raise fail("timeout must be longer than 0")
    elif approver is not None or el.get("timeout") is not None:
        raise fail("approver= and timeout= apply to decision=require-approval only")
    target = el.get("target")
    payload = el.get("payload")
    if payload is not None and not re.fullmatch(r"(\{[^{}]+\})?[A-Za-z_][\w.\-]*", payload):
        raise fail(f"payload={payload!r} is not a root tag ('{{ns}}tag' or 'tag')")
    args = tuple(parse_arg(a) for a in el.iterfind(_B + "arg"))
    return Rule(
        priority=priority,
        decision=decision,
        id=el.get("id") or None,
        target=target,
        payload=payload,
        min_step=min_step,
        args=args,
        rate=rate,
        approver=approver,
        timeout_s=timeout,
        line=line,
        _target_re=re.compile(fnmatch.translate(target)) if target else None,
    )


def parse_policy(el: etree._Element) -> Policy:
    """A :class:`Policy` from a ``<policy>`` element; raises :class:`PolicyError` with the
    line of the first problem. :func:`policy_problems` lists them all."""
    problems = policy_problems(el)
    if problems:
        raise problems[0]
    return _build(el)


def policy_problems(el: etree._Element) -> list[PolicyError]:
    """Every problem of a ``<policy>`` element, in file order (empty: it is valid)."""
    problems: list[PolicyError] = []
    raw_default = el.get("default", "deny")
    if raw_default not in (Decision.ALLOW, Decision.DENY):
        problems.append(
            PolicyError(el.sourceline or 0, f"<policy>: default={raw_default!r} (allow or deny)")
        )
    seen: dict[int, int] = {}
    ids: dict[str, int] = {}
    for rel in el.iterfind(_B + "rule"):
        try:
            rule = parse_rule(rel)
        except PolicyError as exc:
            problems.append(exc)
            continue
        if rule.priority in seen:
            problems.append(
                PolicyError(
                    rule.line,
                    f"<rule>: priority {rule.priority} is already used by the rule on line "
                    f"{seen[rule.priority]}",
                )
            )
        seen.setdefault(rule.priority, rule.line)
        if rule.id is not None:
            if rule.id in ids:
                problems.append(
                    PolicyError(
                        rule.line, f"<rule>: id {rule.id!r} is already used on line {ids[rule.id]}"
                    )
                )
            ids.setdefault(rule.id, rule.line)
    return problems


def _build(el: etree._Element) -> Policy:
    rules = sorted((parse_rule(r) for r in el.iterfind(_B + "rule")), key=lambda r: r.priority)
    return Policy(Decision(el.get("default", "deny")), tuple(rules))


def approvers(policy: Policy) -> tuple[str, ...]:
    """Every approver the policy names (for the topology check)."""
    return tuple(dict.fromkeys(r.approver for r in policy.rules if r.approver))
