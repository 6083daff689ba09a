"""The stateless agent worker (seed 000).

A fixed number of runner tasks take agent ids from a bounded channel fed by a dispatcher
that wakes on the doorbell. A runner claims the agent's due inbox rows one at a time (in
``next_retry_at, created_at`` order) and handles each: an Enqueue starts its Turn, a tool
result or timeout is applied to the waiting set (resuming the Turn when it completes), a
``resume`` row re-runs a recovered Turn. An agent is handled by at most one runner at a
time, and the head allows one active Turn, so an agent runs one Turn at a time.

The worker keeps no business state on itself: everything is in the store, in locals or in
the inbox row. Every write is a CAS on the Turn's token; a :class:`StaleTurn` anywhere
means another party (stop, watchdog) ended or moved the Turn, and the worker drops it
without further side effects. Model calls are bounded by ``profile.llm_timeout_s`` and
every failure ends the Turn with one failed deliverable, so a Turn never hangs on the model.
A stop does not wait for that bound: :meth:`Worker.interrupt` cancels the run of a Turn
that has ended in the store (its model call included), so the runner takes the agent's
next Turn at once.
"""

from __future__ import annotations

import json
import logging

import structlog
import trio

from agentserver.agents.clock import Clock
from agentserver.agents.errors import PumpRefused, StaleTurn
from agentserver.agents.events import StateEvent, StepEvent
from agentserver.agents.governance.approvals import Approvals, forward_granted
from agentserver.agents.governance.budgets import Budgets
from agentserver.agents.governance.governor import Governor, Screened
from agentserver.agents.ports import LLMPort, ReplyRef, ToolPort
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.retry import step_retries_done
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.reading.decide import (
    CallTools,
    Deliver,
    Feedback,
    RequireTool,
    SelfIterate,
    Submit,
    decide,
)
from agentserver.agents.reading.parsing import extract_payloads, make_huh
from agentserver.agents.reading.submit import evaluate_submit
from agentserver.agents.store.base import (
    CardType,
    InboxRow,
    NewCard,
    StepStart,
    TaskStatus,
    TurnToken,
)
from agentserver.agents.store.rows import client_of
from agentserver.agents.store.states import HeadStatus, MessageType
from agentserver.agents.turn.answer import answer_bytes
from agentserver.agents.turn.hold import TurnHold
from agentserver.agents.turn.model_context import limit_text
from agentserver.agents.turn.model_step import ModelStep, StepFailed
from agentserver.agents.turn.tool_dispatch import ToolDispatch, element_text, huh_card
from agentserver.core.xmlsafe import SafeParser

log = logging.getLogger(__name__)


class _Unread:
    """The type of :data:`UNREAD`."""


#: A Turn's reply reference not read yet (None is a value: a Turn with none).
UNREAD = _Unread()


class Worker:
    """Runs Turns. Holds only infrastructure (store, ports, bus, settings).

    ``hold`` fences and finishes the Turns it runs (shared with its parts, the model
    step and the tool dispatch, so that none of them calls back into the worker)."""

    def __init__(
        self,
        *,
        hold: TurnHold,
        llm: LLMPort,
        tools: ToolPort,
        clock: Clock,
        settings: StoreSettings,
        approvals: Approvals | None = None,
        budgets: Budgets | None = None,
    ) -> None:
        self.hold = hold
        self.tracing = hold.tracing
        self.ender = hold.ender
        self.store = hold.ender.store
        self.profiles = hold.ender.profiles
        self.events = hold.ender.events
        self.doorbell = hold.ender.doorbell
        self.tools = tools
        self.clock = clock
        self.settings = settings
        self.governor = Governor(self.store, clock)  # type: ignore[arg-type]
        self.llm = llm
        self.model = ModelStep(
            store=self.store,
            events=self.events,
            hold=hold,
            poll_s=settings.watchdog_interval_s,
            budgets=budgets,
        )
        self.tool_calls = ToolDispatch(
            store=self.store,
            tools=tools,
            governor=self.governor,
            tracing=self.tracing,
            clock=clock,
            events=self.events,
            doorbell=self.doorbell,
            hold=hold,
        )
        #: Sends approval requests (None: approvals wait for the runtime's tick).
        self.approvals = approvals
        #: The run each runner is in: agent id -> (Turn id, its cancel scope). One entry
        #: per runner at most (an agent is handled by one runner at a time), so bounded
        #: by ``worker_concurrency``; removed when the run returns.
        self._runs: dict[str, tuple[str, trio.CancelScope]] = {}

    def interrupt(self, agent_id: str, agent_turn_id: str) -> bool:
        """Cancel this process's run of Turn ``agent_turn_id`` of ``agent_id``, if a
        runner is in it; True when one was. Never blocks (the run unwinds on its own).

        Call only once the Turn has ended in the store (a stop's ``force_end`` committed):
        the run is fenced out already, so cancelling it loses nothing it could still
        write, and its model call (which would otherwise hold the runner, and so the
        agent's next Turn, up to ``llm-timeout``) is abandoned at once. A run of another
        Turn of the agent (the runner moved on) is left alone."""
        run = self._runs.get(agent_id)
        if run is None or run[0] != agent_turn_id:
            return False
        run[1].cancel()
        return True

    # -- scheduling ---------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Dispatch due agents to ``settings.worker_concurrency`` runners until cancelled."""
        n = self.settings.worker_concurrency
        send, recv = trio.open_memory_channel[str](n)
        busy: set[str] = set()
        async with trio.open_nursery() as nursery, send:
            for _ in range(n):
                nursery.start_soon(self._runner, recv.clone(), busy)
            await recv.aclose()
            task_status.started()
            while True:
                for agent_id in await self.store.due_agents(self.settings.claim_batch):
                    if agent_id not in busy:
                        busy.add(agent_id)
                        await send.send(agent_id)  # bounded: waits for a free runner
                with trio.move_on_after(self.settings.watchdog_interval_s):
                    await self.doorbell.wait()

    async def _runner(self, recv: trio.MemoryReceiveChannel[str], busy: set[str]) -> None:
        async with recv:
            async for agent_id in recv:
                try:
                    await self.process_agent(agent_id, poll_waiting=False)
                except Exception:
                    log.exception("agent %s: unexpected error while processing", agent_id)
                finally:
                    busy.discard(agent_id)
                    # Rows may have arrived after our last claim: have the dispatcher look.
                    self.doorbell.ring()

    async def process_agent(self, agent_id: str, *, poll_waiting: bool = True) -> int:
        """Handle every due inbox row of ``agent_id``, one at a time; returns how many.

        ``poll_waiting=False`` (the runners): stop after a row that left the Turn waiting
        for its tools with none of their reports due, instead of claiming once more for
        nothing; a report that comes later rings the doorbell, as a runner does when it
        lets go of its agent, so the dispatcher brings the agent back.

        Must not run concurrently for the same agent (:meth:`run` guarantees it).
        """
        handled = 0
        while rows := await self.store.claim_due(agent_id, 1):
            more = await self.handle_row(rows[0])
            handled += 1
            if not (more or poll_waiting):
                break
        return handled

    # -- rows ---------------------------------------------------------------------------
    async def handle_row(self, row: InboxRow) -> bool:
        """Handle one claimed (``processing``) inbox row. False when it left the Turn
        waiting for its tools with no report due yet (see :meth:`process_agent`)."""
        if row.message_type == MessageType.TURN:
            return await self._start(row)
        if row.message_type in (MessageType.TOOL_RESULT, MessageType.TIMEOUT):
            profile = self.profiles.get(row.agent_id)
            # Without after-guardrails (which judge the results before the next step
            # begins), the resume opens the next step in its own transaction.
            then_step = profile.max_steps if profile and not profile.guardrails else None
            outcome = await self.store.apply_report(row, then_step=then_step)
            if outcome.resumed is None or profile is None:
                # (profile None: unreachable in practice, a Turn exists only for a known agent)
                return True
            if outcome.terminate_card_id is not None:
                card = await self.store.card(outcome.terminate_card_id)
                await self.hold.finish(
                    outcome.resumed, profile, TaskStatus.SUCCEEDED, card.content if card else ""
                )
                return True
            return await self._run_turn(
                outcome.resumed, profile, ref_json=outcome.reply_ref_json, step=outcome.step
            )
        if row.message_type == MessageType.APPROVAL:
            await forward_granted(
                row,
                store=self.store,
                profiles=self.profiles,
                tools=self.tools,
                clock=self.clock,
                doorbell=self.doorbell,
            )
        elif row.message_type == MessageType.RESUME:
            token = await self.store.take_resume(row)
            profile = self.profiles.get(row.agent_id)
            if token is not None and profile is not None:
                retries = step_retries_done(row.payload)
                return await self._run_turn(token, profile, retries, recovered=not retries)
        else:
            await self.store.skip_row(row, f"unknown message type {row.message_type!r}")
        return True

    async def _start(self, row: InboxRow) -> bool:
        profile = self.profiles.get(row.agent_id)
        problem = None
        ref_ok = True
        try:
            json.loads(row.reply_ref_json or "")
        except ValueError:
            ref_ok, problem = False, "the task's reply reference is unreadable"
        if profile is None:
            problem = "no such agent"
        elif row.token is None:
            problem = "the task carries no Turn"
        else:
            try:
                SafeParser().parse(row.payload)
            except Exception:
                problem = "the task payload is not well-formed XML"
        if problem is not None:
            reply = answer_bytes(profile, problem, failed=True) if profile and ref_ok else None
            fin = await self.store.fail_turn_row(row, problem, reply)
            if fin is not None:
                await self.ender.after(fin)
            return True
        assert profile is not None and row.token is not None
        step: StepStart | None = None
        try:
            if profile.guardrails:  # they judge the cards before each step begins
                token = await self.store.start_turn(row)
            else:
                step = await self.store.start_turn_step(row, profile.max_steps)
                token = row.token
        except StaleTurn:
            await self.store.skip_row(row, "turn no longer dispatched")
            return True
        self.events.publish(StateEvent(token.agent_id, token.agent_turn_id, HeadStatus.RUNNING))
        # The reference was read with the row: the Turn's own (its Enqueue).
        return await self._run_turn(token, profile, ref_json=row.reply_ref_json, step=step)

    # -- the Turn -----------------------------------------------------------------------
    async def _run_turn(
        self,
        token: TurnToken,
        profile: AgentProfile,
        retries_done: int = 0,
        *,
        ref_json: str | _Unread | None = UNREAD,
        step: StepStart | None = None,
        recovered: bool = False,
    ) -> bool:
        """Run the Turn until it suspends, waits or ends. ``ref_json``: its reply
        reference if the caller read it already; ``step``: its first step if begun;
        ``recovered``: a restart's resume (a last step's calls cut off are sent first).
        False when it suspended with no report due yet.

        Cancelled by :meth:`interrupt` (a stop that ended the Turn): the run, its model
        call included, unwinds at its next checkpoint and returns True; a store write
        already under way completes (it is atomic), and the store's fence refuses it."""
        # A stop cancels this scope (interrupt): the Turn has ended in the store already.
        with trio.CancelScope() as scope:
            self._runs[token.agent_id] = (token.agent_turn_id, scope)
            try:
                return await self._run_turn_logged(
                    token, profile, retries_done, ref_json, step, recovered
                )
            finally:
                if self._runs.get(token.agent_id, (None, None))[1] is scope:
                    del self._runs[token.agent_id]
        log.info(
            "turn %s of %s was stopped; its run was cancelled", token.agent_turn_id, token.agent_id
        )
        return True

    async def _run_turn_logged(
        self,
        token: TurnToken,
        profile: AgentProfile,
        retries_done: int,
        ref_json: str | _Unread | None,
        step: StepStart | None,
        recovered: bool = False,
    ) -> bool:
        """:meth:`_run_turn` in the Turn's log context."""
        # Every log record of this run names the agent and Turn (and, once read from the
        # task's reference, its threads).
        with structlog.contextvars.bound_contextvars(
            agent=token.agent_id, turn=token.agent_turn_id
        ):
            try:
                if isinstance(ref_json, _Unread):
                    ref_json = await self.store.turn_reply_ref(token)
                reply_ref: ReplyRef = json.loads(ref_json) if ref_json else None
                ref = reply_ref if isinstance(reply_ref, dict) else {}
                thread = ref.get("caller_thread")
                # One span per run of the Turn; the trace context came with the task
                # (see bridge.agent_handler), so it survives a restart.
                with (
                    self.tracing.invoke_agent(
                        token.agent_id, token.agent_turn_id, thread, ref.get("traceparent")
                    ),
                    structlog.contextvars.bound_contextvars(
                        thread=ref.get("hop"), caller_thread=thread
                    ),
                ):
                    if recovered:
                        more = await self.tool_calls.call_recorded(
                            token, profile, reply_ref, approvals=self.approvals
                        )
                        if more is not None:
                            return more
                    return await self._steps(token, profile, reply_ref, retries_done, step)
            except StaleTurn:
                log.info("turn %s of %s moved on; dropping it", token.agent_turn_id, token.agent_id)
            except trio.Cancelled:
                raise
            except Exception as exc:
                log.exception("turn %s of %s failed", token.agent_turn_id, token.agent_id)
                try:
                    await self.hold.finish(
                        token, profile, TaskStatus.FAILED, f"internal error: {type(exc).__name__}"
                    )
                except StaleTurn:
                    pass
        return True

    async def _steps(
        self,
        token: TurnToken,
        profile: AgentProfile,
        reply_ref: ReplyRef,
        retries_done: int = 0,
        step: StepStart | None = None,
    ) -> bool:
        """Take steps until the Turn suspends, waits to retry a step, or ends; False when
        it suspended with no report due yet.

        ``retries_done``: retries the first step already had (a retry wait's resume);
        ``step``: the first step, if the transaction that started or resumed the Turn
        began it. Raises StaleTurn when fenced out."""
        # Her budgets, whichever door she came in by (socket, HTTP, A2A).
        client = client_of(reply_ref)
        while True:
            if step is None:
                step = await self._open_step(token, profile)
                if step is None:
                    return True
            head, step_id, step_no = step.head, step.step_id, step.step_no
            if step_id is None:
                await self.hold.finish(
                    token, profile, TaskStatus.FAILED, limit_text(step.output, profile)
                )
                return True
            self._step_event(token, step_id, "started", "thinking")
            done = await self.model.complete(
                self.llm, token, head, profile, step_id, retries_done, step, client
            )
            if isinstance(done, StepFailed):
                await self.hold.finish(token, profile, TaskStatus.FAILED, done.problem)
                return True
            if done is None:
                return True
            completion, swap = done
            retries_done = 0
            # The output box as the step leaves it (past_calls reads only tool calls and
            # refusals, which the step's own card is not); read again after a swap.
            history = None if swap is not None else step.output
            step = None
            parsed = extract_payloads(completion.content, profile)
            decision = decide(completion.content, parsed, profile)
            said = [NewCard(CardType.LLM_MESSAGE, completion.content, {"step_id": step_id})]
            if isinstance(decision, Submit | Deliver) and swap is None:
                # The last step: written with the Turn's end, in one transaction.
                self._step_event(token, step_id, "planning", "")
                status, text, meta = TaskStatus.SUCCEEDED, "", None
                if isinstance(decision, Deliver):
                    text = decision.text
                else:
                    text, meta = _submitted(decision, profile)
                await self.hold.finish(
                    token, profile, status, text, meta, (step_id, completion, said)
                )
                return True
            screened: Screened | None = None
            if isinstance(decision, CallTools) and history is not None:
                # Screened first, so that its record is written with the step (one
                # compare-and-set instead of two). After a swap the calls are screened on
                # the compacted cards, once the step is complete (ToolDispatch.call).
                try:
                    screened = await self.tool_calls.screen(
                        token, step_id, step_no, profile, decision.calls, history, record=False
                    )
                except Exception:
                    await self.store.complete_step(token, step_id, completion, said)
                    raise
            await self.store.complete_step(
                token,
                step_id,
                completion,
                said,
                swap=swap,
                screened=screened.record if screened is not None else None,
            )
            self._step_event(token, step_id, "planning", "")
            match decision:
                case Feedback(errors):
                    cards = [huh_card(make_huh(e.reason, e.raw), e.hint) for e in errors]
                    await self.store.add_cards(token, cards)
                case RequireTool(note):
                    await self.store.add_cards(token, [NewCard(CardType.NOTE, note)])
                case SelfIterate(payload):
                    await self.hold.fence(token)
                    try:
                        await self.tools.self_iterate(token.agent_id, reply_ref, payload.element)
                    except PumpRefused as refused:
                        card = huh_card(refused.element, "")
                    else:
                        card = NewCard(CardType.SELF_CALL, element_text(payload.element))
                    await self.store.add_cards(token, [card])
                case CallTools(calls):
                    more = await self.tool_calls.call(
                        token,
                        step_id,
                        step_no,
                        profile,
                        reply_ref,
                        calls,
                        history,
                        screened,
                        approvals=self.approvals,
                    )
                    if more is not None:
                        return more
                case Submit():
                    text, meta = _submitted(decision, profile)
                    await self.hold.finish(token, profile, TaskStatus.SUCCEEDED, text, meta)
                    return True
                case Deliver(text):
                    await self.hold.finish(token, profile, TaskStatus.SUCCEEDED, text)
                    return True
            self._step_event(token, step_id, "completed", "")

    async def _open_step(self, token: TurnToken, profile: AgentProfile) -> StepStart | None:
        """Begin the next step (:meth:`AgentStore.open_step`), after the ``after``
        guardrails judged the results so far; None when they halted the Turn."""
        if profile.guardrails:
            head = await self.hold.fence(token)
            if head.output_box_id:
                cards = await self.store.cards(head.output_box_id)
                halt = await self.governor.guard_results(token, head.step_count, profile, cards)
                if halt is not None:
                    await self.hold.finish(token, profile, TaskStatus.FAILED, f"halted: {halt}")
                    return None
        return await self.store.open_step(token, profile.max_steps)

    def _step_event(self, token: TurnToken, step_id: str, phase: str, activity: str) -> None:
        self.events.publish(StepEvent(token.agent_id, token.agent_turn_id, step_id, phase))
        if activity:
            self.events.publish(
                StateEvent(token.agent_id, token.agent_turn_id, HeadStatus.RUNNING, activity)
            )


def _submitted(decision: Submit, profile: AgentProfile) -> tuple[str, dict[str, object]]:
    """The answer text and deliverable metadata of a ``submit_result`` call."""
    outcome = evaluate_submit(decision.payload.element, profile.result_fields)
    if outcome.warnings:
        log.warning("submit_result degraded: %s", "; ".join(outcome.warnings))
    meta = {
        "fields": dict(outcome.fields),
        "degraded": outcome.degraded,
        "warnings": list(outcome.warnings),
    }
    return outcome.as_text(), meta
