"""The compiled policy evaluator agrees with a straightforward reading of the rules.

``Policy.match`` compiles the candidate rules into bit masks and tests each kind of
condition once for all of them; this reference walks the rules in priority order and
checks every condition of each, as the docs describe them, on random rules and payloads.
"""

from __future__ import annotations

import fnmatch
import re

from hypothesis import given, settings
from hypothesis import strategies as st
from lxml import etree

from agentserver.agents.policy.evaluate import CallInfo, Decision, evaluate, parse_policy
from agentserver.core.namespaces import BOOT_NS

NAMESPACES = [None, "urn:agentserver:calculator", "urn:other"]
LOCALS = ["add", "divide", "op"]
TARGETS = ["calculator", "calc2", "shell", "tool1-x"]
GLOBS = ["calc*", "calculator", "*", "tool?-*", "shell", "c[a-b]lc2"]
PATHS = ["a", "b", "c", "a/x"]
VALUES = ["0", "1", "12", "-3", "a", "b", "", "1.5", "nan", "x", "1e3", "ab"]
REGEXES = ["[0-9]+", "1.*", "a|b", "x?", "-?[0-9]+(\\.[0-9]+)?"]

arg_attrs = st.fixed_dictionaries(
    {"path": st.sampled_from(PATHS)},
    optional={
        "equals": st.sampled_from(VALUES),
        "contains": st.sampled_from(["1", "a", "", "b"]),
        "one-of": st.lists(st.sampled_from([v for v in VALUES if v]), min_size=1).map(" ".join),
        "regex": st.sampled_from(REGEXES),
        "min": st.sampled_from(["-5", "0", "1", "2.5"]),
        "max": st.sampled_from(["10", "12", "1000"]),
        "max-length": st.sampled_from(["0", "1", "2"]),
        "required": st.sampled_from(["true", "false"]),
    },
)
rule_attrs = st.fixed_dictionaries(
    {"decision": st.sampled_from(["allow", "deny", "require-approval"])},
    optional={
        "target": st.sampled_from(GLOBS),
        "payload": st.tuples(st.sampled_from(NAMESPACES), st.sampled_from(LOCALS)).map(
            lambda t: f"{{{t[0]}}}{t[1]}" if t[0] else t[1]
        ),
        "min-step": st.sampled_from(["0", "2", "4"]),
        "rate": st.sampled_from(["1/10s", "3/60s"]),
    },
)
rules_st = st.lists(st.tuples(rule_attrs, st.lists(arg_attrs, max_size=3)), max_size=12)
payload_st = st.fixed_dictionaries(
    {"ns": st.sampled_from(NAMESPACES), "local": st.sampled_from(LOCALS)},
    optional={
        "a": st.sampled_from(VALUES),
        "ax": st.sampled_from(VALUES),
        "b": st.sampled_from(VALUES),
        "b2": st.sampled_from(VALUES),
        "c": st.sampled_from(VALUES),
    },
)


def build(rules, priorities, default):
    root = etree.Element(f"{{{BOOT_NS}}}policy", nsmap={None: BOOT_NS})
    root.set("default", default)
    for (attrs, args), priority in zip(rules, priorities, strict=False):
        el = etree.SubElement(root, f"{{{BOOT_NS}}}rule")
        el.set("priority", str(priority))
        for k, v in attrs.items():
            if k == "rate" and attrs["decision"] != "allow":
                continue
            el.set(k, v)
        if attrs["decision"] == "require-approval":
            el.set("approver", "ops")
        for a in args:
            if "min" in a and "max" in a and float(a["min"]) > float(a["max"]):
                a = {k: v for k, v in a.items() if k != "min"}
            etree.SubElement(el, f"{{{BOOT_NS}}}arg", a)
    return root


def make_payload(p):
    tag = f"{{{p['ns']}}}{p['local']}" if p["ns"] else p["local"]
    root = etree.Element(tag)
    child_ns = f"{{{p['ns']}}}" if p["ns"] else ""
    if "a" in p or "ax" in p:
        a = etree.SubElement(root, child_ns + "a")
        a.text = p.get("a", "")
        if "ax" in p:
            etree.SubElement(a, child_ns + "x").text = p["ax"]
    if "b" in p:
        etree.SubElement(root, child_ns + "b").text = f"  {p['b']} "
    if "b2" in p:  # a second <b>: the first one counts
        etree.SubElement(root, child_ns + "b").text = p["b2"]
    if "c" in p:
        etree.SubElement(root, "c").text = p["c"]  # no namespace: local names count
    return root


def ref_text(payload, path):
    node = payload
    for step in path.split("/"):
        found = [c for c in node if isinstance(c.tag, str) and etree.QName(c).localname == step]
        if not found:
            return None
        node = found[0]
    return "".join(node.itertext()).strip()


def ref_arg_holds(a, payload):
    text = ref_text(payload, a["path"])
    tests = set(a) - {"path", "required"}
    if text is None:
        return a.get("required") != "true" and not tests
    if "equals" in a and text != a["equals"]:
        return False
    if "contains" in a and a["contains"] not in text:
        return False
    if "one-of" in a and text not in a["one-of"].split():
        return False
    if "regex" in a and re.fullmatch(a["regex"], text) is None:
        return False
    if "max-length" in a and len(text) > int(a["max-length"]):
        return False
    if "min" in a or "max" in a:
        try:
            value = float(text)
        except ValueError:
            return False
        if "min" in a and not value >= float(a["min"]):
            return False
        if "max" in a and not value <= float(a["max"]):
            return False
    return True


def ref_match(rules, priorities, target, payload, step):
    tag = payload.tag
    local = etree.QName(payload).localname
    for priority, (attrs, args) in sorted(zip(priorities, rules, strict=False)):
        if "target" in attrs and not fnmatch.fnmatchcase(target, attrs["target"]):
            continue
        if "payload" in attrs:
            want = attrs["payload"]
            if want != (tag if want.startswith("{") else local):
                continue
        if "min-step" in attrs and step < int(attrs["min-step"]):
            continue
        fixed = []
        for a in args:
            if "min" in a and "max" in a and float(a["min"]) > float(a["max"]):
                a = {k: v for k, v in a.items() if k != "min"}
            fixed.append(a)
        if all(ref_arg_holds(a, payload) for a in fixed):
            return priority, attrs
    return None


@settings(max_examples=400, deadline=None)
@given(
    rules=rules_st,
    data=st.data(),
    default=st.sampled_from(["allow", "deny"]),
    calls=st.lists(st.tuples(st.sampled_from(TARGETS), payload_st, st.integers(0, 5)), min_size=1),
    window=st.lists(st.integers(0, 100), max_size=4).map(lambda ts: sorted(map(float, ts))),
)
def test_compiled_evaluator_agrees_with_a_reference_reading(rules, data, default, calls, window):
    priorities = data.draw(
        st.lists(st.integers(-50, 50), min_size=len(rules), max_size=len(rules), unique=True)
    )
    policy = parse_policy(build(rules, priorities, default))
    now = 100.0
    # Several calls per policy: the per-(target, tag) plans are memoised across calls.
    for target, p, step in calls:
        payload = make_payload(p)
        verdict = evaluate(policy, CallInfo("agent", target, payload, step), window, now)
        expected = ref_match(rules, priorities, target, payload, step)
        if expected is None:
            assert verdict.rule is None and verdict.decision == Decision(default)
            continue
        priority, attrs = expected
        assert verdict.rule is not None and verdict.rule.priority == priority
        decision = Decision(attrs["decision"])
        if decision == Decision.ALLOW and "rate" in attrs:
            limit, _, span = attrs["rate"].partition("/")
            inside = [t for t in window if t > now - float(span.rstrip("s"))]
            if len(inside) >= int(limit):
                decision = Decision.DENY
        assert verdict.decision == decision


def test_several_equality_predicates_on_one_path_all_hold():
    # Two <arg>s of one rule on the same path narrow each other (the compiled plan merges
    # them into one value → rules map, which must not let either one be skipped).
    rules = [
        ({"decision": "allow"}, [{"path": "b", "one-of": "1 2"}, {"path": "b", "equals": "2"}]),
        ({"decision": "deny"}, [{"path": "b", "equals": "1"}, {"path": "b", "one-of": "2 3"}]),
    ]
    policy = parse_policy(build(rules, [1, 2], "deny"))
    for value, rule in [("1", None), ("2", 1), ("3", None)]:
        payload = make_payload({"ns": None, "local": "add", "b": value})
        verdict = evaluate(policy, CallInfo("agent", "calc", payload, 0), [], 0.0)
        assert ref_match(rules, [1, 2], "calc", payload, 0) == (
            None if rule is None else (rule, rules[rule - 1][0])
        )
        assert (verdict.rule.priority if verdict.rule else None) == rule
