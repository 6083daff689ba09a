"""The agent store's rows: what its calls take and return (plain frozen data), and the
card types and task statuses they carry. Governance's record of a step, as
``complete_step`` takes it, is :class:`~agentserver.agents.store.governance.StepRecord`.
The store's protocols, by role, are in :mod:`.base`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from agentserver.agents.profile.schedule import ScheduleSpec

#: The reply reference's key naming the client an HTTP message was sent by (its bearer
#: token's identity): her conversation, though the answer goes to the message's endpoint.
SPEAKS_FOR: Final = "speaks_for"


def client_of(reply_ref: Mapping[str, object] | None) -> str | None:
    """The named client a task's reply reference names (None: none): her socket's
    identity, or the bearer token's of her HTTP message or A2A task. Whose budgets a
    task's model calls pay into (docs/budgets.md): the same at every door."""
    if not isinstance(reply_ref, Mapping):
        return None
    client = reply_ref.get("client") or reply_ref.get(SPEAKS_FOR)
    return client if isinstance(client, str) and client else None


def caller_key(reply_ref: Mapping[str, object] | None) -> str | None:
    """The caller a task's reply reference names (None: none): a named client by its
    identity (``client:NAME``), any other caller by the origin of its chain
    (``origin:ENDPOINT``). The conversation of ``memory="client"`` (agents/turn/memory.py),
    and what ``keep-last`` counts an agent without memory by."""
    if not isinstance(reply_ref, Mapping):
        return None
    client = reply_ref.get("client") or reply_ref.get(SPEAKS_FOR)
    if isinstance(client, str) and client:
        return f"client:{client}"
    chain = reply_ref.get("chain")
    if isinstance(chain, list) and chain and isinstance(chain[0], str) and chain[0]:
        return f"origin:{chain[0]}"
    return None


class CardType:
    TASK_INPUT = "task.input"
    LLM_MESSAGE = "llm.message"
    TOOL_CALL = "tool.call"
    TOOL_RESULT = "tool.result"
    SELF_CALL = "sys.self_call"
    HUH = "sys.huh"
    NOTE = "sys.note"
    DELIVERABLE = "task.deliverable"
    SUMMARY = "sys.summary"  # the rolling summary of compacted cards (compaction.py)
    #: A tool call governance did not send (policy, loop detector, guardrail): the model
    #: sees it as a failed call (metadata: to, payload, rule, decision).
    TOOL_REFUSED = "tool.refused"
    #: A guardrail's verdict on one tool result (metadata: tool_call_id, warn, block).
    GUARD = "sys.guard"


class TaskStatus:
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True, slots=True)
class TurnToken:
    """What a worker holds for a Turn: the CAS key of every write it makes."""

    agent_id: str
    agent_turn_id: str
    turn_epoch: int


@dataclass(frozen=True, slots=True)
class Head:
    agent_id: str
    status: str
    agent_turn_id: str | None
    turn_epoch: int
    turn_inbox_id: str | None
    context_box_id: str | None
    output_box_id: str | None
    step_count: int
    waiting_tool_count: int
    resume_deadline: float | None
    dispatched_at: float | None
    running_since: float | None
    updated_at: float
    #: estimated tokens of the cards in the two boxes, as shown (agents/profile/budget.py)
    context_tokens: int = 0
    #: The version its Turn started with (or was moved to), and its pin: the version a
    #: pinned Turn runs on only (docs/deploy.md).
    turn_version: str | None = None
    turn_pin: str | None = None

    @property
    def token(self) -> TurnToken | None:
        if self.agent_turn_id is None:
            return None
        return TurnToken(self.agent_id, self.agent_turn_id, self.turn_epoch)


@dataclass(frozen=True, slots=True)
class InboxRow:
    inbox_id: str
    agent_id: str
    message_type: str
    status: str
    agent_turn_id: str | None
    turn_epoch: int | None
    correlation_id: str | None
    payload: bytes
    reply_ref_json: str | None
    failed: bool
    retry_count: int
    next_retry_at: float
    defer_reason: str | None
    created_at: float
    #: A task's: the version of the process that enqueued it (started it, once started).
    version: str | None = None

    @property
    def token(self) -> TurnToken | None:
        """The Turn this row belongs to; None for a row that carries none."""
        if self.agent_turn_id is None or self.turn_epoch is None:
            return None
        return TurnToken(self.agent_id, self.agent_turn_id, self.turn_epoch)


@dataclass(frozen=True, slots=True)
class Card:
    card_id: str
    box_id: str
    card_type: str
    content: str
    metadata: Mapping[str, Any]
    created_at: float


@dataclass(frozen=True, slots=True)
class NewCard:
    card_type: str
    content: str
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BoxSwap:
    """A compaction that waits for its step (issue 12): :func:`~.sql.turns.complete_step`
    swaps the Turn's boxes to [``summary``] + [copies of the ``keep`` cards, in order] and
    adds the step's cards to the new output box, all in the step's compare-and-set
    transaction. ``correction``: tokens the provider counted above the estimate."""

    summary: NewCard
    keep: tuple[str, ...]
    edge: Mapping[str, Any] = field(default_factory=dict)
    correction: int = 0


@dataclass(frozen=True, slots=True)
class ToolCallRecord:
    """One forwarded tool call: ``tool_call_id`` is the pump's sub-thread id."""

    tool_call_id: str
    to: str
    payload: str
    after_execution: str = "suspend"  # or "terminate"
    #: Extra metadata for the tool.call card (e.g. a guardrail's warnings for its result).
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PendingReply:
    agent_turn_id: str
    agent_id: str
    reply_ref_json: str
    payload: bytes
    failed: bool
    attempts: int


@dataclass(frozen=True, slots=True)
class Finished:
    """A Turn that just ended (committed). The caller publishes the one TaskEvent."""

    agent_id: str
    agent_turn_id: str
    status: str
    output_box_id: str
    deliverable_card_id: str
    reply: PendingReply | None
    next_leased: bool


@dataclass(frozen=True, slots=True)
class HoldOwner:
    """The run of a Turn's step a hold belongs to: released when that run is fenced
    out (the Turn's epoch moves on), whichever process notices."""

    agent_id: str
    agent_turn_id: str
    turn_epoch: int
    step_id: str | None = None


@dataclass(frozen=True, slots=True)
class HoldRequest:
    """The reservation of a step's first model call, asked of the transaction that opens
    the step (``sql/budgets.py`` ``hold_step``): the rows, the worst case, the hold's id, expiry and
    owner (the step)."""

    keys: tuple[str, ...]
    tokens: int
    cost: float
    hold_id: str
    expires_at: float
    owner: HoldOwner


@dataclass(frozen=True, slots=True)
class StepHold:
    """What ``sql/budgets.py`` ``hold_step`` came to: ``granted``, the hold is written (the step's first
    call uses it instead of reserving); else nothing was written (the call reserves, and
    meets the refusal, by itself)."""

    request: HoldRequest
    granted: bool


@dataclass(frozen=True, slots=True)
class StepStart:
    """A step begun, with what its model call needs, read in the step's own transaction
    (:func:`~.sql.turns.open_step`): the head as updated (``step_count`` counts this step)
    and the cards of the Turn's two boxes. ``step_id`` is None when the step limit was
    reached: then no step was begun and the head is as it was. ``hold``: its first model
    call's reservation, when taken in the same transaction (spend budgets)."""

    head: Head
    step_id: str | None
    step_no: int
    context: tuple[Card, ...]
    output: tuple[Card, ...]
    hold: StepHold | None = None


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    """What applying one tool_result/timeout row did.

    ``kind``: applied | duplicate | stale | deferred | exhausted. ``resumed`` is set when
    this report completed the waiting set (the head is now ``running`` at a new epoch);
    ``terminate_card_id`` when a tool of that set ends the Turn (after_execution). On a
    resume, ``reply_ref_json`` is the Turn's reply reference and, when asked for
    (``then_step``) and no tool ends the Turn, ``step`` the step begun in the same
    transaction.
    """

    kind: str
    resumed: TurnToken | None = None
    terminate_card_id: str | None = None
    reply_ref_json: str | None = None
    step: StepStart | None = None


@dataclass(frozen=True, slots=True)
class Claimed:
    """An inbox row claimed (``processing``) and, in the claim's own transaction, its
    first store step taken when it has one (:meth:`~.base.TurnStore.claim_next`).

    A task (``turn``) row: ``step``, its Turn started and first step begun; or
    ``started`` (the agent's guardrails judge the cards before each step: started
    without a step). A tool report or timeout: ``report``, its application. None of
    them: the row is only claimed (another kind of row, a task with a ``problem``, or a
    backend that claims on its own); the worker takes the step itself."""

    row: InboxRow
    step: StepStart | None = None
    started: bool = False
    report: ReportOutcome | None = None
    #: Why a task row cannot start (the worker fails its Turn with it).
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    inbox_id: str
    leased: bool


@dataclass(frozen=True, slots=True)
class MultitaskAnswers:
    """The failed answers double texting may owe (the agent's answer elements, as bytes):
    to a rejected task (``busy``), to the running Turn it ends (``ended``), to an earlier
    queued task it replaces (``superseded``)."""

    busy: bytes
    ended: bytes
    superseded: bytes


@dataclass(frozen=True, slots=True)
class DoubleText:
    """What a task sent with a double-texting mode did (docs/runs.md), as committed:
    ``outcome`` ``queued`` (nothing of its conversation was busy, or ``enqueue``),
    ``rejected`` (answered at once: ``replies``), ``superseded`` (the earlier tasks of its
    conversation ended: the running Turn in ``ended``, the queued ones answered in
    ``replies``)."""

    inbox_id: str
    outcome: str
    leased: bool
    ended: Finished | None = None
    replies: tuple[PendingReply, ...] = ()


@dataclass(frozen=True, slots=True)
class ClientReply:
    reply_id: int
    client: str
    thread_ref_json: str
    payload: bytes
    failed: bool
    created_at: float


@dataclass(frozen=True, slots=True)
class ScheduleRow:
    """A schedule as stored: its settings and its state."""

    spec: ScheduleSpec
    paused: bool
    next_tick: float | None
    last_tick: float | None
    last_outcome: str | None
    last_inbox_id: str | None
    fired: int
    skipped: int
    #: ``boot`` (boot.xml), ``api`` (made at run time by an anonymous caller) or
    #: ``api:NAME`` (made by declared client NAME, its owner).
    source: str

    @property
    def owner(self) -> str | None:
        """The declared client that made the schedule (None: boot.xml's, an anonymous
        caller's): whom the authorization rule lets see and change it besides operators."""
        return self.source.partition(":")[2] or None

    @property
    def origin(self) -> str:
        """``boot`` or ``api``: where the schedule was made."""
        return self.source.partition(":")[0]


@dataclass(frozen=True, slots=True)
class Fired:
    """What a claimed tick did: ``outcome`` (:data:`FIRED`, :data:`MANUAL` or a
    ``skipped: ...``), the run's inbox row, whether its Turn was leased, the run it
    cancelled (cancel-other)."""

    name: str
    tick: float
    outcome: str
    inbox_id: str | None
    leased: bool
    ended: Finished | None = None
