"""Tool-call policy: boot.xml's ``<policy>`` as data, and its evaluation (pure, no I/O).

A policy is a default decision and rules ordered by ``priority`` (lowest first; the first
rule whose conditions all hold decides). Conditions: the target listener (a glob), the
payload's root tag (``{ns}tag`` or a bare local name), the Turn's step count (``min-step``)
and argument predicates on the payload's child elements (``<arg path=...>``). An allowing
rule may carry a sliding-window rate limit; the caller supplies the times of the calls the
window already holds (the store keeps them), so time is an argument, never read here.

The peers list is checked before the policy (by the parser and the pump): a policy can
only narrow what an agent may call, never widen it.

The parts: :mod:`~agentserver.agents.policy.rules` (the rules as data),
:mod:`~agentserver.agents.policy.match` (a policy compiled for matching),
:mod:`~agentserver.agents.policy.parse` (boot.xml's ``<policy>``); this module evaluates a
call against a policy and re-exports the names callers use.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentserver import _moved
from agentserver.agents.policy.match import Policy, Verdict
from agentserver.agents.policy.parse import (
    PolicyError,
    parse_arg,
    parse_duration,
    parse_policy,
    parse_rate,
    parse_rule,
    policy_problems,
)
from agentserver.agents.policy.rules import (
    DEFAULT_APPROVAL_TIMEOUT_S,
    ArgPredicate,
    CallInfo,
    Decision,
    Rate,
    RateScope,
    Rule,
)

__all__ = [
    "DEFAULT_APPROVAL_TIMEOUT_S",
    "ArgPredicate",
    "CallInfo",
    "Decision",
    "Policy",
    "PolicyError",
    "Rate",
    "RateScope",
    "Rule",
    "Verdict",
    "approvers",
    "evaluate",
    "parse_arg",
    "parse_duration",
    "parse_policy",
    "parse_rate",
    "parse_rule",
    "policy_problems",
    "rate_key",
]


def evaluate(policy: Policy, call: CallInfo, window: Sequence[float], now: float) -> Verdict:
    """The decision for ``call``. ``window`` holds the times of the calls already counted
    against the matching rule's rate (ignored when it has none; see :func:`rate_key`)."""
    rule = policy.match(call)
    if rule is None:
        return policy.default_verdict
    verdict, limited = policy.verdicts[id(rule)]
    # limited is set only for a rule with a rate.
    if limited is not None and rule.rate is not None and not rule.rate.admits(window, now):
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


def approvers(policy: Policy) -> tuple[str, ...]:
    """Every approver the policy names (for the topology check)."""
    return tuple(dict.fromkeys(r.approver for r in policy.rules if r.approver))


# Before the agents' floors, ``agentserver.agents.policy`` was a module and ``evaluate``
# its function (docs/api.md published both); that path is now this package, so ``from
# agentserver.agents.policy import evaluate`` finds this module. Calling it still
# evaluates, with a DeprecationWarning, until the old paths go (agentserver/_moved.py).
_moved.calls_its_function(__name__, evaluate, "agents.policy.evaluate")
