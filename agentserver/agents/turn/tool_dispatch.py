"""A step's tool calls: screened by governance (when the agent is governed), checked by
the pump, the Turn suspended on those that can go out (approvals included), then
forwarded through the pump one at a time.

The step's reply, governance's record and the suspend are one transaction
(:meth:`ToolDispatch.call`): the calls' sub-thread ids are drawn first, so the waiting set
is durable before any call goes out, and a report never comes before its suspend.

:meth:`ToolDispatch.screen` is the one entry point that screens a step's calls, whether
the step's transaction writes the screening or :meth:`ToolDispatch.screen` does.

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
from agentserver.agents.governance.budgets import spent
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
from agentserver.agents.store.governance import StepRecord as ScreenRecord
from agentserver.agents.store.sql import governance, inbox, memory, turns
from agentserver.agents.store.sql import tools as sql_tools
from agentserver.agents.store.states import HeadStatus
from agentserver.agents.turn.hold import TurnHold
from agentserver.agents.turn.machine import (
    GuardrailHalted,
    NoToolsSent,
    StepRecord,
    ToolsSent,
    element_text,
    huh_card,
)
from agentserver.core.threads import new_thread_id
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
            history = await self.store.read(memory.cards, box) if box else []
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
        calls: tuple[FoundPayload, ...],
        history: Sequence[Card] | None = None,
        step: StepRecord | None = None,
        *,
        approvals: Approvals | None = None,
    ) -> DispatchOutcome:
        """Screen the step's tool calls, check those governance lets through, write the
        step's suspend on those that can go out, then send them.

        :class:`NoToolsSent` when none can go out (the Turn goes on); :class:`ToolsSent`
        (whether a report is due already, whether approvals were asked) when it
        suspended; :class:`GuardrailHalted` when a guardrail halted the step, nothing of it
        sent (the caller ends the Turn). ``history``: the Turn's output cards, if the
        caller has them; ``step``: the step's reply, not written yet, written in the same
        transaction as the suspend (or, when nothing goes out, as the refusals), with the
        screening's record; ``approvals``: sends the approval requests at once (None: they
        wait for its tick).

        Atomic up to the sends: the step, the screening, the refusals and the waiting set
        are one compare-and-set transaction (StaleTurn, nothing written, when the Turn
        moved on). Each call's sub-thread id is drawn before it, so that the waiting set
        names it before the call goes out: a report can never come before its suspend.
        A send the pump refuses after that (no room) is reported as that call's failed
        result. Cancelled or crashed between the commit and the sends, the Turn is
        suspended on calls that never went out: a restart's recovery sends them again or
        reports them lost (``AgentRuntime.lost_calls``)."""
        cards: list[NewCard] = []
        records: list[ToolCallRecord] = []
        # Each call's key from its place in the model's message (screening keeps the
        # call objects, so identity finds it).
        place = {id(c): i for i, c in enumerate(calls)}
        screened = await self.screen(
            token, step_id, step_no, profile, calls, history, record=step is None
        )
        record = screened.record if screened is not None and step is not None else None
        if screened is not None:
            if screened.halt is not None:
                if step is not None:
                    await self._complete(token, step, [], record)
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
        outgoing: list[tuple[FoundPayload, dict[str, object], str]] = []
        for call, metadata in send:
            try:
                self.tools.check_call(token.agent_id, call.element, call.to)
            except PumpRefused as refused:
                cards.append(huh_card(refused.element, f"the call to {call.to} was refused"))
                continue
            # A tool call names its peer (decide() makes CallTools of those only).
            to = call.to or ""
            sub_thread = new_thread_id()
            after = "terminate" if call.to in profile.terminate_tools else "suspend"
            records.append(
                ToolCallRecord(sub_thread, to, element_text(call.element), after, metadata)
            )
            outgoing.append((call, metadata, sub_thread))
        if not records:
            if step is not None:
                await self._complete(token, step, cards, record)
            else:
                await self.store.run(turns.add_cards, token, cards)
            return NoToolsSent()
        deadline = self.clock.now() + profile.resume_deadline_s
        early = await self.store.run(
            sql_tools.suspend,
            token,
            step_id,
            records,
            cards,
            deadline,
            completion=step.completion if step else None,
            step_cards=step.cards if step else (),
            screened=record,
            spends=step.spends if step else (),
        )
        if step is not None:
            spent(self.events, step.spends)
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
        turned_away = await self._send(token, reply_ref, outgoing)
        if early or turned_away:
            self.doorbell.ring()  # their reports are due now
        asked = any(r.after_execution == WAITING_KIND for r in records)
        if approvals is not None and asked:
            await approvals.deliver_requests()
        return ToolsSent(early + turned_away > 0, asked)

    async def _complete(
        self,
        token: TurnToken,
        step: StepRecord,
        cards: Sequence[NewCard],
        screened: ScreenRecord | None,
    ) -> None:
        """Write a step that sends nothing: its reply, the screening's record and
        ``cards`` (the pump's refusals) in one compare-and-set, its model calls settled."""
        written = [*step.cards, *cards]
        if screened:
            await self.store.run(
                governance.complete_screened_step,
                token,
                step.step_id,
                step.completion,
                written,
                screened,
                step.spends,
            )
        else:
            await self.store.run(
                turns.complete_step,
                token,
                step.step_id,
                step.completion,
                written,
                None,
                step.spends,
            )
        spent(self.events, step.spends)

    async def _send(
        self,
        token: TurnToken,
        reply_ref: ReplyRef,
        outgoing: Sequence[tuple[FoundPayload, Mapping[str, object], str]],
    ) -> int:
        """Send the calls of a suspend just written, each on the sub-thread the waiting set
        names; returns how many the pump refused (each reported as its call's failed
        result). The suspend's commit fences the first call; each later one is fenced on
        the Turn still suspended with ``token`` (a stop, or the calls' timeout, moved it:
        StaleTurn, nothing more sent)."""
        refused = 0
        for i, (call, metadata, sub_thread) in enumerate(outgoing):
            if i:
                await self.hold.fence(token, HeadStatus.SUSPENDED)
            to = call.to or ""
            content = None
            if self.tracing.capture_content:
                content = etree.tostring(call.element, encoding="unicode")
            # The span covers the dispatch; the tool's handle span is its child.
            with self.tracing.execute_tool(to, content) as span:
                span.set_attribute("gen_ai.tool.call.id", sub_thread)
                try:
                    await self.tools.call(
                        token.agent_id,
                        reply_ref,
                        call.element,
                        call.to,
                        key=str(metadata[KEY_FIELD]),
                        thread=sub_thread,
                    )
                except PumpRefused as no:
                    record_error(span, "refused")
                    log.warning("turn %s: the call to %s was refused", token.agent_turn_id, to)
                    await self.store.run(
                        inbox.report_tool_result,
                        token.agent_id,
                        sub_thread,
                        etree.tostring(no.element),
                        failed=True,
                    )
                    refused += 1
        return refused

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
        cards = await self.store.read(memory.cards, box) if box else []
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
