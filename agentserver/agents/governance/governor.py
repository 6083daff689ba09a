"""Governance of an agent's tool calls, applied by the worker before anything is sent.

For each call of a step, in order: the policy (:mod:`agentserver.agents.policy.evaluate`, with
its rate windows counted from the store), the built-in loop detector and the ``before``
guardrails (:mod:`agentserver.agents.policy.guardrails`). A refused call never reaches the pump:
the model gets one ``tool.refused`` card naming the rule, the step log records every
decision, and the Turn goes on. ``after`` guardrails run on each tool result once, when
the Turn resumes; their verdicts are cards too. Everything a guardrail may want to know
is read back from the Turn's stored cards, so the worker keeps no state between steps
and a restarted server decides exactly as the old one would have.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lxml import etree

from agentserver.agents.clock import Clock
from agentserver.agents.governance.approvals import PendingApproval
from agentserver.agents.policy.evaluate import CallInfo, Decision, Rule, evaluate, rate_key
from agentserver.agents.policy.guardrails import (
    AFTER,
    BEFORE,
    Block,
    GuardCall,
    GuardrailRunner,
    Halt,
    PastCall,
    Warn,
    canonical,
    combine,
    loop_verdict,
)
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.reading.parsing import FoundPayload
from agentserver.agents.store.base import Card, CardType, NewCard, StoreCalls, TurnToken
from agentserver.agents.store.governance import DecisionRecord, StepRecord
from agentserver.agents.store.sql import governance

log = logging.getLogger(__name__)

LOOP_RULE = "loop-block"
LOOP_WARN = "loop-warn"


@dataclass(frozen=True, slots=True)
class Approved:
    """A call that may be sent; ``metadata`` goes on its tool.call card (warnings)."""

    call: FoundPayload
    metadata: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NeedsApproval:
    call: FoundPayload
    rule: Rule
    request_id: str


@dataclass(slots=True)
class Screened:
    """The step's calls after governance. ``halt``: end the Turn failed with this text."""

    send: list[Approved] = field(default_factory=list)
    approvals: list[NeedsApproval] = field(default_factory=list)
    halt: str | None = None
    #: What screening decided, as the store writes it (already written unless
    #: ``screen(record=False)``).
    record: StepRecord = field(default_factory=StepRecord)


def past_calls(cards: Sequence[Card]) -> tuple[PastCall, ...]:
    """Every call the Turn attempted so far (sent or refused), from its cards."""
    out = []
    for card in cards:
        if card.card_type == CardType.TOOL_CALL:
            out.append(PastCall(str(card.metadata.get("to", "")), canonical(card.content)))
        elif card.card_type == CardType.TOOL_REFUSED:
            out.append(
                PastCall(str(card.metadata.get("to", "")), str(card.metadata.get("payload", "")))
            )
    return tuple(out)


def refusal_card(to: str, canon: str, rule: str, decision: str, text: str) -> NewCard:
    return NewCard(
        CardType.TOOL_REFUSED,
        text,
        {"to": to, "payload": canon, "rule": rule, "decision": decision},
    )


def thread_of(token: TurnToken) -> str:
    """The task's thread as the approver is told it (the Turn's id names it durably)."""
    return token.agent_turn_id


def governed(profile: AgentProfile) -> bool:
    """Whether governance screens the agent's tool calls (:meth:`Governor.screen`)."""
    return bool(
        profile.policy is not None or profile.guardrails or profile.loop_warn or profile.loop_block
    )


def _tag(call: FoundPayload) -> str:
    return str(call.element.tag)


class Governor:
    """Applies an agent's policy and guardrails for the worker (one per worker)."""

    def __init__(self, store: StoreCalls, clock: Clock) -> None:
        self.store = store
        self.clock = clock
        self.guards = GuardrailRunner()

    async def screen(
        self,
        token: TurnToken,
        step_id: str,
        step_no: int,
        profile: AgentProfile,
        cards: Sequence[Card],
        calls: Sequence[FoundPayload],
        *,
        record: bool = True,
    ) -> Screened:
        """Decide every call of one step, and record the decisions and refusals (with
        ``record=False``, the caller writes ``Screened.record`` with the step).

        The Turn's one way in is ``ToolDispatch.screen`` (agents/turn/tool_dispatch.py),
        which decides whether the agent is governed and reads the cards when needed."""
        out = Screened()
        history = list(past_calls(cards))
        decisions: list[DecisionRecord] = []
        refusals: list[NewCard] = []
        pending: list[PendingApproval] = []
        now = self.clock.now()
        batch: dict[str, list[float]] = {}  # rate windows grown by earlier calls of this step

        def refuse(call: FoundPayload, canon: str, decision: str, rule: str, text: str) -> None:
            to = call.to or ""
            decisions.append(DecisionRecord(to, _tag(call), decision, rule, text))
            refusals.append(refusal_card(to, canon, rule, decision, text))

        for call in calls:
            to = call.to or ""
            canon = canonical(call.element)
            key: str | None = None
            rule_name = "peers"
            approval: Rule | None = None
            if profile.policy is not None:
                info = CallInfo(token.agent_id, to, call.element, step_no)
                rule = profile.policy.match(info)
                window: list[float] = []
                if rule is not None and rule.rate is not None and rule.decision == "allow":
                    key = rate_key(token.agent_id, rule, to, token.agent_turn_id)
                    window = await self.store.read(
                        governance.rate_window, key, now - rule.rate.window_s
                    )
                    window += batch.get(key, [])
                verdict = evaluate(profile.policy, info, window, now)
                rule_name = verdict.rule_name
                if verdict.decision == Decision.DENY:
                    refuse(
                        call,
                        canon,
                        "deny",
                        rule_name,
                        f"refused by the policy ({verdict.reason}); it was not sent",
                    )
                    history.append(PastCall(to, canon))
                    continue
                if verdict.decision == Decision.REQUIRE_APPROVAL:
                    approval = verdict.rule
                if key is not None and verdict.decision == Decision.ALLOW:
                    batch.setdefault(key, []).append(now)
                else:
                    key = None
            loop = loop_verdict(to, canon, history, profile.loop_warn, profile.loop_block)
            guard_call = GuardCall(
                BEFORE,
                token.agent_id,
                token.agent_turn_id,
                step_no,
                to,
                etree.tostring(call.element, encoding="unicode"),
                tuple(history),
            )
            history.append(PastCall(to, canon))
            if isinstance(loop, Block):
                refuse(call, canon, "blocked", LOOP_RULE, loop.text)
                continue
            verdict_g = combine(await self.guards.run(profile.guardrails, guard_call))
            if isinstance(verdict_g, Halt):
                decisions.append(
                    DecisionRecord(to, _tag(call), "halted", "guardrail", verdict_g.text)
                )
                out.halt = verdict_g.text
                break
            if isinstance(verdict_g, Block):
                refuse(call, canon, "blocked", "guardrail", f"blocked: {verdict_g.text}")
                continue
            warnings = [w.text for w in verdict_g]
            if isinstance(loop, Warn):
                warnings.insert(0, loop.text)
            if approval is not None:
                request_id = uuid.uuid4().hex
                decisions.append(
                    DecisionRecord(to, _tag(call), "require-approval", rule_name, request_id)
                )
                out.approvals.append(NeedsApproval(call, approval, request_id))
                pending.append(
                    PendingApproval(
                        request_id,
                        token.agent_id,
                        token.agent_turn_id,
                        to,
                        etree.tostring(call.element, encoding="unicode"),
                        rule_name,
                        approval.approver or "",
                        now + approval.timeout_s,
                        thread_of(token),
                    )
                )
                continue
            decisions.append(DecisionRecord(to, _tag(call), "allow", rule_name, "", key))
            out.send.append(Approved(call, {"warn": warnings} if warnings else {}))
        out.record = StepRecord(tuple(decisions), tuple(refusals), tuple(pending))
        if record and out.record:
            await self.store.run(
                governance.record_decisions, token, step_id, decisions, refusals, pending
            )
        return out

    async def guard_results(
        self, token: TurnToken, step_no: int, profile: AgentProfile, cards: Sequence[Card]
    ) -> str | None:
        """Run the ``after`` guardrails on every tool result not yet judged; write their
        verdicts as cards. Returns the text of a halt (the caller ends the Turn)."""
        if not any(g.when == AFTER for g in profile.guardrails):
            return None
        judged = {c.metadata.get("tool_call_id") for c in cards if c.card_type == CardType.GUARD}
        calls = {
            c.metadata.get("tool_call_id"): c for c in cards if c.card_type == CardType.TOOL_CALL
        }
        history = past_calls(cards)
        new: list[NewCard] = []
        halt: str | None = None
        for card in cards:
            if card.card_type != CardType.TOOL_RESULT:
                continue
            call_id = card.metadata.get("tool_call_id")
            if call_id in judged:
                continue
            call = calls.get(call_id)
            guard_call = GuardCall(
                AFTER,
                token.agent_id,
                token.agent_turn_id,
                step_no,
                str(card.metadata.get("to", "")),
                call.content if call is not None else "",
                history,
                result=card.content,
                failed=bool(card.metadata.get("failed")),
            )
            verdict = combine(await self.guards.run(profile.guardrails, guard_call))
            meta: dict[str, object] = {"tool_call_id": call_id}
            if isinstance(verdict, Halt):
                halt = verdict.text
                meta["halt"] = verdict.text
            elif isinstance(verdict, Block):
                meta["block"] = verdict.text
            elif verdict:
                meta["warn"] = [w.text for w in verdict]
            new.append(NewCard(CardType.GUARD, "", meta))
            if halt is not None:
                break
        if new:
            await self.store.run(governance.record_decisions, token, "", [], new)
        return halt


def result_annotations(cards: Sequence[Card]) -> dict[str, dict[str, object]]:
    """tool_call_id → what the model must see with that result: ``warn`` (list of texts,
    from the call's own card and from ``after`` guardrails) and ``block`` (replacement)."""
    out: dict[str, dict[str, object]] = {}
    for card in cards:
        call_id = card.metadata.get("tool_call_id")
        if not isinstance(call_id, str):
            continue
        if card.card_type in (CardType.TOOL_CALL, CardType.GUARD):
            entry = out.setdefault(call_id, {})
            warns = card.metadata.get("warn")
            if isinstance(warns, list) and warns:
                shown = entry.setdefault("warn", [])
                if isinstance(shown, list):
                    shown.extend(warns)
            if card.metadata.get("block"):
                entry["block"] = card.metadata["block"]
    return out
