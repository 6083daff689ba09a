"""The stateless agent worker (seed 000).

A fixed number of runner tasks take agent ids from a bounded channel fed by a dispatcher
that wakes on the doorbell. A runner claims the agent's due inbox rows one at a time (in
``next_retry_at, created_at`` order) and handles each: an Enqueue starts its Turn, a tool
result or timeout is applied to the waiting set (resuming the Turn when it completes), a
``resume`` row re-runs a recovered Turn. An agent is handled by at most one runner at a
time, and the head allows one active Turn, so an agent runs one Turn at a time.

A Turn's decisions are the Turn machine's (:mod:`agentserver.agents.turn.machine`): a run
feeds it what happened and applies the effects it returns (:meth:`Worker._drive`), calling
the store, the model step, the tool dispatch and the hold; it decides nothing itself.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog
import trio

from agentserver.agents.clock import Clock
from agentserver.agents.errors import PumpRefused, StaleTurn
from agentserver.agents.events import StateEvent, StepEvent
from agentserver.agents.governance.approvals import Approvals, forward_granted
from agentserver.agents.governance.budgets import Budgets, spent
from agentserver.agents.governance.governor import Governor
from agentserver.agents.ports import LLMPort, ReplyRef, ToolPort, reply_ref_from_json
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.retry import step_retries_done
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.reading.decide import Submit, decide
from agentserver.agents.reading.parsing import extract_payloads
from agentserver.agents.reading.submit import evaluate_submit
from agentserver.agents.store.base import (
    Card,
    CardType,
    Claimed,
    InboxRow,
    NewCard,
    ReportOutcome,
    Spend,
    StepStart,
    TurnToken,
)
from agentserver.agents.store.rows import client_of
from agentserver.agents.store.served import ServedVersions
from agentserver.agents.store.sql import inbox, memory, turn_end, turns, versions
from agentserver.agents.store.sql import tools as sql_tools
from agentserver.agents.store.sql import watchdog as sql_watchdog
from agentserver.agents.store.states import MessageType
from agentserver.agents.turn.answer import answer_bytes
from agentserver.agents.turn.hold import TurnHold
from agentserver.agents.turn.machine import (
    AddCards,
    Answer,
    CallModel,
    CompleteStep,
    Crashed,
    Effect,
    EmitState,
    EmitStep,
    Event,
    Finish,
    Finished,
    ForwardGranted,
    GuardrailHalted,
    HandedOver,
    IllegalTurnEvent,
    ModelReplied,
    OpenStep,
    Recovered,
    SelfIterated,
    SelfIteration,
    SendRecordedCalls,
    SendTools,
    StepLimit,
    StepOpened,
    StepRecord,
    Stopped,
    TaskClaimed,
    ToolReported,
    TurnMachine,
    TurnState,
    Upgrade,
    element_text,
    huh_card,
)
from agentserver.agents.turn.model_context import limit_text
from agentserver.agents.turn.model_step import Completed, ModelStep
from agentserver.agents.turn.tool_dispatch import ToolDispatch
from agentserver.core.xmlsafe import SafeParser
from agentserver.primitives.core import primitive_text

log = logging.getLogger(__name__)


class _Unread:
    """The type of :data:`UNREAD`."""


#: A Turn's reply reference not read yet (None is a value: a Turn with none).
UNREAD = _Unread()


@dataclass(slots=True)
class _Run:
    """What one run of a Turn carries between the effects it applies (the shell's, not
    the machine's: the store's rows and governance's screening of the open step)."""

    token: TurnToken
    profile: AgentProfile
    reply_ref: ReplyRef | None = None
    #: The step the claim's (or resume's) transaction began, until OpenStep takes it.
    claimed: StepStart | None = None
    #: The output box as the step left it (None after a compaction: read again).
    history: Sequence[Card] | None = None

    def ref(self) -> ReplyRef:
        """The Turn's reply reference, which a call through the pump needs (a Turn
        without one cannot call: the run fails, as an internal error)."""
        if self.reply_ref is None:
            raise LookupError(f"turn {self.token.agent_turn_id} has no reply reference")
        return self.reply_ref


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
        served: ServedVersions | None = None,
    ) -> None:
        self.hold = hold
        #: This process's agent versions (the store's): a draining process hands its
        #: ``upgrade`` Turns over at their next step (docs/deploy.md).
        self.served = served or ServedVersions()
        self.tracing = hold.tracing
        self.ender = hold.ender
        self.store = hold.ender.store
        self.profiles = hold.ender.profiles
        self.events = hold.ender.events
        self.doorbell = hold.ender.doorbell
        self.tools = tools
        self.clock = clock
        self.settings = settings
        self.governor = Governor(self.store, clock)
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
        #: Turns a report resumed in this process (:meth:`hand_over`), by agent, until a
        #: runner takes the agent: one entry per agent at most (an agent has one active
        #: Turn), so bounded by the agents.
        self._handed: dict[str, ReportOutcome] = {}

    def hand_over(self, outcome: ReportOutcome) -> None:
        """Run a Turn that a report resumed as it was recorded (``outcome.resumed``),
        as a claimed report row would be: the agent's runner takes it before its next
        claim. Never blocks. Lost only with the process, whose recovery re-runs the Turn
        (it is a running one)."""
        if outcome.resumed is not None:
            self._handed[outcome.resumed.agent_id] = outcome
            self.doorbell.ring()

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
                due = await self.store.read(inbox.due_agents, self.settings.claim_batch)
                for agent_id in (*self._handed, *due):
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
        while True:
            handed = self._handed.pop(agent_id, None)
            if handed is not None:
                # Resumed by a report as it was recorded: what a claim of it would give.
                profile = self.profiles.get(agent_id)
                more = await self._reported(handed, profile) if profile else True
            elif (claimed := await self._claim(agent_id)) is not None:
                more = await self._handle_claimed(claimed)
            else:
                return handled
            handled += 1
            if not (more or poll_waiting):
                return handled

    async def _claim(self, agent_id: str) -> Claimed | None:
        """The agent's next due row, claimed with its first step taken in the same
        transaction where the store can (``claim_next``); if that raises (the Turn moved
        on, or anything else: the claim rolled back with it), the row claimed alone, so
        that :meth:`handle_row` takes the step the old way and meets what raised."""
        profile = self.profiles.get(agent_id)
        if profile is not None:
            try:
                return await self.store.claim_next(
                    agent_id,
                    profile.max_steps,
                    bool(profile.guardrails),
                    self.task_problem,
                    self.model.hold_for(profile),
                )
            except StaleTurn:
                pass
            except Exception:
                log.warning(
                    "agent %s: claiming with its first step failed", agent_id, exc_info=True
                )
        rows = await self.store.run1(inbox.claim_due, agent_id, 1)
        return Claimed(rows[0]) if rows else None

    async def _handle_claimed(self, claimed: Claimed) -> bool:
        """:meth:`handle_row` for a row claimed with its first step taken (or not)."""
        row, profile = claimed.row, self.profiles.get(claimed.row.agent_id)
        if claimed.report is not None:
            # Applied already: never handed to handle_row, which would apply it again.
            return await self._reported(claimed.report, profile) if profile else True
        if (claimed.step is not None or claimed.started) and profile and row.token:
            return await self._run_turn(
                row.token, profile, ref_json=row.reply_ref_json, step=claimed.step, started=True
            )
        return await self.handle_row(row)

    # -- rows ---------------------------------------------------------------------------
    async def handle_row(self, row: InboxRow) -> bool:
        """Handle one claimed (``processing``) inbox row. False when it left the Turn
        waiting for its tools with no report due yet (see :meth:`process_agent`)."""
        if row.message_type == MessageType.TURN:
            return await self._start(row)
        if row.message_type in (MessageType.TOOL_RESULT, MessageType.TIMEOUT):
            profile = self.profiles.get(row.agent_id)
            then_step = profile.resume_step_limit if profile else None
            outcome = await self.store.run(sql_tools.apply_report, row, then_step=then_step)
            if profile is None:
                # (unreachable in practice, a Turn exists only for a known agent)
                return True
            return await self._reported(outcome, profile)
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
            token = await self.store.run(turns.take_resume, row)
            profile = self.profiles.get(row.agent_id)
            if token is not None and profile is not None:
                retries = step_retries_done(row.payload)
                return await self._run_turn(token, profile, retries, recovered=not retries)
        else:
            await self.store.run1(turns.skip_row, row, f"unknown message type {row.message_type!r}")
        return True

    async def _reported(self, outcome: ReportOutcome, profile: AgentProfile) -> bool:
        """Go on from a tool report applied (its waiting set, and the next step when it
        resumed the Turn): run the Turn, or end it when a tool of the set ends it."""
        if outcome.resumed is None:
            return True
        if outcome.terminate_card_id is not None:
            card = await self.store.read(memory.card, outcome.terminate_card_id)
            report = ToolReported(True, terminate_text=card.content if card else "")
            run = _Run(outcome.resumed, profile)
            for effect in TurnMachine(TurnState.SUSPENDED).send(report):
                await self._apply(run, effect)
            return True
        return await self._run_turn(
            outcome.resumed,
            profile,
            ref_json=outcome.reply_ref_json,
            step=outcome.step,
            resumed=True,
        )

    async def _start(self, row: InboxRow) -> bool:
        profile = self.profiles.get(row.agent_id)
        problem = "no such agent" if profile is None else self.task_problem(row)
        if problem is not None:
            # A failed task is answered only if its reference can say where to.
            reply = (
                answer_bytes(profile, problem, failed=True)
                if profile and _readable(row.reply_ref_json)
                else None
            )
            fin = await self.store.run(turn_end.fail_turn_row, row, problem, reply)
            if fin is not None:
                await self.ender.after(fin)
            return True
        assert profile is not None and row.token is not None
        step: StepStart | None = None
        try:
            if profile.guardrails:  # they judge the cards before each step begins
                token = await self.store.run(turns.start_turn, row)
            else:
                step = await self.store.run(turns.start_turn_step, row, profile.max_steps)
                token = row.token
        except StaleTurn:
            await self.store.run1(turns.skip_row, row, "turn no longer dispatched")
            return True
        # The reference was read with the row: the Turn's own (its Enqueue).
        return await self._run_turn(
            token, profile, ref_json=row.reply_ref_json, step=step, started=True
        )

    def hands_over(self, profile: AgentProfile) -> bool:
        """Whether a run of ``profile``'s Turn lets go before its next step, for a process
        serving the agent's newest version to take it (docs/deploy.md): this process
        drains, or a live process serves a newer version, and the Turn is not pinned."""
        return profile.versioning != "pinned" and not self.served.takes_new(profile.name)

    @property
    def busy(self) -> int:
        """How many Turns this process's runners are in, or were handed to run."""
        return len(self._runs) + len(self._handed)

    def task_problem(self, row: InboxRow) -> str | None:
        """Why a claimed task row cannot start its Turn (:func:`task_problem`), and for a
        task queued by a process serving another version of its agent, whether this
        version takes it (docs/deploy.md): its answer is then ``failed``, with the
        reason. No I/O (it runs inside the claim's transaction): the pump's check only."""
        problem = task_problem(row)
        profile = self.profiles.get(row.agent_id)
        if problem is not None or profile is None or row.version in (None, profile.version):
            return problem
        try:
            self.tools.check_task(row.agent_id, SafeParser().parse(row.payload))
        except PumpRefused as refused:
            # The primitive's canned words (a refusal's detail is for the log only).
            said = primitive_text(refused.element) or "refused"
            return (
                f"version {profile.version} of {row.agent_id} does not take this task "
                f"(queued on version {row.version}): {said}"
            )
        return None

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
        resumed: bool = False,
        started: bool = False,
    ) -> bool:
        """Run the Turn until it suspends, waits or ends. ``ref_json``: its reply
        reference if the caller read it already; ``step``: its first step if begun;
        ``recovered``: a restart's resume (a last step's calls cut off are sent first);
        ``resumed``: its waiting set just completed; ``started``: its Enqueue just
        claimed. False when it suspended with no report due yet.

        Cancelled by :meth:`interrupt` (a stop that ended the Turn): the run, its model
        call included, unwinds at its next checkpoint and returns True; a store write
        already under way completes (it is atomic), and the store's fence refuses it."""
        # A stop cancels this scope (interrupt): the Turn has ended in the store already.
        with trio.CancelScope() as scope:
            self._runs[token.agent_id] = (token.agent_turn_id, scope)
            try:
                # The machine in the state the Turn is in durably, and what just happened.
                first: Event
                state = TurnState.IDLE
                if recovered:
                    first = Recovered()
                elif resumed:
                    state, first = TurnState.SUSPENDED, ToolReported(True, step is not None)
                elif retries_done:
                    state, first = TurnState.RETRY_WAIT, TaskClaimed(retries_done=retries_done)
                else:
                    first = TaskClaimed(step_begun=step is not None, started=started)
                machine = TurnMachine(
                    state, budgeted=self.model.budgets is not None, version=profile.version
                )
                run = _Run(token, profile, claimed=step)
                return await self._run_turn_logged(run, machine, first, ref_json)
            finally:
                if self._runs.get(token.agent_id, (None, None))[1] is scope:
                    del self._runs[token.agent_id]
        log.info(
            "turn %s of %s was stopped; its run was cancelled", token.agent_turn_id, token.agent_id
        )
        return True

    async def _run_turn_logged(
        self, run: _Run, machine: TurnMachine, first: Event, ref_json: str | _Unread | None
    ) -> bool:
        """:meth:`_run_turn` in the Turn's log context."""
        token = run.token
        # Every log record of this run names the agent and Turn (and, once read from the
        # task's reference, its threads).
        with structlog.contextvars.bound_contextvars(
            agent=token.agent_id, turn=token.agent_turn_id
        ):
            # The first event's effects are decided before any I/O, so that a failure of
            # the run from here on is the machine's (Crashed) in every state it can be in.
            effects = machine.send(first)
            try:
                if isinstance(ref_json, _Unread):
                    ref_json = await self.store.read(turns.turn_reply_ref, token)
                run.reply_ref = reply_ref_from_json(ref_json) if ref_json else None
                # (A test's store may hold any JSON there.)
                ref: Mapping[str, object] = run.reply_ref if isinstance(run.reply_ref, dict) else {}
                thread = _text(ref.get("caller_thread"))
                # One span per run of the Turn; the trace context came with the task
                # (see bridge.agent_handler), so it survives a restart.
                with (
                    self.tracing.invoke_agent(
                        token.agent_id, token.agent_turn_id, thread, _text(ref.get("traceparent"))
                    ),
                    structlog.contextvars.bound_contextvars(
                        thread=ref.get("hop"), caller_thread=thread
                    ),
                ):
                    return await self._drive(run, machine, effects)
            except StaleTurn:
                machine.send(Stopped("fenced"))
                log.info("turn %s of %s moved on; dropping it", token.agent_turn_id, token.agent_id)
            except trio.Cancelled:
                raise
            except Exception as exc:
                log.exception("turn %s of %s failed", token.agent_turn_id, token.agent_id)
                try:
                    effects = machine.send(Crashed(type(exc).__name__))
                except IllegalTurnEvent:  # it let go of the Turn or ended it already
                    effects = []
                try:
                    for effect in effects:
                        await self._apply(run, effect)
                except StaleTurn:
                    pass
        return True

    async def _drive(self, run: _Run, machine: TurnMachine, effects: list[Effect]) -> bool:
        """Apply the machine's effects, feeding it what each call came to, until the run
        lets go of the Turn or ends it; False when it suspended with no report due yet.
        Raises StaleTurn when fenced out."""
        while True:
            event: Event | None = None
            for effect in effects:
                event = await self._apply(run, effect) or event
            if event is None:
                assert machine.resting, f"the machine waits in {machine.state}"
                return machine.report_due
            effects = machine.send(event)

    async def _apply(self, run: _Run, effect: Effect) -> Event | None:
        """Apply one effect; the event it came to, if it is a call the machine waits on.
        The model calls' spends an effect writes with its step are settled by themselves
        if it fails before their transaction commits (a fence, a crash, a cancel)."""
        try:
            return await self._apply_effect(run, effect)
        except BaseException:
            spends = _spends_of(effect)
            if spends and self.model.budgets is not None:
                await self.model.budgets.settle_spends(spends)  # (shielded)
            raise

    async def _apply_effect(self, run: _Run, effect: Effect) -> Event | None:
        token, profile = run.token, run.profile
        match effect:
            case EmitStep(step_id, phase):
                self.events.publish(StepEvent(token.agent_id, token.agent_turn_id, step_id, phase))
            case EmitState(status, activity):
                self.events.publish(
                    StateEvent(token.agent_id, token.agent_turn_id, status, activity)
                )
            case OpenStep(begun):
                step, run.claimed = (run.claimed, None) if begun else (None, None)
                if step is None and self.hands_over(profile):
                    await self.store.run(sql_watchdog.recover_turn, token, self.clock.now())
                    self.doorbell.ring()
                    log.info("turn %s handed over to the newest version", token.agent_turn_id)
                    return HandedOver()
                if step is None:
                    opened = await self._open_step(token, profile)
                    if isinstance(opened, GuardrailHalted):
                        return opened
                    step = opened
                if step.step_id is None:
                    return StepLimit(limit_text(step.output, profile))
                run.history = None
                return StepOpened(step)
            case Upgrade(was, now):
                await self.store.run(versions.upgrade_turn, token, was)
                log.info(
                    "turn %s continues on version %s (begun on %s)", token.agent_turn_id, now, was
                )
            case CallModel(step, retries_done, reserve):
                assert step.step_id is not None
                # Her budgets, whichever door she came in by (socket, HTTP, A2A).
                done = await self.model.complete(
                    self.llm,
                    token,
                    step.head,
                    profile,
                    step.step_id,
                    retries_done,
                    step,
                    client_of(run.reply_ref),
                    reserve=reserve,
                )
                if not isinstance(done, Completed):
                    return done
                # The output box as the step leaves it (past_calls reads only tool calls
                # and refusals, which the step's own card is not); read again after a swap.
                run.history = step.output if done.swap is None else None
                content = done.completion.content
                decision = decide(content, extract_payloads(content, profile), profile)
                answer = _submitted(decision, profile) if isinstance(decision, Submit) else None
                return ModelReplied(
                    step.step_id, done.completion, done.swap, decision, answer, done.spends
                )
            case CompleteStep(step_id, completion, cards, swap, spends):
                await self.store.run(
                    turns.complete_step, token, step_id, completion, list(cards), swap, spends
                )
                spent(self.events, spends)
            case AddCards(cards):
                await self.store.run(turns.add_cards, token, list(cards))
            case SelfIteration(payload):
                await self.hold.fence(token)
                try:
                    await self.tools.self_iterate(token.agent_id, run.ref(), payload.element)
                except PumpRefused as refused:
                    return SelfIterated(huh_card(refused.element, ""))
                return SelfIterated(NewCard(CardType.SELF_CALL, element_text(payload.element)))
            case SendTools(step_id, step_no, calls, step):
                return await self.tool_calls.call(
                    token,
                    step_id,
                    step_no,
                    profile,
                    run.ref(),
                    calls,
                    run.history,
                    step,
                    approvals=self.approvals,
                )
            case SendRecordedCalls():
                return await self.tool_calls.call_recorded(
                    token, profile, run.ref(), approvals=self.approvals
                )
            case Finish(status, text, meta, last):
                written = None
                if last is not None:
                    written = (last.step_id, last.completion, list(last.cards), last.spends)
                await self.hold.finish(token, profile, status, text, meta, written)
                return Finished()
            case ForwardGranted():
                # Approval rows are forwarded by forward_granted (handle_row), not by a run.
                raise AssertionError("a run of a Turn forwards no approval")
        return None

    async def _open_step(
        self, token: TurnToken, profile: AgentProfile
    ) -> StepStart | GuardrailHalted:
        """Begin the next step (:func:`~agentserver.agents.store.sql.turns.open_step`), after the ``after``
        guardrails judged the results so far (:class:`GuardrailHalted` when they halt)."""
        if profile.guardrails:
            head = await self.hold.fence(token)
            if head.output_box_id:
                cards = await self.store.read(memory.cards, head.output_box_id)
                halt = await self.governor.guard_results(token, head.step_count, profile, cards)
                if halt is not None:
                    return GuardrailHalted(halt)
        return await self.store.run(turns.open_step, token, profile.max_steps)


def _spends_of(effect: Effect) -> tuple[Spend, ...]:
    """The model calls' spends ``effect`` writes with its step (none: it writes no step)."""
    match effect:
        case CompleteStep(spends=spends):
            return spends
        case (
            SendTools(step=StepRecord(spends=spends)) | Finish(last_step=StepRecord(spends=spends))
        ):
            return spends
    return ()


def task_problem(row: InboxRow) -> str | None:
    """Why a claimed task row cannot start its Turn, or None. Pure (it runs inside the
    claim's transaction, :meth:`Worker._claim`)."""
    if row.token is None:
        return "the task carries no Turn"
    try:
        SafeParser().parse(row.payload)
    except Exception:
        return "the task payload is not well-formed XML"
    if not _readable(row.reply_ref_json):
        return "the task's reply reference is unreadable"
    return None


def _submitted(decision: Submit, profile: AgentProfile) -> Answer:
    """The answer text and deliverable metadata of a ``submit_result`` call."""
    outcome = evaluate_submit(decision.payload.element, profile.result_fields)
    if outcome.warnings:
        log.warning("submit_result degraded: %s", "; ".join(outcome.warnings))
    meta = {
        "fields": dict(outcome.fields),
        "degraded": outcome.degraded,
        "warnings": list(outcome.warnings),
    }
    return Answer(outcome.as_text(), meta)


def _text(value: object) -> str | None:
    """A reply reference's entry read for logs and traces: a string, or None."""
    return value if isinstance(value, str) else None


def _readable(ref_json: str | None) -> bool:
    """Whether a stored reply reference is JSON at all."""
    try:
        json.loads(ref_json or "")
    except ValueError:
        return False
    return True
