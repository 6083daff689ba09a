"""A step's tool calls: screened by governance (when the agent is governed), forwarded
through the pump one at a time, each fenced on the Turn first (no new side effect once
fenced out), then the Turn suspended on the calls that went out, approvals included.

:meth:`ToolDispatch.screen` is the one entry point that screens a step's calls, whether
the worker writes the screening with the step or :meth:`ToolDispatch.call` writes it.

Each forward awaits the pump; cancellation propagates. A :class:`StaleTurn` from a fence
propagates with nothing more sent.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from lxml import etree

from agentserver.agents.clock import Clock
from agentserver.agents.doorbell import Doorbell
from agentserver.agents.errors import PumpRefused
from agentserver.agents.events import EventBus, StateEvent
from agentserver.agents.governance.approvals import APPROVAL_PREFIX, WAITING_KIND, Approvals
from agentserver.agents.governance.governor import Governor, Screened, governed
from agentserver.agents.ports import ReplyRef, ToolPort
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.reading.decide import CallTools, decide
from agentserver.agents.reading.parsing import FoundPayload, extract_payloads
from agentserver.agents.store.base import (
    AgentStore,
    Card,
    CardType,
    NewCard,
    ToolCallRecord,
    TurnToken,
)
from agentserver.agents.store.states import HeadStatus
from agentserver.agents.turn.hold import TurnHold
from agentserver.agents.turn.machine import (
    GuardrailHalted,
    NoToolsSent,
    ToolsSent,
    element_text,
    huh_card,
)
from agentserver.observability.tracing import Tracing, record_error
from agentserver.steps.retry import KEY_FIELD, idempotency_key

log = logging.getLogger("agentserver.agents.turn.worker")

#: What sending a step's calls came to: the Turn machine's event as it is.
DispatchOutcome = ToolsSent | NoToolsSent | GuardrailHalted


class ToolDispatch:
    """Sends a step's tool calls for the worker. Holds only infrastructure."""

    def __init__(
        self,
        *,
        store: AgentStore,
        tools: ToolPort,
        governor: Governor,
        tracing: Tracing,
        clock: Clock,
        events: EventBus,
        doorbell: Doorbell,
        hold: TurnHold,
    ) -> None:
        self.store = store
        self.tools = tools
        self.governor = governor
        self.tracing = tracing
        self.clock = clock
        self.events = events
        self.doorbell = doorbell
        #: Fences the Turn before each call (a halt is the caller's to end: GuardrailHalted).
        self.hold = hold

    async def screen(
        self,
        token: TurnToken,
        step_id: str,
        step_no: int,
        profile: AgentProfile,
        calls: Sequence[FoundPayload],
        history: Sequence[Card] | None = None,
        *,
        record: bool = True,
    ) -> Screened | None:
        """Screen one step's tool calls: the one entry point to governance's screening
        (policy, loops, ``before`` guardrails; :meth:`Governor.screen`). None when the
        agent is not governed (every call goes out as the model wrote it), with no I/O.

        ``history``: the Turn's output cards, if the caller has them (else read from the
        fenced head: StaleTurn when fenced out, nothing screened). ``record=False``: the
        decisions are not written; the caller writes ``Screened.record`` with the step
        (``complete_step(screened=...)``), one compare-and-set instead of two. Otherwise
        they are written in one compare-and-set transaction on the running Turn, before
        this returns. Rate windows are read from the store; cancellation propagates."""
        if not governed(profile):
            return None
        if history is None:
            head = await self.hold.fence(token)
            box = head.output_box_id
            history = await self.store.cards(box) if box else []
        return await self.governor.screen(
            token, step_id, step_no, profile, history, calls, record=record
        )

    async def call(
        self,
        token: TurnToken,
        step_id: str,
        step_no: int,
        profile: AgentProfile,
        reply_ref: ReplyRef,
        calls: tuple,
        history: Sequence[Card] | None = None,
        screened: Screened | None = None,
        *,
        approvals: Approvals | None = None,
    ) -> DispatchOutcome:
        """Forward the tool calls governance lets through; suspend if any was accepted.
        :class:`NoToolsSent` when none went out (the Turn goes on); :class:`ToolsSent`
        (whether a report is due already, whether approvals were asked) when it suspended;
        :class:`GuardrailHalted` when a guardrail halted the step, nothing of it sent (the
        caller ends the Turn). ``history``: the Turn's output cards, if the caller has them;
        ``screened``: the calls' screening, if written with the step already;
        ``approvals``: sends the approval requests at once (None: they wait for its tick).

        Called right after the step's compare-and-set (``complete_step``), which is the
        fence of the first call: each later call is fenced again first."""
        records: list[ToolCallRecord] = []
        cards: list[NewCard] = []
        # Each call's key from its place in the model's message (screening keeps the
        # call objects, so identity finds it).
        place = {id(c): i for i, c in enumerate(calls)}
        if screened is None:
            screened = await self.screen(token, step_id, step_no, profile, calls, history)
        if screened is not None:
            if screened.halt is not None:
                return GuardrailHalted(screened.halt)
            send = [(a.call, _keyed(a.metadata, step_id, place, a.call)) for a in screened.send]
            for ask in screened.approvals:
                # Waits durably as a call of its own kind until a decision or the timeout.
                records.append(
                    ToolCallRecord(
                        APPROVAL_PREFIX + ask.request_id,
                        ask.call.to or "",
                        element_text(ask.call.element),
                        WAITING_KIND,
                        {"approval": ask.request_id, KEY_FIELD: ask.request_id},
                    )
                )
        else:
            send = [(call, _keyed({}, step_id, place, call)) for call in calls]
        # No new side effect once fenced out. The last store call was a compare-and-set on
        # the running head: complete_step's, or record_decisions', which ends screen()
        # whenever it lets a call through. Each call awaits the pump: fence the next one
        # again.
        fenced = True
        for call, metadata in send:
            if not fenced:
                await self.hold.fence(token)
            fenced = False
            # A tool call names its peer (decide() makes CallTools of those only).
            to = call.to or ""
            content = None
            if self.tracing.capture_content:
                content = etree.tostring(call.element, encoding="unicode")
            try:
                # The span covers the dispatch; the tool's handle span is its child.
                with self.tracing.execute_tool(to, content) as span:
                    try:
                        sub_thread = await self.tools.call(
                            token.agent_id,
                            reply_ref,
                            call.element,
                            call.to,
                            key=str(metadata[KEY_FIELD]),
                        )
                    except PumpRefused:
                        record_error(span, "refused")
                        raise
                    span.set_attribute("gen_ai.tool.call.id", sub_thread)
            except PumpRefused as refused:
                cards.append(huh_card(refused.element, f"the call to {call.to} was refused"))
                continue
            after = "terminate" if call.to in profile.terminate_tools else "suspend"
            records.append(
                ToolCallRecord(sub_thread, to, element_text(call.element), after, metadata)
            )
        if not records:
            await self.store.add_cards(token, cards)
            return NoToolsSent()
        deadline = self.clock.now() + profile.resume_deadline_s
        early = await self.store.suspend(token, step_id, records, cards, deadline)
        self.events.publish(
            StateEvent(
                token.agent_id,
                token.agent_turn_id,
                HeadStatus.SUSPENDED,
                "awaiting_tool_result",
                records[0].to,
                len(records),
            )
        )
        # Results that arrived before the suspend committed are due now.
        self.doorbell.ring()
        asked = any(r.after_execution == WAITING_KIND for r in records)
        if approvals is not None and asked:
            await approvals.deliver_requests()
        return ToolsSent(early > 0, asked)

    async def call_recorded(
        self,
        token: TurnToken,
        profile: AgentProfile,
        reply_ref: ReplyRef,
        *,
        approvals: Approvals | None = None,
    ) -> DispatchOutcome:
        """A recovered Turn whose last step's output was recorded but whose tool calls were
        never suspended on (the process died while forwarding them): send them now, as
        that step's, so with the same idempotency keys, instead of asking the model again.
        :class:`NoToolsSent` when there was nothing to send (the Turn goes on with a new
        step); else as :meth:`call`."""
        head = await self.hold.fence(token)
        box = head.output_box_id
        cards = await self.store.cards(box) if box else []
        if not cards or cards[-1].card_type != CardType.LLM_MESSAGE:
            return NoToolsSent()
        said = cards[-1]
        step_id = said.metadata.get("step_id")
        decision = decide(said.content, extract_payloads(said.content, profile), profile)
        if not isinstance(step_id, str) or not isinstance(decision, CallTools):
            return NoToolsSent()
        log.warning(
            "turn %s: the calls of step %d were cut off by a restart; sending them again",
            token.agent_turn_id,
            head.step_count,
        )
        return await self.call(
            token,
            step_id,
            head.step_count,
            profile,
            reply_ref,
            decision.calls,
            cards,
            approvals=approvals,
        )


def _keyed(
    metadata: Mapping[str, object], step_id: str, place: dict[int, int], call: object
) -> dict[str, object]:
    """``metadata`` of a call card with the call's idempotency key added."""
    return {**metadata, KEY_FIELD: idempotency_key(step_id, place.get(id(call), len(place)))}
