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
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

import structlog
import trio
from lxml import etree
from opentelemetry import trace

from agentserver.agents.answer import answer_bytes
from agentserver.agents.approvals import (
    APPROVAL_PREFIX,
    WAITING_KIND,
    Approvals,
    forward_granted,
)
from agentserver.agents.budget import shown_text
from agentserver.agents.clock import Clock
from agentserver.agents.compactor import PendingSwap, compact_turn
from agentserver.agents.decide import (
    CallTools,
    Deliver,
    Feedback,
    RequireTool,
    SelfIterate,
    Submit,
    decide,
)
from agentserver.agents.delivery import TurnEnder
from agentserver.agents.errors import LLMUnavailable, PumpRefused, StaleTurn
from agentserver.agents.events import ChunkEvent, StateEvent, StepEvent
from agentserver.agents.governance import Governor, Screened, result_annotations
from agentserver.agents.parsing import extract_payloads, make_huh
from agentserver.agents.ports import (
    LLMCompletion,
    LLMMessage,
    LLMPort,
    LLMRequest,
    ReplyRef,
    ToolPort,
)
from agentserver.agents.profile import AgentProfile
from agentserver.agents.retry import RetryStep, decide_retry, step_retries_done
from agentserver.agents.settings import StoreSettings
from agentserver.agents.states import HeadStatus, MessageType
from agentserver.agents.store import (
    BoxSwap,
    Card,
    CardType,
    Head,
    InboxRow,
    NewCard,
    StepStart,
    TaskStatus,
    ToolCallRecord,
    TurnToken,
)
from agentserver.agents.submit import evaluate_submit, usage_text
from agentserver.core.usage import RESPOND_WARNING
from agentserver.core.xmlsafe import SafeParser
from agentserver.llm.tokens import PER_REQUEST, estimate_message_tokens
from agentserver.observability.tracing import Tracing, record_error

log = logging.getLogger(__name__)

LAST_STEP_NOTE = (
    "This is your last step: answer now with what you have. Tool calls made now will not "
    "be followed by another step."
)


class _Unread:
    """The type of :data:`UNREAD`."""


#: A Turn's reply reference not read yet (None is a value: a Turn with none).
UNREAD = _Unread()


class Worker:
    """Runs Turns. Holds only infrastructure (store, ports, bus, settings)."""

    def __init__(
        self,
        *,
        ender: TurnEnder,
        llm: LLMPort,
        tools: ToolPort,
        clock: Clock,
        settings: StoreSettings,
        tracing: Tracing | None = None,
    ) -> None:
        self.tracing = tracing or Tracing()
        self.store = ender.store
        self.profiles = ender.profiles
        self.events = ender.events
        self.doorbell = ender.doorbell
        self.ender = ender
        self.llm = llm
        self.tools = tools
        self.clock = clock
        self.settings = settings
        self.governor = Governor(self.store, clock)  # type: ignore[arg-type]
        #: Sends approval requests (set by the runtime; None: approvals wait for its tick).
        self.approvals: Approvals | None = None

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
                await self._finish(
                    outcome.resumed, profile, TaskStatus.SUCCEEDED, card.content if card else ""
                )
                return True
            return await self._run_turn(
                outcome.resumed, profile, ref_json=outcome.reply_ref_json, step=outcome.step
            )
        if row.message_type == MessageType.APPROVAL:
            await forward_granted(self, row)
        elif row.message_type == MessageType.RESUME:
            token = await self.store.take_resume(row)
            profile = self.profiles.get(row.agent_id)
            if token is not None and profile is not None:
                return await self._run_turn(token, profile, step_retries_done(row.payload))
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
    ) -> bool:
        """Run the Turn until it suspends, waits or ends. ``ref_json``: its reply
        reference if the caller read it already; ``step``: its first step if begun.
        False when it suspended with no report due yet."""
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
                    return await self._steps(token, profile, reply_ref, retries_done, step)
            except StaleTurn:
                log.info("turn %s of %s moved on; dropping it", token.agent_turn_id, token.agent_id)
            except trio.Cancelled:
                raise
            except Exception as exc:
                log.exception("turn %s of %s failed", token.agent_turn_id, token.agent_id)
                try:
                    await self._finish(
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
        while True:
            if step is None:
                step = await self._open_step(token, profile)
                if step is None:
                    return True
            head, step_id, step_no = step.head, step.step_id, step.step_no
            if step_id is None:
                await self._finish(
                    token, profile, TaskStatus.FAILED, _limit_text(step.output, profile)
                )
                return True
            self._step_event(token, step_id, "started", "thinking")
            done = await self._complete(token, head, profile, step_id, retries_done, step)
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
                await self._finish(token, profile, status, text, meta, (step_id, completion, said))
                return True
            screened: Screened | None = None
            if isinstance(decision, CallTools) and history is not None and _governed(profile):
                # Screened first, so that its record is written with the step (one
                # compare-and-set instead of two).
                try:
                    screened = await self.governor.screen(
                        token, step_id, step_no, profile, history, decision.calls, record=False
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
                    cards = [_huh_card(make_huh(e.reason, e.raw), e.hint) for e in errors]
                    await self.store.add_cards(token, cards)
                case RequireTool(note):
                    await self.store.add_cards(token, [NewCard(CardType.NOTE, note)])
                case SelfIterate(payload):
                    await self._fence(token)
                    try:
                        await self.tools.self_iterate(token.agent_id, reply_ref, payload.element)
                    except PumpRefused as refused:
                        card = _huh_card(refused.element, "")
                    else:
                        card = NewCard(CardType.SELF_CALL, _text(payload.element))
                    await self.store.add_cards(token, [card])
                case CallTools(calls):
                    more = await self._call_tools(
                        token, step_id, step_no, profile, reply_ref, calls, history, screened
                    )
                    if more is not None:
                        return more
                case Submit():
                    text, meta = _submitted(decision, profile)
                    await self._finish(token, profile, TaskStatus.SUCCEEDED, text, meta)
                    return True
                case Deliver(text):
                    await self._finish(token, profile, TaskStatus.SUCCEEDED, text)
                    return True
            self._step_event(token, step_id, "completed", "")

    async def _open_step(self, token: TurnToken, profile: AgentProfile) -> StepStart | None:
        """Begin the next step (:meth:`AgentStore.open_step`), after the ``after``
        guardrails judged the results so far; None when they halted the Turn."""
        if profile.guardrails:
            head = await self._fence(token)
            if head.output_box_id:
                cards = await self.store.cards(head.output_box_id)
                halt = await self.governor.guard_results(token, head.step_count, profile, cards)
                if halt is not None:
                    await self._finish(token, profile, TaskStatus.FAILED, f"halted: {halt}")
                    return None
        return await self.store.open_step(token, profile.max_steps)

    async def _call_tools(
        self,
        token: TurnToken,
        step_id: str,
        step_no: int,
        profile: AgentProfile,
        reply_ref: ReplyRef,
        calls: tuple,
        history: Sequence[Card] | None = None,
        screened: Screened | None = None,
    ) -> bool | None:
        """Forward the tool calls governance lets through; suspend if any was accepted.
        None when the Turn goes on; else whether a report is due already (True too when
        the Turn ended). ``history``: the Turn's output cards, if the caller has them;
        ``screened``: the calls' screening, if written with the step already.

        Called right after the step's compare-and-set (``complete_step``), which is the
        fence of the first call: each later call is fenced again first."""
        records: list[ToolCallRecord] = []
        cards: list[NewCard] = []
        if _governed(profile):
            if screened is None:
                if history is None:
                    head = await self._fence(token)
                    box = head.output_box_id
                    history = await self.store.cards(box) if box else []
                screened = await self.governor.screen(
                    token, step_id, step_no, profile, history, calls
                )
            if screened.halt is not None:
                await self._finish(token, profile, TaskStatus.FAILED, f"halted: {screened.halt}")
                return True
            send = [(a.call, a.metadata) for a in screened.send]
            for ask in screened.approvals:
                # Waits durably as a call of its own kind until a decision or the timeout.
                records.append(
                    ToolCallRecord(
                        APPROVAL_PREFIX + ask.request_id,
                        ask.call.to or "",
                        _text(ask.call.element),
                        WAITING_KIND,
                        {"approval": ask.request_id},
                    )
                )
        else:
            send = [(call, {}) for call in calls]
        # No new side effect once fenced out. The last store call was a compare-and-set on
        # the running head: complete_step's, or record_decisions', which ends screen()
        # whenever it lets a call through. Each call awaits the pump: fence the next one
        # again.
        fenced = True
        for call, metadata in send:
            if not fenced:
                await self._fence(token)
            fenced = False
            content = None
            if self.tracing.capture_content:
                content = etree.tostring(call.element, encoding="unicode")
            try:
                # The span covers the dispatch; the tool's handle span is its child.
                with self.tracing.execute_tool(call.to, content) as span:
                    try:
                        sub_thread = await self.tools.call(
                            token.agent_id, reply_ref, call.element, call.to
                        )
                    except PumpRefused:
                        record_error(span, "refused")
                        raise
                    span.set_attribute("gen_ai.tool.call.id", sub_thread)
            except PumpRefused as refused:
                cards.append(_huh_card(refused.element, f"the call to {call.to} was refused"))
                continue
            after = "terminate" if call.to in profile.terminate_tools else "suspend"
            records.append(
                ToolCallRecord(sub_thread, call.to, _text(call.element), after, metadata)
            )
        if not records:
            await self.store.add_cards(token, cards)
            return None
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
        if self.approvals is not None and any(r.after_execution == WAITING_KIND for r in records):
            await self.approvals.deliver_requests()
        return early > 0

    async def _complete(
        self,
        token: TurnToken,
        head: Head,
        profile: AgentProfile,
        step_id: str,
        retries_done: int,
        step: StepStart,
    ) -> tuple[LLMCompletion, BoxSwap | None] | None:
        """One model call on the cards ``step`` read, and the compaction to commit with
        the step (or None); None when it failed: then either the step waits to be retried (a retryable kind, see
        :mod:`agentserver.agents.retry`) or the Turn ended failed.

        With a streaming port, each text chunk is published as a :class:`ChunkEvent` as it
        arrives; otherwise the whole text is published as one chunk.

        Before the call, a context over budget is compacted (``agents/compaction.py``); a
        provider's CONTEXT_OVERFLOW compacts once more, keeping only the task, and retries
        at once; a second overflow ends the Turn. The model is shown the compacted cards
        at once, but the box swap is committed only with the step's results.
        """
        budget = profile.budget
        system = _system_text(profile)
        system_tokens = estimate_message_tokens(system)
        overflowed = False
        pending: PendingSwap | None = None
        problem: str
        try:
            with trio.fail_after(profile.llm_timeout_s):
                while True:
                    shown = pending.tokens if pending else head.context_tokens
                    if overflowed or budget.over(system_tokens, shown):
                        pending = (
                            await compact_turn(
                                self.store, self.llm, token, profile, keep_nothing=overflowed
                            )
                            or pending
                        )
                        head = await self._fence(token)
                        shown = pending.tokens if pending else head.context_tokens
                    try:
                        completion = await self._call(
                            token, profile, step_id, system, pending or step, step.step_no
                        )
                    except LLMUnavailable as exc:
                        if exc.kind.upper() == "CONTEXT_OVERFLOW" and not overflowed:
                            overflowed = True
                            continue
                        raise
                    # The provider's count corrects the running estimate (upwards only:
                    # the estimate is kept pessimistic).
                    over = completion.usage.prompt_tokens - (PER_REQUEST + system_tokens + shown)
                    if pending is not None:
                        return completion, replace(pending.swap, correction=max(over, 0))
                    if over > 0:
                        await self.store.add_context_tokens(token, over)
                    return completion, None
        except StaleTurn:
            raise
        except LLMUnavailable as exc:
            if exc.kind.upper() == "CONTEXT_OVERFLOW":
                problem = (
                    "the conversation does not fit the model's context window, even after "
                    f"compaction: {exc}"
                )
                await self._finish(token, profile, TaskStatus.FAILED, problem)
                return None
            decision = decide_retry(exc.kind, exc.retry_after, retries_done, profile.retry_policy)
            if isinstance(decision, RetryStep):
                await self._wait_to_retry(token, step_id, decision, exc)
                return None
            problem = f"the model could not be reached: {exc}"
        except trio.TooSlowError:
            problem = f"the model did not answer within {profile.llm_timeout_s:g} s"
        except Exception as exc:  # a port bug must not leave the Turn hanging
            log.exception("LLM port failed")
            problem = f"the model call failed: {type(exc).__name__}"
        await self._finish(token, profile, TaskStatus.FAILED, problem)
        return None

    async def _call(
        self,
        token: TurnToken,
        profile: AgentProfile,
        step_id: str,
        system: str,
        shown: PendingSwap | StepStart,
        step_no: int,
    ) -> LLMCompletion:
        """One model call for the step (streamed when the port can) on the cards of
        ``shown``: a compaction's, or the Turn's as the step read them (nothing else
        writes a running Turn's cards meanwhile). Errors propagate."""
        cards = shown.cards if isinstance(shown, PendingSwap) else [*shown.context, *shown.output]
        request = LLMRequest(
            agent=token.agent_id,
            model=profile.model,
            messages=_messages(profile, system, cards, step_no == profile.max_steps),
            max_tokens=profile.max_tokens,
        )

        def chunk(text: str) -> None:
            self.events.publish(ChunkEvent(token.agent_id, token.agent_turn_id, step_id, text))

        stream = getattr(self.llm, "stream", None)
        if stream is None:
            completion = await self.llm.complete(request)
            chunk(completion.content)
            return completion
        final: LLMCompletion | None = None
        async with stream(request) as items:
            async for item in items:
                if isinstance(item, str):
                    chunk(item)
                else:
                    final = item
        if final is None:
            raise LLMUnavailable("the model's stream ended without a result", kind="stream")
        return final

    async def _wait_to_retry(
        self, token: TurnToken, step_id: str, retry: RetryStep, exc: LLMUnavailable
    ) -> None:
        """Record the retry wait durably and let go of the Turn: the dispatcher takes the
        ``resume`` row when it is due (after a restart too); a stop ends the Turn."""
        await self.store.retry_step(
            token,
            step_id,
            attempt=retry.attempt,
            kind=exc.kind,
            delay_s=retry.delay_s,
            error=str(exc),
        )
        log.info(
            "turn %s of %s: step retry %d in %g s after %s",
            token.agent_turn_id,
            token.agent_id,
            retry.attempt,
            retry.delay_s,
            exc.kind,
        )
        self.events.publish(
            StepEvent(
                token.agent_id,
                token.agent_turn_id,
                step_id,
                "retrying",
                retry.attempt,
                exc.kind,
                retry.delay_s,
            )
        )

    async def _fence(self, token: TurnToken) -> Head:
        head = await self.store.head(token.agent_id)
        if head.token != token or head.status != HeadStatus.RUNNING:
            raise StaleTurn(f"{token} is no longer running")
        return head

    async def _finish(
        self,
        token: TurnToken,
        profile: AgentProfile,
        status: str,
        text: str,
        metadata: Mapping[str, object] | None = None,
        step: tuple[str, LLMCompletion, list[NewCard]] | None = None,
    ) -> None:
        """End the Turn with ``text``; ``step``: (step id, completion, cards) of the step
        to complete in the same transaction."""
        if self.tracing.enabled:
            span = trace.get_current_span()
            span.set_attribute("agentserver.task.status", status)
            if status != TaskStatus.SUCCEEDED:
                record_error(span, str(status))
        reply = answer_bytes(profile, text, failed=status != TaskStatus.SUCCEEDED)
        step_id, completion, cards = step or (None, None, [])
        fin = await self.store.finish(
            token,
            status,
            text,
            dict(metadata or {}),
            reply,
            step_id=step_id,
            completion=completion,
            cards=cards,
        )
        await self.ender.after(fin)

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


def _governed(profile: AgentProfile) -> bool:
    """Whether governance screens the agent's tool calls (agents/governance.py)."""
    return bool(
        profile.policy is not None or profile.guardrails or profile.loop_warn or profile.loop_block
    )


def _messages(
    profile: AgentProfile, system: str, cards: Sequence[Card], last: bool
) -> list[LLMMessage]:
    """The request's messages: the system text, the cards as the model reads them, and
    on the ``last`` step, the note saying so."""
    messages = [LLMMessage("system", system)]
    cap = profile.budget.tool_result_cap
    notes = result_annotations(cards)
    for card in cards:
        message = _card_message(card, notes, cap)
        if message is not None:
            messages.append(message)
    if last:
        messages.append(LLMMessage("user", LAST_STEP_NOTE))
    return messages


def _limit_text(output: Sequence[Card], profile: AgentProfile) -> str:
    """The failed answer at the step limit, with the last thing the model said."""
    text = f"step limit reached ({profile.max_steps} steps) without an answer"
    said = [c.content.strip() for c in output if c.card_type == CardType.LLM_MESSAGE]
    said = [t for t in said if t]
    if said:
        text += f". The model's last message: {said[-1]}"
    return text


def _system_text(profile: AgentProfile) -> str:
    system = [profile.system_prompt]
    if profile.usage_instructions:
        system.append(profile.usage_instructions)
    system.append(usage_text(profile.result_fields))
    if not profile.usage_instructions:
        # The pump's usage_instructions already end with the respond-prunes warning;
        # an agent run without them still gets it, once.
        system.append(RESPOND_WARNING)
    return "\n\n".join(system)


def _text(element: etree._Element) -> str:
    return etree.tostring(element, encoding="unicode")


def _huh_card(element: etree._Element, hint: str) -> NewCard:
    return NewCard(CardType.HUH, _text(element), {"hint": hint} if hint else {})


def _card_message(
    card: Card,
    notes: Mapping[str, Mapping[str, object]] | None = None,
    tool_result_cap: int | None = None,
) -> LLMMessage | None:
    """How a card reads in the model's context (None: not shown). ``notes``: what
    governance adds to tool results (:func:`~agentserver.agents.governance.result_annotations`).
    A tool result is cut to ``tool_result_cap`` tokens (the store keeps it whole).
    """
    t = card.card_type
    if t == CardType.TASK_INPUT:
        return LLMMessage("user", card.content)
    if t == CardType.LLM_MESSAGE:
        return LLMMessage("assistant", card.content)
    if t == CardType.TOOL_RESULT:
        to = card.metadata.get("to", "?")
        note = (notes or {}).get(str(card.metadata.get("tool_call_id")), {})
        if note.get("block"):
            return LLMMessage("user", f"Tool call to {to} failed:\nblocked: {note['block']}")
        head = f"Tool call to {to} failed:" if card.metadata.get("failed") else f"Result from {to}:"
        tail = "".join(f"\n{w}" for w in note.get("warn") or ())  # type: ignore[attr-defined]
        return LLMMessage("user", f"{head}\n{shown_text(card.content, tool_result_cap)}{tail}")
    if t == CardType.TOOL_REFUSED:
        to = card.metadata.get("to", "?")
        return LLMMessage("user", f"Tool call to {to} failed:\n{card.content}")
    if t == CardType.HUH:
        hint = card.metadata.get("hint")
        tail = f"\nHint: {hint}" if hint else ""
        return LLMMessage("user", f"Your payload was refused:\n{card.content}{tail}")
    if t == CardType.SELF_CALL:
        return LLMMessage("user", f"(self-iteration accepted; continue)\n{card.content}")
    if t == CardType.NOTE:
        return LLMMessage("user", card.content)
    if t == CardType.SUMMARY:
        return LLMMessage("user", f"Summary of the conversation so far:\n{card.content}")
    return None
