"""An agent listener's ``<policy>`` and ``<guardrail>`` elements, read and checked."""

from __future__ import annotations

from lxml import etree

from agentserver.agents.policy.evaluate import Policy, parse_policy, policy_problems
from agentserver.agents.policy.guardrails import GuardrailSpec
from agentserver.config.imports import B, Unresolved, resolve_import
from agentserver.config.problems import Report
from agentserver.config.topology import ClientSpec, ListenerSpec

Governance = tuple[Policy | None, tuple[GuardrailSpec, ...]]


def read_governance(
    report: Report, el: etree._Element, name: str, agent: bool
) -> Governance | None:
    """Listener ``el``'s policy and guardrails (None: errors were reported)."""
    policy_el = el.find(B + "policy")
    guard_els = list(el.iterfind(B + "guardrail"))
    ok = True
    for extra in (policy_el, *guard_els):
        if extra is not None and not agent:
            report.error(
                extra.sourceline,
                f'listener {name!r}: <{etree.QName(extra).localname}> needs agent="true"',
            )
            ok = False
    policy = None
    if policy_el is not None:
        problems = policy_problems(policy_el)
        for problem in problems:
            report.error(problem.line, f"listener {name!r}: {problem}")
        if problems:
            ok = False
        else:
            policy = parse_policy(policy_el)
    guards = []
    for gel in guard_els:
        ref = gel.get("handler", "")
        try:
            if ":" not in ref:
                raise Unresolved(f"guardrail handler {ref!r} is not module:function")
            handler = resolve_import(ref)
            if not callable(handler):
                raise Unresolved(f"guardrail handler {ref!r} is not callable")
        except Unresolved as exc:
            report.error(gel.sourceline, f"listener {name!r}: {exc}")
            ok = False
            continue
        guards.append(GuardrailSpec(gel.get("when", "before"), ref, handler))
    return (policy, tuple(guards)) if ok else None


def check_approvers(report: Report, specs: list[ListenerSpec], clients: list[ClientSpec]) -> None:
    """A policy rule's approver is a declared client, or a listener among the agent's peers."""
    client_names = {c.name for c in clients}
    known = {s.name for s in specs} | client_names
    for spec in specs:
        if spec.agent_policy is None:
            continue
        for rule in spec.agent_policy.rules:
            if rule.approver and rule.approver not in known:
                report.error(
                    rule.line,
                    f"listener {spec.name!r}: <rule> approver {rule.approver!r} is "
                    "neither a declared client nor a listener",
                )
            elif (
                rule.approver
                and rule.approver not in client_names
                and rule.approver not in spec.peers
            ):
                report.error(
                    rule.line,
                    f"listener {spec.name!r}: <rule> approver {rule.approver!r} is a "
                    "listener, so it must be among the agent's peers",
                )
