"""The sans-IO Turn machine (agents/turn/machine.py), without I/O.

A hypothesis ``RuleBasedStateMachine`` plays the world around one Turn: it answers each
effect the machine asks for (a step opened or the limit, the model's reply or failure, the
tools' outcome, the end written or fenced out), delivers tool reports (duplicates too),
approval decisions, stops and double texts at any moment, and checks the Turn's promises
as invariants:

- every task is answered exactly once: by the machine's one applied :class:`Finish`, or by
  whoever stopped it; never twice, and once whenever the Turn has ended;
- no tool call is sent twice (a call's idempotency key, an approval's forward);
- a stopped Turn ends, and nothing is called or sent after the stop;
- a budget is never overspent beyond one call's worst case: each model call carries its
  reservation, the world refuses one without room, and a refused Turn calls no more.

Plain tests then pin specific transitions and the table's shape.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from lxml import etree

from agentserver.agents.ports import LLMCompletion
from agentserver.agents.reading.decide import (
    CallTools,
    Deliver,
    Feedback,
    RequireTool,
    SelfIterate,
    Submit,
)
from agentserver.agents.reading.parsing import FoundPayload, PayloadError, PayloadKind
from agentserver.agents.store.base import BoxSwap, CardType, Head, NewCard, StepStart, TaskStatus
from agentserver.agents.turn import machine as tm
from agentserver.agents.turn.machine import (
    TURN_TRANSITIONS,
    AddCards,
    Answer,
    ApprovalDecided,
    BudgetRefused,
    CallModel,
    CompleteStep,
    Crashed,
    DoubleText,
    EmitStep,
    EventType,
    Finish,
    Finished,
    ForwardGranted,
    GuardrailHalted,
    HandedOver,
    IllegalTurnEvent,
    ModelFailed,
    ModelReplied,
    NoToolsSent,
    OpenStep,
    Recovered,
    RetryScheduled,
    SelfIterated,
    SelfIteration,
    SendRecordedCalls,
    SendTools,
    StepLimit,
    StepOpened,
    StepTimedOut,
    Stopped,
    TaskClaimed,
    ToolReported,
    ToolsSent,
    TurnMachine,
    TurnState,
    Upgrade,
)
from agentserver.core.errors import HuhReason

#: Effects the world answers with the next event (at most one per event).
CALLS = (OpenStep, CallModel, SendTools, SendRecordedCalls, SelfIteration, Finish)

LIMIT = 6  # the budget's limit (the agent's, over its Turns)
WORST = 2  # one model call's worst case (its reservation)


def _head(step_no: int) -> Head:
    return Head("a", "running", "t", 1, "i", "c", "o", step_no, 0, None, None, 0.0, 0.0)


def _step(step_no: int) -> StepStart:
    return StepStart(_head(step_no), f"step-{step_no}", step_no, (), ())


def _payload(kind: PayloadKind, to: str | None = None) -> FoundPayload:
    element = etree.Element("{urn:x}p")
    return FoundPayload(kind, element, "{urn:x}p", to, "<p/>")


_SWAP = BoxSwap(NewCard(CardType.SUMMARY, "s"), ())

#: Decisions that go on first (hypothesis favours the first elements): long Turns.
DECISIONS = st.sampled_from(
    [
        CallTools((_payload(PayloadKind.TOOL, "calc"), _payload(PayloadKind.TOOL, "calc"))),
        Feedback((PayloadError(HuhReason.INVALID_PAYLOAD, "hint", "<x/>"),)),
        RequireTool("call submit_result"),
        SelfIterate(_payload(PayloadKind.SELF)),
        Deliver("the answer"),
        Submit(_payload(PayloadKind.SUBMIT)),
    ]
)

ALL_EVENTS: list[tm.Event] = [
    TaskClaimed(),
    TaskClaimed(step_begun=True, started=True),
    Recovered(),
    StepOpened(_step(99)),
    StepLimit("limit"),
    GuardrailHalted("no"),
    ModelReplied("step-99", LLMCompletion("x"), None, Deliver("x")),
    ModelReplied("step-99", LLMCompletion("x"), None, CallTools(())),
    ModelReplied("step-99", LLMCompletion("x"), None, SelfIterate(_payload(PayloadKind.SELF))),
    ModelReplied("step-99", LLMCompletion("x"), None, RequireTool("n")),
    ModelFailed("down"),
    RetryScheduled(),
    BudgetRefused("budget"),
    StepTimedOut("slow"),
    SelfIterated(NewCard(CardType.SELF_CALL, "x")),
    ToolsSent(False),
    ToolsSent(True, approvals=True),
    NoToolsSent(),
    ToolReported(False),
    ToolReported(True),
    ToolReported(True, terminate_text="t"),
    ApprovalDecided("r", True),
    ApprovalDecided("r", False),
    Finished(),
    Crashed("E"),
    Stopped(),
    HandedOver(),
    DoubleText("enqueue"),
    DoubleText("interrupt"),
]
ANY_EVENT = st.sampled_from(ALL_EVENTS)


def _step_written(effect: tm.Effect) -> str | None:
    """The step whose reply ``effect`` writes, if it writes one (each exactly once: by
    CompleteStep, with the suspend in SendTools, or with the Turn's end in Finish)."""
    if isinstance(effect, CompleteStep):
        return effect.step_id
    if isinstance(effect, SendTools) and effect.step is not None:
        return effect.step.step_id
    if isinstance(effect, Finish) and effect.last_step is not None:
        return effect.last_step.step_id
    return None


class TurnPromises(RuleBasedStateMachine):
    """The world around one Turn, and the Turn's promises as invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.spent = 0  # the agent's budget, over its Turns

    @initialize(recovered=st.booleans(), begun=st.booleans(), started=st.booleans())
    def claim(self, recovered: bool, begun: bool, started: bool) -> None:
        self.new_turn(recovered, begun, started)

    @precondition(lambda self: self.m.state == TurnState.ENDED)
    @rule(recovered=st.booleans(), begun=st.booleans(), started=st.booleans())
    def new_turn(self, recovered: bool, begun: bool, started: bool) -> None:
        """The next Turn (its own machine, answer and keys; the same budget)."""
        if hasattr(self, "m"):
            assert self.feed(Stopped("late")) == []  # a late stop finds the Turn ended
        self.m = TurnMachine(budgeted=True)
        self.pending: object | None = None  # the effect the world answers next
        self.answers = 0
        self.ended_by_other = False
        self.refused = False
        self.sent_keys: set[str] = set()
        self.written: set[str] = set()  # the steps whose reply an effect writes
        self.forwarded: set[str] = set()
        self.steps = 0
        self.feed(Recovered() if recovered else TaskClaimed(step_begun=begun, started=started))

    # -- the world's bookkeeping --------------------------------------------------------
    def feed(self, event: tm.Event) -> list[tm.Effect]:
        before = self.m.state
        effects = self.m.send(event)
        if event.type in (EventType.STOPPED, EventType.DOUBLE_TEXT_INTERRUPTS):
            if before != TurnState.ENDED:
                self.answers += 1  # the stopper (or the newer task) answered it
            self.ended_by_other = True
            self.pending = None
        elif event.type == EventType.FINISHED:
            self.answers += 1
        calls = [e for e in effects if isinstance(e, CALLS)]
        assert len(calls) <= 1, f"one call at a time, got {calls}"
        if self.ended_by_other:
            assert effects == [], f"a stopped Turn did {effects}"
        for effect in effects:
            written = _step_written(effect)
            if written is not None:
                assert written not in self.written, f"step {written} written twice"
                self.written.add(written)
            if isinstance(effect, SendTools):
                for key in effect.keys:
                    assert key not in self.sent_keys, f"tool call {key} sent twice"
                    self.sent_keys.add(key)
            if isinstance(effect, ForwardGranted):
                assert effect.request_id not in self.forwarded, "approval forwarded twice"
                self.forwarded.add(effect.request_id)
            if isinstance(effect, CallModel):
                assert not self.refused, "a model call after the budget refused"
                assert effect.reserve, "a model call without its reservation"
            if isinstance(effect, Finish):
                assert self.answers == 0, "a second answer"
        if calls:
            self.pending = calls[0]
        elif self.m.resting:
            self.pending = None
        return effects

    def waiting_for(self, kind: type | tuple[type, ...]) -> bool:
        return isinstance(self.pending, kind)

    # -- answering the machine's calls ---------------------------------------------------
    @precondition(lambda self: self.pending is not None)
    @rule(data=st.data())
    def answer(self, data: st.DataObject) -> None:
        """The world answers the effect the machine asked for (one rule for all, so that
        a run goes far)."""
        pending = self.pending
        # Instead of the answer, now and then: the Turn stopped, interrupted by a double
        # text, a double text that leaves it alone, or a crash of the run.
        meanwhile = data.draw(
            st.sampled_from(["answer"] * 6 + ["stop", "interrupt", "queued", "crash"])
        )
        if meanwhile == "crash":
            self.feed(Crashed("RuntimeError"))
            return
        if meanwhile == "stop":
            self.feed(Stopped("stop"))
            return
        if meanwhile == "interrupt":
            self.feed(DoubleText("interrupt"))
            return
        if meanwhile == "queued":
            self.feed(DoubleText("enqueue"))
            return
        if isinstance(pending, OpenStep):
            self.open_step(data.draw(st.sampled_from(["opened"] * 3 + ["limit", "halted"])))
        elif isinstance(pending, CallModel):
            self.model(
                data.draw(DECISIONS),
                data.draw(st.booleans()),
                data.draw(st.sampled_from([WORST, WORST, 1, 0])),
                data.draw(st.sampled_from([None] * 6 + ["failed", "retry", "timeout"])),
            )
        elif isinstance(pending, SendTools | SendRecordedCalls):
            outcome = st.sampled_from(["sent", "approval", "approval", "none", "halted"])
            self.tools(data.draw(outcome), data.draw(st.booleans()))
        elif isinstance(pending, SelfIteration):
            self.self_iterated()
        else:
            assert isinstance(pending, Finish)
            self.finish(data.draw(st.sampled_from(["written", "written", "crashed", "fenced"])))

    def open_step(self, outcome: str) -> None:
        if outcome == "opened":
            self.steps += 1
            self.feed(StepOpened(_step(self.steps)))
        elif outcome == "limit":
            self.feed(StepLimit("step limit reached"))
        else:
            self.feed(GuardrailHalted("after-guardrail"))

    def model(self, decision: tm.Decision, swap: bool, cost: int, failure: str | None) -> None:
        call = self.pending
        assert isinstance(call, CallModel)
        assert call.step.step_id is not None
        if call.reserve:
            if self.spent + WORST > LIMIT:
                self.refused = True
                self.feed(BudgetRefused("budget: no room"))
                return
        if failure == "failed":
            self.feed(ModelFailed("the model could not be reached"))
        elif failure == "retry":
            self.feed(RetryScheduled())
        elif failure == "timeout":
            self.feed(StepTimedOut("the model did not answer"))
        else:
            self.spent += cost
            answer = Answer("submitted", {"fields": {}}) if isinstance(decision, Submit) else None
            completion = LLMCompletion("reply")
            self.feed(
                ModelReplied(
                    call.step.step_id, completion, _SWAP if swap else None, decision, answer
                )
            )

    def tools(self, outcome: str, due: bool) -> None:
        if outcome == "sent":
            self.feed(ToolsSent(due))
        elif outcome == "approval":
            self.feed(ToolsSent(due, approvals=True))
        elif outcome == "none":
            self.feed(NoToolsSent())
        else:
            self.feed(GuardrailHalted("before-guardrail"))

    def self_iterated(self) -> None:
        self.feed(SelfIterated(NewCard(CardType.SELF_CALL, "<p/>")))

    def finish(self, outcome: str) -> None:
        if outcome == "written":
            self.feed(Finished())
        elif outcome == "crashed":  # nothing written: the run tries once more
            self.feed(Crashed("StoreError"))
        else:  # the store's compare-and-set: someone else ended it meanwhile
            self.feed(Stopped("fenced"))

    # -- the world acting on its own ----------------------------------------------------
    @precondition(lambda self: self.m.state in (TurnState.SUSPENDED, TurnState.AWAITING_APPROVAL))
    @rule(
        resumed=st.booleans(),
        terminate=st.booleans(),
        begun=st.booleans(),
        duplicates=st.integers(0, 2),
    )
    def report(self, resumed: bool, terminate: bool, begun: bool, duplicates: int) -> None:
        for _ in range(duplicates):  # re-delivered reports that do not complete the set
            self.feed(ToolReported(False))
        self.feed(ToolReported(resumed, begun, "the tool's result" if terminate else None))

    @precondition(lambda self: self.m.state == TurnState.AWAITING_APPROVAL)
    @rule(request=st.sampled_from(["r1", "r2"]), granted=st.booleans())
    def approval(self, request: str, granted: bool) -> None:
        self.feed(ApprovalDecided(request, granted))

    @precondition(lambda self: self.m.state == TurnState.RETRY_WAIT)
    @rule(begun=st.booleans())
    def retry_due(self, begun: bool) -> None:
        self.feed(TaskClaimed(step_begun=begun, retries_done=1))

    @precondition(lambda self: self.pending is None and self.m.state != TurnState.ENDED)
    @rule(reason=st.sampled_from(["stop", "cancel", "watchdog", "fenced"]))
    def stop(self, reason: str) -> None:
        self.feed(Stopped(reason))

    @precondition(lambda self: self.pending is None and self.m.state != TurnState.ENDED)
    @rule(mode=st.sampled_from(["enqueue", "reject", "interrupt", "rollback"]))
    def double_text(self, mode: str) -> None:
        self.feed(DoubleText(mode))

    @rule(event=ANY_EVENT, now=st.integers(0, 7))
    def illegal_event(self, event: tm.Event, now: int) -> None:
        if now != 7 or (self.m.state, event.type) in TURN_TRANSITIONS:
            return  # (not assume(): that would end the run)
        before = self.m.state
        with pytest.raises(IllegalTurnEvent):
            self.m.send(event)
        assert self.m.state == before

    # -- the promises ---------------------------------------------------------------------
    @invariant()
    def answered_exactly_once(self) -> None:
        assert self.answers <= 1
        assert (self.answers == 1) == (self.m.state == TurnState.ENDED)

    @invariant()
    def budget_not_overspent(self) -> None:
        assert self.spent <= LIMIT + WORST

    @invariant()
    def the_world_knows_what_to_answer(self) -> None:
        # A Turn the run holds always waits for exactly one answer from the world.
        if self.m.state in (
            TurnState.RECOVERING,
            TurnState.OPENING,
            TurnState.AWAITING_MODEL,
            TurnState.SELF_ITERATING,
            TurnState.AWAITING_TOOLS,
            TurnState.FINISHING,
        ):
            assert self.pending is not None


TurnPromises.TestCase.settings = settings(max_examples=800, stateful_step_count=80, deadline=None)
test_turn_promises = TurnPromises.TestCase


# -- plain transitions ---------------------------------------------------------------------


def _opened(m: TurnMachine) -> None:
    assert m.send(TaskClaimed()) == [OpenStep(False)]
    effects = m.send(StepOpened(_step(1)))
    assert effects[-1] == CallModel(_step(1), 0, False)
    assert m.state == TurnState.AWAITING_MODEL


def test_an_answer_without_compaction_is_written_with_the_turns_end():
    m = TurnMachine()
    _opened(m)
    effects = m.send(ModelReplied("step-1", LLMCompletion("hi"), None, Deliver("hi")))
    assert [type(e) for e in effects] == [EmitStep, Finish]
    finish = effects[-1]
    assert isinstance(finish, Finish)
    assert finish.status == TaskStatus.SUCCEEDED and finish.text == "hi"
    assert finish.last_step is not None and finish.last_step.step_id == "step-1"
    assert m.state == TurnState.FINISHING
    assert m.send(Finished()) == [] and m.state == TurnState.ENDED


def test_a_step_that_calls_tools_is_written_with_its_suspend_then_sent_with_keys():
    m = TurnMachine()
    _opened(m)
    calls = (_payload(PayloadKind.TOOL, "calc"), _payload(PayloadKind.TOOL, "calc"))
    effects = m.send(ModelReplied("step-1", LLMCompletion("c"), None, CallTools(calls)))
    # No CompleteStep of its own: the step's reply rides in SendTools (one transaction).
    assert not any(isinstance(e, CompleteStep) for e in effects)
    send = effects[-1]
    assert isinstance(send, SendTools) and send.keys == ("step-1:0", "step-1:1")
    assert send.step is not None and send.step.step_id == "step-1"
    assert [c.card_type for c in send.step.cards] == [CardType.LLM_MESSAGE]
    assert m.send(ToolsSent(report_due=False)) == []
    assert m.resting and not m.report_due
    # a report that does not complete the set changes nothing; the resume opens a step
    assert m.send(ToolReported(False)) == []
    assert m.send(ToolReported(True, step_begun=True)) == [OpenStep(True)]


def test_after_a_compaction_calls_are_screened_once_the_step_is_complete():
    m = TurnMachine()
    _opened(m)
    calls = (_payload(PayloadKind.TOOL, "calc"),)
    effects = m.send(ModelReplied("step-1", LLMCompletion("c"), _SWAP, CallTools(calls)))
    assert isinstance(effects[0], CompleteStep) and effects[0].swap is _SWAP
    assert isinstance(effects[-1], SendTools) and effects[-1].step is None


def test_feedback_adds_huh_cards_and_opens_the_next_step():
    m = TurnMachine()
    _opened(m)
    errors = (PayloadError(HuhReason.INVALID_PAYLOAD, "the hint", "<x/>"),)
    effects = m.send(ModelReplied("step-1", LLMCompletion("c"), None, Feedback(errors)))
    assert [type(e) for e in effects] == [CompleteStep, EmitStep, AddCards, EmitStep, OpenStep]
    cards = effects[2]
    assert isinstance(cards, AddCards)
    assert cards.cards[0].card_type == CardType.HUH and cards.cards[0].metadata == {
        "hint": "the hint"
    }


def test_budget_refused_step_limit_and_halts_end_the_turn_failed():
    for event, text in (
        (BudgetRefused("budget: agent a spent"), "budget: agent a spent"),
        (StepTimedOut("the model did not answer"), "the model did not answer"),
        (ModelFailed("unreachable"), "unreachable"),
    ):
        m = TurnMachine(budgeted=True)
        _ = m.send(TaskClaimed())
        assert m.send(StepOpened(_step(1)))[-1] == CallModel(_step(1), 0, True)
        assert m.send(event) == [Finish(TaskStatus.FAILED, text)]
    m = TurnMachine()
    m.send(TaskClaimed())
    assert m.send(StepLimit("step limit")) == [Finish(TaskStatus.FAILED, "step limit")]
    m = TurnMachine()
    m.send(TaskClaimed())
    assert m.send(GuardrailHalted("no")) == [Finish(TaskStatus.FAILED, "halted: no")]


def test_a_retry_wait_lets_go_and_its_resume_calls_with_the_retries_done():
    m = TurnMachine()
    _opened(m)
    assert m.send(RetryScheduled()) == [] and m.resting
    m.send(TaskClaimed(retries_done=2))
    assert m.send(StepOpened(_step(1)))[-1] == CallModel(_step(1), 2, False)


def test_a_stop_ends_the_turn_and_nothing_follows():
    m = TurnMachine()
    _opened(m)
    assert m.send(Stopped()) == [] and m.state == TurnState.ENDED
    with pytest.raises(IllegalTurnEvent):
        m.send(ModelReplied("step-1", LLMCompletion("x"), None, Deliver("x")))
    assert m.send(Stopped()) == []  # a second stop finds it ended


def test_a_double_text_leaves_the_turn_or_ends_it():
    m = TurnMachine()
    _opened(m)
    assert m.send(DoubleText("enqueue")) == [] and m.state == TurnState.AWAITING_MODEL
    assert m.send(DoubleText("interrupt")) == [] and m.state == TurnState.ENDED


def test_a_granted_approval_is_forwarded_once():
    m = TurnMachine(TurnState.AWAITING_APPROVAL)
    assert m.send(ApprovalDecided("r1", True)) == [ForwardGranted("r1")]
    assert m.send(ApprovalDecided("r1", True)) == []
    assert m.send(ApprovalDecided("r2", False)) == []


def test_a_crash_ends_the_turn_failed_and_a_crash_while_finishing_tries_once_more():
    m = TurnMachine()
    _opened(m)
    end = Finish(TaskStatus.FAILED, "internal error: KeyError")
    assert m.send(Crashed("KeyError")) == [end]
    assert m.send(Crashed("KeyError")) == [end]
    assert m.state == TurnState.FINISHING


def _versioned_step(version: str | None, pin: str | None) -> StepStart:
    head = dataclasses.replace(_head(1), turn_version=version, turn_pin=pin)
    return StepStart(head, "step-1", 1, (), ())


@pytest.mark.parametrize(
    ("run", "was", "pin", "upgrade"),
    [
        ("v2", "v1", None, Upgrade("v1", "v2")),  # an upgrade Turn on another version
        ("v2", "v2", None, None),  # its own version
        ("v2", "v1", "v1", None),  # pinned: never upgraded (the claim filters it)
        ("", "v1", None, None),  # an unversioned run
        ("v2", None, None, None),  # a Turn from before versions
    ],
)
def test_a_step_opened_on_another_version_upgrades_an_unpinned_turn_first(run, was, pin, upgrade):
    m = TurnMachine(version=run)
    m.send(TaskClaimed())
    effects = m.send(StepOpened(_versioned_step(was, pin)))
    assert [e for e in effects if isinstance(e, Upgrade)] == ([upgrade] if upgrade else [])
    if upgrade:
        assert effects[0] == upgrade  # recorded before the step's model call
    assert isinstance(effects[-1], CallModel)


def test_a_turn_handed_over_before_its_step_is_let_go():
    m = TurnMachine()
    assert m.send(TaskClaimed()) == [OpenStep(False)]
    assert m.send(HandedOver()) == []
    assert m.state == TurnState.HANDED_OVER and m.resting
    # Nothing more happens in this run, but a stop may still end it.
    with pytest.raises(IllegalTurnEvent):
        m.send(StepOpened(_step(1)))
    assert m.send(Stopped()) == [] and m.state == TurnState.ENDED


def test_every_event_missing_from_the_table_is_refused():
    for state in TurnState:
        for event in ALL_EVENTS:
            m = TurnMachine(state)
            if (state, event.type) in TURN_TRANSITIONS:
                continue
            with pytest.raises(IllegalTurnEvent):
                m.send(event)
            assert m.state == state


def test_the_table_targets_are_states_and_every_state_can_be_stopped():
    for (state, _), transition in TURN_TRANSITIONS.items():
        assert TurnState(transition.target) in TurnState
        assert (state, EventType.STOPPED) in TURN_TRANSITIONS


def test_the_machine_does_no_io():
    """Its module imports no trio, no store I/O, no logging, no clock."""
    source = Path(tm.__file__).read_text()
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    banned = ("trio", "logging", "structlog", "time", "agentserver.agents.store.sql")
    assert not [m for m in imported if m.startswith(banned)], imported
    assert "Any" not in source
