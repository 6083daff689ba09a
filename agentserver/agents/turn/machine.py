"""The Turn's decisions as a state machine (sans-IO), modelled on h11's ``Connection``.

A :class:`TurnMachine` takes events (the task claimed, a step opened, the model's reply,
the tool calls' outcome, a stop, ...) and returns the effects to apply, as data: the store
writes (:class:`CompleteStep`, :class:`AddCards`, :class:`Finish`), the model call to make
(:class:`CallModel`), the tool calls to send (:class:`SendTools`), a self-iteration, the
bus events to publish. It does no I/O: no trio, no store, no clock, no logging. The worker
(``agents/turn/worker.py``) is its shell: it applies the effects in order and turns what
they return into the next event.

The states are a Turn's as one run of the worker sees it (:class:`TurnState`); the events
are typed by :class:`EventType`, finer than the event classes where the outcome decides
where the Turn goes (a model reply that answers, calls tools, self-iterates or goes on).
:data:`TURN_TRANSITIONS` maps every legal ``(state, event type)`` to its target, as data;
an event the table does not hold raises :class:`IllegalTurnEvent` and changes nothing.
``docs/agents.md`` embeds :func:`render_markdown`, checked by a test.

The effects of one event are the table's transition effects (chosen by the event) followed
by the target state's entry effects (:class:`OpenStep` on entering ``opening``,
:class:`CallModel` on ``awaiting_model``, :class:`SendTools` on ``awaiting_tools``, ...),
so the table alone decides whether a model call or a tool send can follow an event.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from lxml import etree

from agentserver.agents.ports import LLMCompletion
from agentserver.agents.reading.decide import (
    CallTools,
    Decision,
    Deliver,
    Feedback,
    RequireTool,
    SelfIterate,
    Submit,
)
from agentserver.agents.reading.parsing import FoundPayload, make_huh
from agentserver.agents.store.base import (
    BoxSwap,
    CardType,
    NewCard,
    Spend,
    StepStart,
    TaskStatus,
)
from agentserver.agents.store.states import HeadStatus
from agentserver.core.errors import IllegalTransition
from agentserver.steps.states import Transition


class TurnState(enum.StrEnum):
    """A Turn as one run of the worker sees it."""

    IDLE = "idle"  # the run does not hold the Turn yet
    RECOVERING = "recovering"  # a restart's run: the last step's cut-off calls sent first
    OPENING = "opening"  # the run holds the Turn; its next step is being opened
    AWAITING_MODEL = "awaiting_model"  # the step's model call is out
    SELF_ITERATING = "self_iterating"  # the step's self-iteration goes through the pump
    AWAITING_TOOLS = "awaiting_tools"  # the step's tool calls are being sent
    SUSPENDED = "suspended"  # waiting for tool reports; the run let go
    AWAITING_APPROVAL = "awaiting_approval"  # suspended, with approval requests among them
    RETRY_WAIT = "retry_wait"  # a durable retry wait; the run let go
    HANDED_OVER = "handed_over"  # a draining process let go before a step; another takes it
    FINISHING = "finishing"  # the Turn's end (its answer) is being written
    ENDED = "ended"  # answered: by this run, or by whoever ended it (stop, watchdog)


class EventType(enum.StrEnum):
    """What happened, as the table keys it."""

    CLAIMED = "claimed"  # the run took the Turn: started, or a retry wait's resume
    RECOVERED = "recovered"  # a restart's resume of a running Turn
    STEP_OPENED = "step_opened"
    STEP_LIMIT = "step_limit"  # max-steps reached: no step begun
    GUARDRAIL_HALTED = "guardrail_halted"
    MODEL_ANSWERED = "model_answered"  # the reply is the answer (text or submit_result)
    MODEL_CALLED_TOOLS = "model_called_tools"
    MODEL_ITERATED = "model_iterated"  # the reply is a self-iteration payload
    MODEL_GOES_ON = "model_goes_on"  # refused payloads or a required tool: another step
    MODEL_FAILED = "model_failed"  # for good (retries used up, not retryable)
    RETRY_SCHEDULED = "retry_scheduled"
    BUDGET_REFUSED = "budget_refused"
    STEP_TIMED_OUT = "step_timed_out"  # llm-timeout
    SELF_ITERATED = "self_iterated"
    TOOLS_SENT = "tools_sent"  # suspended on the calls that went out
    TOOLS_AWAIT_APPROVAL = "tools_await_approval"  # suspended, approvals among them
    NO_TOOLS_SENT = "no_tools_sent"  # nothing went out (all refused, or nothing cut off)
    REPORT_WAITING = "report_waiting"  # a tool reported; the waiting set is not complete
    REPORT_RESUMED = "report_resumed"  # the waiting set is complete: the Turn resumes
    REPORT_TERMINATES = "report_terminates"  # a terminate-tool's result ends the Turn
    APPROVAL_GRANTED = "approval_granted"
    APPROVAL_DENIED = "approval_denied"
    FINISHED = "finished"  # the end was written
    CRASHED = "crashed"  # an unexpected error in the run
    STOPPED = "stopped"  # stop, cancel, watchdog, or fenced out: ended by someone else
    HANDED_OVER = "handed_over"  # draining: the next step is left to another process
    DOUBLE_TEXT_QUEUED = "double_text_queued"  # multitask enqueue/reject: Turn untouched
    DOUBLE_TEXT_INTERRUPTS = "double_text_interrupts"  # multitask interrupt/rollback


class IllegalTurnEvent(IllegalTransition):
    """An event the Turn machine's table has no transition for, in its state."""

    def __init__(self, state: TurnState, event: EventType) -> None:
        super().__init__("turn", str(state), str(event))


# -- events ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskClaimed:
    """The run holds the Turn: ``started`` (its Enqueue claimed: the head just moved to
    running), or resumed after a retry wait (``retries_done``). ``step_begun``: the
    transaction that claimed it began its first step too (read with :class:`OpenStep`)."""

    step_begun: bool = False
    started: bool = False
    retries_done: int = 0

    @property
    def type(self) -> EventType:
        return EventType.CLAIMED


@dataclass(frozen=True, slots=True)
class Recovered:
    """A restart's resume of a Turn left running: its last step's calls, if recorded and
    cut off before the suspend, are sent first (:class:`SendRecordedCalls`)."""

    @property
    def type(self) -> EventType:
        return EventType.RECOVERED


@dataclass(frozen=True, slots=True)
class StepOpened:
    """:class:`OpenStep` began a step (``step.step_id`` set)."""

    step: StepStart

    @property
    def type(self) -> EventType:
        return EventType.STEP_OPENED


@dataclass(frozen=True, slots=True)
class StepLimit:
    """:class:`OpenStep` found the step limit reached; ``text`` is the failed answer."""

    text: str

    @property
    def type(self) -> EventType:
        return EventType.STEP_LIMIT


@dataclass(frozen=True, slots=True)
class GuardrailHalted:
    """A guardrail halted the Turn (``after``: before a step; ``before``: on its calls)."""

    reason: str

    @property
    def type(self) -> EventType:
        return EventType.GUARDRAIL_HALTED


@dataclass(frozen=True, slots=True)
class Answer:
    """A Turn's successful answer: its text and deliverable metadata."""

    text: str
    meta: Mapping[str, object] | None = None


@dataclass(frozen=True, slots=True)
class ModelReplied:
    """The step's model call returned: the completion, the compaction to commit with the
    step (or None), the reply's decision (``reading/decide.py``), and for a
    ``submit_result`` its evaluated answer (``answer``; a plain answer's is its text).
    ``spends``: the step's model calls, to settle in their budgets with the step."""

    step_id: str
    completion: LLMCompletion
    swap: BoxSwap | None
    decision: Decision
    answer: Answer | None = None
    spends: tuple[Spend, ...] = ()

    @property
    def type(self) -> EventType:
        decision = self.decision
        if isinstance(decision, Submit | Deliver):
            return EventType.MODEL_ANSWERED
        if isinstance(decision, CallTools):
            return EventType.MODEL_CALLED_TOOLS
        if isinstance(decision, SelfIterate):
            return EventType.MODEL_ITERATED
        return EventType.MODEL_GOES_ON  # Feedback, RequireTool


@dataclass(frozen=True, slots=True)
class ModelFailed:
    """The model call failed for good: the Turn ends failed with ``problem``."""

    problem: str

    @property
    def type(self) -> EventType:
        return EventType.MODEL_FAILED


@dataclass(frozen=True, slots=True)
class RetryScheduled:
    """The model call failed retryably; the retry wait is recorded durably."""

    @property
    def type(self) -> EventType:
        return EventType.RETRY_SCHEDULED


@dataclass(frozen=True, slots=True)
class BudgetRefused:
    """A spend budget had no room for the call's worst case; nothing was called."""

    reason: str

    @property
    def type(self) -> EventType:
        return EventType.BUDGET_REFUSED


@dataclass(frozen=True, slots=True)
class StepTimedOut:
    """The step's model call did not answer within ``llm-timeout``."""

    problem: str

    @property
    def type(self) -> EventType:
        return EventType.STEP_TIMED_OUT


@dataclass(frozen=True, slots=True)
class SelfIterated:
    """The self-iteration went through the pump (or was refused): its card."""

    card: NewCard

    @property
    def type(self) -> EventType:
        return EventType.SELF_ITERATED


@dataclass(frozen=True, slots=True)
class ToolsSent:
    """The Turn is suspended on the calls that went out; ``report_due``: a report
    arrived before the suspend committed; ``approvals``: requests among the calls."""

    report_due: bool
    approvals: bool = False

    @property
    def type(self) -> EventType:
        return EventType.TOOLS_AWAIT_APPROVAL if self.approvals else EventType.TOOLS_SENT


@dataclass(frozen=True, slots=True)
class NoToolsSent:
    """No call went out (every one refused, or none was cut off): the Turn goes on."""

    @property
    def type(self) -> EventType:
        return EventType.NO_TOOLS_SENT


@dataclass(frozen=True, slots=True)
class ToolReported:
    """A tool's report (result or timeout) was applied to the waiting set. ``resumed``:
    it completed the set; ``step_begun``: the resume began the next step too;
    ``terminate_text``: a terminate-tool's result, which ends the Turn."""

    resumed: bool
    step_begun: bool = False
    terminate_text: str | None = None

    @property
    def type(self) -> EventType:
        if not self.resumed:
            return EventType.REPORT_WAITING
        if self.terminate_text is not None:
            return EventType.REPORT_TERMINATES
        return EventType.REPORT_RESUMED


@dataclass(frozen=True, slots=True)
class ApprovalDecided:
    """A human decided an approval request of the suspended Turn."""

    request_id: str
    granted: bool

    @property
    def type(self) -> EventType:
        return EventType.APPROVAL_GRANTED if self.granted else EventType.APPROVAL_DENIED


@dataclass(frozen=True, slots=True)
class Finished:
    """The :class:`Finish` effect was written (the Turn's answer is in the outbox)."""

    @property
    def type(self) -> EventType:
        return EventType.FINISHED


@dataclass(frozen=True, slots=True)
class Crashed:
    """An unexpected error in the run (``error``: its type's name)."""

    error: str

    @property
    def type(self) -> EventType:
        return EventType.CRASHED


@dataclass(frozen=True, slots=True)
class Stopped:
    """Someone else ended the Turn (a stop or cancel, the watchdog) or moved it on (the
    run was fenced out): they answered it; this run writes and sends nothing more."""

    reason: str = "stop"

    @property
    def type(self) -> EventType:
        return EventType.STOPPED


@dataclass(frozen=True, slots=True)
class HandedOver:
    """Instead of opening the next step, the run handed the Turn over (an ``upgrade``
    Turn on a draining process: docs/deploy.md): it is fenced, and a ``resume`` row lets
    a process serving the agent's newest version take the step."""

    @property
    def type(self) -> EventType:
        return EventType.HANDED_OVER


@dataclass(frozen=True, slots=True)
class DoubleText:
    """A new task for the agent while this Turn runs (``multitask``): ``enqueue`` and
    ``reject`` leave the Turn alone; ``interrupt`` and ``rollback`` ended it in the
    store (its failed answer "interrupted: ..." written there)."""

    mode: str

    @property
    def type(self) -> EventType:
        if self.mode in ("interrupt", "rollback"):
            return EventType.DOUBLE_TEXT_INTERRUPTS
        return EventType.DOUBLE_TEXT_QUEUED


Event = (
    TaskClaimed
    | Recovered
    | StepOpened
    | StepLimit
    | GuardrailHalted
    | ModelReplied
    | ModelFailed
    | RetryScheduled
    | BudgetRefused
    | StepTimedOut
    | SelfIterated
    | ToolsSent
    | NoToolsSent
    | ToolReported
    | ApprovalDecided
    | Finished
    | Crashed
    | Stopped
    | HandedOver
    | DoubleText
)

# -- effects --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenStep:
    """Begin the next step (after the ``after`` guardrails); feed back
    :class:`StepOpened`, :class:`StepLimit` or :class:`GuardrailHalted`. ``begun``: the
    claim's or resume's transaction began it already: use that step."""

    begun: bool = False


@dataclass(frozen=True, slots=True)
class Upgrade:
    """Record that the Turn, begun on version ``was``, continues on ``now`` (an
    ``upgrade`` Turn resumed by a process serving another version: docs/deploy.md)."""

    was: str
    now: str


@dataclass(frozen=True, slots=True)
class CallModel:
    """Make the step's model call; feed back its outcome. ``reserve``: reserve the
    call's worst case in the spend budgets first (a refusal is :class:`BudgetRefused`)."""

    step: StepStart
    retries_done: int
    reserve: bool


@dataclass(frozen=True, slots=True)
class CompleteStep:
    """Write the step's reply (and its compaction, ``swap``), one compare-and-set. A
    step that calls tools without a compaction is written by :class:`SendTools` instead,
    with its suspend."""

    step_id: str
    completion: LLMCompletion
    cards: tuple[NewCard, ...]
    swap: BoxSwap | None
    spends: tuple[Spend, ...] = ()


@dataclass(frozen=True, slots=True)
class AddCards:
    """Add cards to the Turn's output box (one compare-and-set)."""

    cards: tuple[NewCard, ...]


@dataclass(frozen=True, slots=True)
class SelfIteration:
    """Send the self-iteration payload through the pump; feed back :class:`SelfIterated`."""

    payload: FoundPayload


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A step's reply, written with the transaction that follows it (the suspend, or the
    Turn's end), and its model calls' spends, settled in that transaction."""

    step_id: str
    completion: LLMCompletion
    cards: tuple[NewCard, ...]
    spends: tuple[Spend, ...] = ()


@dataclass(frozen=True, slots=True)
class SendTools:
    """Screen the step's tool calls and check them, write the step's suspend on those
    that can go out (approvals asked), then send them; feed back :class:`ToolsSent`,
    :class:`NoToolsSent` or :class:`GuardrailHalted`. ``step``: the step's reply, not
    written yet: written in the suspend's transaction (None after a compaction, which
    :class:`CompleteStep` wrote). Each call's idempotency key is ``step_id`` and its
    place: :attr:`keys`."""

    step_id: str
    step_no: int
    calls: tuple[FoundPayload, ...]
    step: StepRecord | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(f"{self.step_id}:{i}" for i in range(len(self.calls)))


@dataclass(frozen=True, slots=True)
class SendRecordedCalls:
    """A restart's run: send the calls of the last step that were recorded but never
    suspended on (same idempotency keys); feed back as for :class:`SendTools`."""


@dataclass(frozen=True, slots=True)
class ForwardGranted:
    """Forward the granted call of approval request ``request_id`` (once)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Finish:
    """End the Turn with ``text`` and answer its caller (one compare-and-set), then its
    TaskEvent and reply; feed back :class:`Finished`. ``last_step``: completed with it."""

    status: str  # a TaskStatus
    text: str
    meta: Mapping[str, object] | None = None
    last_step: StepRecord | None = None


@dataclass(frozen=True, slots=True)
class EmitStep:
    """Publish a :class:`~agentserver.agents.events.StepEvent` of the step."""

    step_id: str
    phase: str


@dataclass(frozen=True, slots=True)
class EmitState:
    """Publish a :class:`~agentserver.agents.events.StateEvent` of the Turn."""

    status: HeadStatus
    activity: str = ""


Effect = (
    OpenStep
    | Upgrade
    | CallModel
    | CompleteStep
    | AddCards
    | SelfIteration
    | SendTools
    | SendRecordedCalls
    | ForwardGranted
    | Finish
    | EmitStep
    | EmitState
)

# -- the table ------------------------------------------------------------------------

_S = TurnState
_E = EventType

#: States in which the run holds the Turn and works on it.
_WORKING = (
    _S.RECOVERING,
    _S.OPENING,
    _S.AWAITING_MODEL,
    _S.SELF_ITERATING,
    _S.AWAITING_TOOLS,
    _S.FINISHING,
)
#: States in which the run has let go of the Turn (another run resumes it).
_RESTING = (_S.SUSPENDED, _S.AWAITING_APPROVAL, _S.RETRY_WAIT, _S.HANDED_OVER)
#: Every state with a Turn in progress.
LIVE = (_S.IDLE, *_WORKING, *_RESTING)

TURN_TRANSITIONS: Mapping[tuple[TurnState, EventType], Transition] = {
    (_S.IDLE, _E.CLAIMED): Transition(_S.OPENING, False, "task claimed: open a step"),
    (_S.IDLE, _E.RECOVERED): Transition(_S.RECOVERING, False, "restart: cut-off calls first"),
    (_S.RETRY_WAIT, _E.CLAIMED): Transition(_S.OPENING, False, "retry due: open the step"),
    (_S.RECOVERING, _E.NO_TOOLS_SENT): Transition(_S.OPENING, False, "nothing cut off"),
    (_S.RECOVERING, _E.TOOLS_SENT): Transition(_S.SUSPENDED, False, "cut-off calls sent"),
    (_S.RECOVERING, _E.TOOLS_AWAIT_APPROVAL): Transition(
        _S.AWAITING_APPROVAL, False, "ditto, approvals asked"
    ),
    (_S.RECOVERING, _E.GUARDRAIL_HALTED): Transition(_S.FINISHING, False, "failed: halted"),
    (_S.OPENING, _E.STEP_OPENED): Transition(_S.AWAITING_MODEL, False, "call the model"),
    (_S.OPENING, _E.STEP_LIMIT): Transition(_S.FINISHING, False, "failed: step limit"),
    (_S.OPENING, _E.GUARDRAIL_HALTED): Transition(_S.FINISHING, False, "failed: halted"),
    (_S.OPENING, _E.HANDED_OVER): Transition(_S.HANDED_OVER, False, "draining: let go"),
    (_S.AWAITING_MODEL, _E.MODEL_ANSWERED): Transition(_S.FINISHING, False, "answer"),
    (_S.AWAITING_MODEL, _E.MODEL_CALLED_TOOLS): Transition(_S.AWAITING_TOOLS, False, "send"),
    (_S.AWAITING_MODEL, _E.MODEL_ITERATED): Transition(_S.SELF_ITERATING, False, "self-call"),
    (_S.AWAITING_MODEL, _E.MODEL_GOES_ON): Transition(_S.OPENING, False, "huh or note"),
    (_S.AWAITING_MODEL, _E.MODEL_FAILED): Transition(_S.FINISHING, False, "failed"),
    (_S.AWAITING_MODEL, _E.RETRY_SCHEDULED): Transition(_S.RETRY_WAIT, False, "let go"),
    (_S.AWAITING_MODEL, _E.BUDGET_REFUSED): Transition(_S.FINISHING, False, "failed: budget"),
    (_S.AWAITING_MODEL, _E.STEP_TIMED_OUT): Transition(_S.FINISHING, False, "failed: timeout"),
    (_S.SELF_ITERATING, _E.SELF_ITERATED): Transition(_S.OPENING, False, "next step"),
    (_S.AWAITING_TOOLS, _E.TOOLS_SENT): Transition(_S.SUSPENDED, False, "let go"),
    (_S.AWAITING_TOOLS, _E.TOOLS_AWAIT_APPROVAL): Transition(_S.AWAITING_APPROVAL, False, "ask"),
    (_S.AWAITING_TOOLS, _E.NO_TOOLS_SENT): Transition(_S.OPENING, False, "all refused"),
    (_S.AWAITING_TOOLS, _E.GUARDRAIL_HALTED): Transition(_S.FINISHING, False, "failed: halted"),
    **{
        (s, e): t
        for s in (_S.SUSPENDED, _S.AWAITING_APPROVAL)
        for e, t in (
            (_E.REPORT_WAITING, Transition(s, False, "set incomplete")),
            (_E.REPORT_RESUMED, Transition(_S.OPENING, False, "set complete: next step")),
            (_E.REPORT_TERMINATES, Transition(_S.FINISHING, False, "terminate-tool's result")),
        )
    },
    (_S.AWAITING_APPROVAL, _E.APPROVAL_GRANTED): Transition(
        _S.AWAITING_APPROVAL, False, "forward once"
    ),
    (_S.AWAITING_APPROVAL, _E.APPROVAL_DENIED): Transition(
        _S.AWAITING_APPROVAL, False, "reported as a failed call"
    ),
    (_S.FINISHING, _E.FINISHED): Transition(_S.ENDED, False, "answered"),
    **{
        (s, _E.CRASHED): Transition(_S.FINISHING, False, "failed: internal error") for s in _WORKING
    },
    **{(s, _E.STOPPED): Transition(_S.ENDED, False, "ended by another") for s in LIVE},
    (_S.ENDED, _E.STOPPED): Transition(_S.ENDED, False, "already ended: nothing to stop"),
    **{(s, _E.DOUBLE_TEXT_QUEUED): Transition(s, False, "Turn untouched") for s in LIVE},
    **{
        (s, _E.DOUBLE_TEXT_INTERRUPTS): Transition(_S.ENDED, False, "interrupted: answered")
        for s in LIVE
    },
}


def turn_transition(state: TurnState, event: EventType) -> Transition:
    """The transition for ``(state, event)``, or :class:`IllegalTurnEvent`."""
    try:
        return TURN_TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTurnEvent(state, event) from None


def render_markdown() -> str:
    """The Turn machine's table as Markdown (embedded verbatim in ``docs/agents.md``):
    one row per event, target and meaning, with every state it applies from."""
    rows: dict[tuple[str, str, str], list[str]] = {}
    for (state, event), t in TURN_TRANSITIONS.items():
        target = "(unchanged)" if t.target == state else str(t.target)
        rows.setdefault((str(event), target, t.why), []).append(str(state))
    lines = ["| from | event | to | meaning |", "|---|---|---|---|"]
    for (name, target, why), states in rows.items():
        lines.append(f"| {', '.join(states)} | {name} | {target} | {why} |")
    return "\n".join(lines) + "\n"


# -- cards ----------------------------------------------------------------------------


def element_text(element: etree._Element) -> str:
    """An element as the text a card keeps."""
    text: str = etree.tostring(element, encoding="unicode")
    return text


def huh_card(element: etree._Element, hint: str) -> NewCard:
    """A refusal card: the ``<huh>`` the model is shown, with an optional hint."""
    return NewCard(CardType.HUH, element_text(element), {"hint": hint} if hint else {})


# -- the machine ----------------------------------------------------------------------


class TurnMachine:
    """One Turn's decisions: :meth:`send` an event, apply the effects it returns.

    Holds only the Turn's decision state (its state, its open step, the calls the model
    wrote, the keys and approvals already sent); a run of the worker makes one, in the
    state the Turn is in durably (``idle`` for a task or a restart, ``suspended`` for a
    tool report, ``retry_wait`` for a retry's resume)."""

    def __init__(
        self, state: TurnState = TurnState.IDLE, *, budgeted: bool = False, version: str = ""
    ) -> None:
        self.state = state
        #: Spend budgets apply: every model call reserves its worst case first.
        self.budgeted = budgeted
        #: The agent version this run serves (empty: unversioned): a step opened on a
        #: Turn begun on another version, unpinned, upgrades it first.
        self.version = version
        #: A report was due when the Turn suspended (the run need not let go of the agent).
        self.report_due = True
        self._step: StepStart | None = None
        self._retries = 0
        self._begun = False
        self._calls: tuple[FoundPayload, ...] = ()
        self._iterate: FoundPayload | None = None
        self._record: StepRecord | None = None
        self._forwarded: set[str] = set()

    @property
    def resting(self) -> bool:
        """Whether the run is done with the Turn (let go of, or ended)."""
        return self.state in _RESTING or self.state == _S.ENDED

    def send(self, event: Event) -> list[Effect]:
        """Apply ``event``: the effects to apply, in order. :class:`IllegalTurnEvent`
        (nothing changed) when the table has no transition for it in this state."""
        kind = event.type
        transition = turn_transition(self.state, kind)
        effects = self._effects(event)
        before, self.state = self.state, TurnState(transition.target)
        if self.state != before:  # a self-transition is not entered again
            effects += self._entry()
        return effects

    # The effects the event itself sets off (whatever the state it leads to).
    def _effects(self, event: Event) -> list[Effect]:
        match event:
            case TaskClaimed(step_begun=begun, started=started, retries_done=retries):
                self._begun, self._retries = begun, retries
                return [EmitState(HeadStatus.RUNNING)] if started else []
            case StepOpened(step=step):
                self._step = step
                assert step.step_id is not None
                was = step.head.turn_version
                upgrade: list[Effect] = []
                if self.version and was and was != self.version and step.head.turn_pin is None:
                    upgrade = [Upgrade(was, self.version)]
                return [
                    *upgrade,
                    EmitStep(step.step_id, "started"),
                    EmitState(HeadStatus.RUNNING, "thinking"),
                ]
            case StepLimit(text=text):
                return [Finish(TaskStatus.FAILED, text)]
            case GuardrailHalted(reason=reason):
                return [Finish(TaskStatus.FAILED, f"halted: {reason}")]
            case ModelReplied():
                return self._replied(event)
            case (
                ModelFailed(problem=text) | StepTimedOut(problem=text) | BudgetRefused(reason=text)
            ):
                return [Finish(TaskStatus.FAILED, text)]
            case SelfIterated(card=card):
                return [AddCards((card,)), *self._step_completed()]
            case NoToolsSent() if self.state == _S.AWAITING_TOOLS:
                return self._step_completed()
            case ToolsSent(report_due=due):
                self.report_due = due
                return []
            case ToolReported(step_begun=begun, terminate_text=text):
                self._begun, self._retries = begun, 0
                if text is not None and event.type == _E.REPORT_TERMINATES:
                    return [Finish(TaskStatus.SUCCEEDED, text)]
            case ApprovalDecided(request_id=rid, granted=True) if rid not in self._forwarded:
                self._forwarded.add(rid)
                return [ForwardGranted(rid)]
            case Crashed(error=error):
                return [Finish(TaskStatus.FAILED, f"internal error: {error}")]
        return []

    def _replied(self, event: ModelReplied) -> list[Effect]:
        """A model reply: the step's record and what its decision does."""
        step_id, completion, decision = event.step_id, event.completion, event.decision
        said = (NewCard(CardType.LLM_MESSAGE, completion.content, {"step_id": step_id}),)
        self._retries = 0
        answer = event.answer
        if isinstance(decision, Deliver):
            answer = Answer(decision.text)
        if isinstance(decision, Submit | Deliver) and event.swap is None:
            # The last step: written with the Turn's end, in one transaction.
            assert answer is not None, "a submit_result reply comes with its answer"
            last = StepRecord(step_id, completion, said, event.spends)
            return [
                EmitStep(step_id, "planning"),
                Finish(TaskStatus.SUCCEEDED, answer.text, answer.meta, last),
            ]
        # A step that calls tools is written with its suspend (one transaction), unless a
        # compaction swaps the boxes: then its calls are screened on the compacted cards,
        # once the step is complete.
        if isinstance(decision, CallTools) and event.swap is None:
            self._record = StepRecord(step_id, completion, said, event.spends)
            self._calls = decision.calls
            return [EmitStep(step_id, "planning")]
        self._record = None
        effects: list[Effect] = [
            CompleteStep(step_id, completion, said, event.swap, event.spends),
            EmitStep(step_id, "planning"),
        ]
        match decision:
            case Feedback(errors=errors):
                cards = tuple(huh_card(make_huh(e.reason, e.raw), e.hint) for e in errors)
                return [*effects, AddCards(cards), *self._step_completed()]
            case RequireTool(note=note):
                card = NewCard(CardType.NOTE, note)
                return [*effects, AddCards((card,)), *self._step_completed()]
            case SelfIterate(payload=payload):
                self._iterate = payload
            case CallTools(calls=calls):
                self._calls = calls
            case Submit() | Deliver():
                assert answer is not None, "a submit_result reply comes with its answer"
                return [*effects, Finish(TaskStatus.SUCCEEDED, answer.text, answer.meta)]
        return effects

    def _step_completed(self) -> list[Effect]:
        assert self._step is not None and self._step.step_id is not None
        return [EmitStep(self._step.step_id, "completed")]

    # The effects of entering the state the transition led to.
    def _entry(self) -> list[Effect]:
        match self.state:
            case _S.OPENING:
                begun, self._begun = self._begun, False
                return [OpenStep(begun)]
            case _S.AWAITING_MODEL:
                assert self._step is not None
                return [CallModel(self._step, self._retries, self.budgeted)]
            case _S.SELF_ITERATING:
                assert self._iterate is not None
                payload, self._iterate = self._iterate, None
                return [SelfIteration(payload)]
            case _S.AWAITING_TOOLS:
                assert self._step is not None and self._step.step_id is not None
                step_id, step_no = self._step.step_id, self._step.step_no
                record, self._record = self._record, None
                return [SendTools(step_id, step_no, self._calls, record)]
            case _S.RECOVERING:
                return [SendRecordedCalls()]
        return []
