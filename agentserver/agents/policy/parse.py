"""boot.xml's ``<policy>`` parsed into a :class:`~agentserver.agents.policy.match.Policy`,
with every problem reported by line (:func:`policy_problems`)."""

from __future__ import annotations

import fnmatch
import re

from lxml import etree

from agentserver.agents.policy.match import Policy
from agentserver.agents.policy.rules import (
    DEFAULT_APPROVAL_TIMEOUT_S,
    ArgPredicate,
    Decision,
    Rate,
    RateScope,
    Rule,
)
from agentserver.core.durations import parse_duration as core_duration
from agentserver.core.namespaces import BOOT_NS

_B = f"{{{BOOT_NS}}}"


class PolicyError(ValueError):
    """A malformed ``<policy>``; ``line`` is the boot.xml line of the offending element."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line


def parse_duration(raw: str) -> float:
    """boot.xml's one duration syntax (:mod:`agentserver.core.durations`)."""
    return core_duration(raw)


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
        target_re=re.compile(fnmatch.translate(target)) if target else None,
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
