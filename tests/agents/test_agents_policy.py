"""The tool-call policy: pure evaluation, rate windows on a MockClock, and boot.xml checks."""

from __future__ import annotations

import textwrap

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from lxml import etree

from agentserver.agents.policy.evaluate import (
    CallInfo,
    Decision,
    evaluate,
    parse_policy,
    policy_problems,
)
from agentserver.config import loader as boot

NS = "https://xml-pipeline.org/ns/boot/v1"
CALC = "urn:agentserver:calculator"


def policy(body: str, default: str = "deny"):
    el = etree.fromstring(f'<policy xmlns="{NS}" default="{default}">{body}</policy>')
    return parse_policy(el)


def call(xml: str, target: str = "calculator", step: int = 0) -> CallInfo:
    return CallInfo("assistant", target, etree.fromstring(xml), step)


def divide(a: str, b: str) -> CallInfo:
    return call(f'<divide xmlns="{CALC}"><a>{a}</a><b>{b}</b></divide>')


def add(a: str = "1", b: str = "2") -> CallInfo:
    return call(f'<add xmlns="{CALC}"><a>{a}</a><b>{b}</b></add>')


def test_default_deny_and_default_allow():
    assert evaluate(policy(""), add(), [], 0).decision == Decision.DENY
    verdict = evaluate(policy("", "allow"), add(), [], 0)
    assert verdict.decision == Decision.ALLOW and verdict.rule is None


def test_divide_by_zero_is_denied_while_other_calls_are_allowed():
    p = policy(
        '<rule priority="1" id="no-div-zero" decision="deny" payload="divide">'
        '<arg path="b" equals="0"/></rule>'
        '<rule priority="2" decision="allow" target="calc*"/>'
    )
    denied = evaluate(p, divide("4", "0"), [], 0)
    assert denied.decision == Decision.DENY and denied.rule_name == "no-div-zero"
    assert evaluate(p, divide("4", "2"), [], 0).decision == Decision.ALLOW
    assert evaluate(p, add(), [], 0).decision == Decision.ALLOW
    assert evaluate(p, add(), [], 0).rule_name == "priority 2"


@pytest.mark.parametrize("first", ["allow", "deny"])
def test_priority_orders_overlapping_rules_both_ways(first):
    second = "deny" if first == "allow" else "allow"
    # Written in the opposite order of their priorities: the file order does not matter.
    p = policy(
        f'<rule priority="20" decision="{second}" target="calculator"/>'
        f'<rule priority="10" decision="{first}" payload="{{{CALC}}}add"/>'
    )
    assert evaluate(p, add(), [], 0).decision == Decision(first)
    assert evaluate(p, divide("1", "1"), [], 0).decision == Decision(second)


def test_argument_predicates():
    p = policy(
        '<rule priority="1" decision="allow">'
        '<arg path="a" one-of="1 2 3"/><arg path="b" min="0" max="10"/>'
        '<arg path="a" regex="[0-9]+"/><arg path="b" max-length="2"/>'
        "</rule>"
    )
    assert evaluate(p, add("2", "10"), [], 0).decision == Decision.ALLOW
    for a, b in [("4", "1"), ("1", "11"), ("1", "-1"), ("1", "x"), ("1", "nan"), ("1", "1.5")]:
        assert evaluate(p, add(a, b), [], 0).decision == Decision.DENY, (a, b)
    contains = policy(
        '<rule priority="1" decision="allow"><arg path="cmd" contains="ls"/>'
        '<arg path="opt/mode" required="true"/></rule>'
    )
    ok = call("<run><cmd>ls -l</cmd><opt><mode>x</mode></opt></run>", "shell")
    no_mode = call("<run><cmd>ls -l</cmd></run>", "shell")
    assert evaluate(contains, ok, [], 0).decision == Decision.ALLOW
    assert evaluate(contains, no_mode, [], 0).decision == Decision.DENY


def test_min_step_and_glob_target():
    p = policy('<rule priority="1" decision="allow" target="calc?lator" min-step="2"/>')
    assert evaluate(p, call("<x/>", "calculator", step=1), [], 0).decision == Decision.DENY
    assert evaluate(p, call("<x/>", "calculator", step=2), [], 0).decision == Decision.ALLOW
    assert evaluate(p, call("<x/>", "calculators", step=2), [], 0).decision == Decision.DENY


async def test_rate_window_on_a_mock_clock(autojump_clock):
    """The 4th call inside a 3-per-60 s window is refused; after the window it is allowed.
    (pytest-trio runs the test on the ``autojump_clock`` fixture's clock: the minute
    passes at once. A ``MockClock`` merely made in the test is not the run's clock.)"""
    p = policy('<rule priority="1" id="three" decision="allow" rate="3/60s"/>')
    allowed: list[float] = []

    def attempt() -> Decision:
        now = trio.current_time()
        verdict = evaluate(p, add(), allowed, now)
        if verdict.decision == Decision.ALLOW:
            allowed.append(now)
        return verdict.decision

    start = trio.current_time()
    for _ in range(3):
        assert attempt() == Decision.ALLOW
        await trio.sleep(10)
    verdict = evaluate(p, add(), allowed, trio.current_time())
    assert verdict.decision == Decision.DENY and "three" in verdict.reason
    assert "rate limit" in verdict.reason
    await trio.sleep_until(start + 60.5)  # the first call left the window
    assert attempt() == Decision.ALLOW
    assert attempt() == Decision.DENY


@given(st.lists(st.floats(0, 1000), max_size=20), st.floats(0, 2000))
def test_rate_admits_counts_only_the_window(times, now):
    p = policy('<rule priority="1" decision="allow" rate="3/60s"/>')
    times = sorted(times)  # the store hands the window over in time order
    inside = sum(1 for t in times if now - 60 < t)
    expected = Decision.ALLOW if inside < 3 else Decision.DENY
    assert evaluate(p, add(), times, now).decision == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('<rule priority="1" decision="maybe"/>', "unknown decision 'maybe'"),
        ('<rule priority="1" decision="allow"/><rule priority="1" decision="deny"/>', "priority 1"),
        ('<rule priority="1" decision="allow"><arg path="b" regex="(("/></rule>', "regex="),
        ('<rule priority="1" decision="allow"><arg path="" equals="1"/></rule>', "path=''"),
        ('<rule priority="1" decision="allow"><arg path="b" min="x"/></rule>', "min='x'"),
        ('<rule priority="1" decision="allow"><arg path="b" min="3" max="1"/></rule>', "min=3"),
        ('<rule priority="1" decision="allow" rate="3 per minute"/>', "rate="),
        ('<rule priority="1" decision="deny" rate="3/60s"/>', "allowing rule"),
        ('<rule priority="1" decision="allow" rate="3/60s" scope="world"/>', "scope 'world'"),
        ('<rule priority="1" decision="require-approval"/>', "approver="),
        ('<rule priority="1" decision="allow" payload="a b"/>', "payload="),
    ],
)
def test_malformed_policies_are_rejected_with_their_line(body, message):
    el = etree.fromstring(f'<policy xmlns="{NS}">\n{body}\n</policy>')
    problems = policy_problems(el)
    assert problems and message in str(problems[-1]) and problems[-1].line == 2


def write(tmp_path, body: str):
    path = tmp_path / "boot.xml"
    path.write_text(f'<organism xmlns="{NS}" name="t">\n' + textwrap.dedent(body) + "</organism>\n")
    return path


AGENT = """\
<listeners>
  <listener name="calculator" handler="calculator"/>
  <listener name="assistant" handler="assistant" agent="true" peers="calculator">
    <agent model="m"/>
    <policy default="deny">
{rules}
    </policy>
{guards}
  </listener>
</listeners>
"""


def load(tmp_path, rules: str, guards: str = ""):
    path = write(tmp_path, AGENT.format(rules=rules, guards=guards))
    return path, boot.load(path, environ={})


def test_check_reports_each_malformed_policy_case_with_file_and_line(tmp_path):
    rules = "\n".join(
        [
            '<rule priority="1" decision="allow"/>',
            '<rule priority="1" decision="deny"/>',
            '<rule priority="2" decision="perhaps"/>',
            '<rule priority="3" decision="allow"><arg path="b" regex="[0-9"/></rule>',
            '<rule priority="4" decision="allow"><arg path="b" max="ten"/></rule>',
        ]
    )
    path, result = load(tmp_path, rules)
    assert not result.ok
    got = [str(p) for p in result.errors]
    assert got[0].startswith(f"{path}:8: ") and "priority 1 is already used" in got[0]
    assert got[1].startswith(f"{path}:9: ") and "unknown decision 'perhaps'" in got[1]
    assert got[2].startswith(f"{path}:10: ") and "regex='[0-9'" in got[2]
    assert got[3].startswith(f"{path}:11: ") and "max='ten'" in got[3]
    assert len(got) == 4


def test_check_reports_an_unknown_approver(tmp_path):
    rules = '<rule priority="5" decision="require-approval" approver="nobody"/>'
    path, result = load(tmp_path, rules)
    assert [str(p) for p in result.errors] == [
        f"{path}:7: listener 'assistant': <rule> approver 'nobody' is neither a declared "
        "client nor a listener"
    ]


def test_a_valid_policy_and_guardrails_are_handed_to_the_topology(tmp_path):
    rules = '<rule priority="1" id="no-div" decision="deny" payload="divide"/>'
    guards = (
        '<guardrail when="before" handler="agentserver.agents.policy.guardrails:loop_verdict"/>'
    )
    _, result = load(tmp_path, rules, guards)
    assert result.ok, [str(p) for p in result.problems]
    spec = result.topology.listener("assistant")
    assert spec.agent_policy.rules[0].name == "no-div"
    assert spec.agent_guardrails[0].when == "before"


def test_an_unresolvable_guardrail_and_a_policy_on_a_plain_listener_are_errors(tmp_path):
    path = write(
        tmp_path,
        """\
        <listeners>
          <listener name="calculator" handler="calculator">
            <policy/>
          </listener>
          <listener name="assistant" handler="assistant" agent="true" peers="calculator">
            <guardrail when="after" handler="no.such.module:check"/>
          </listener>
        </listeners>
        """,
    )
    result = boot.load(path, environ={})
    got = [str(p) for p in result.errors]
    assert got[0].startswith(f"{path}:4: ") and "needs agent" in got[0]
    assert got[1].startswith(f"{path}:7: ") and "no.such.module" in got[1]
