"""The agent store interface and its row types.

The worker and the watchdog talk to the store only through :class:`AgentStore`. Every
method is one atomic transaction: it either commits fully or raises with nothing written.
Methods that act on a Turn take a :class:`TurnToken` and perform a compare-and-set on the
head (``agent_id`` + ``active_agent_turn_id`` + ``turn_epoch`` + expected status); when it
matches no row they raise :class:`~agentserver.agents.errors.StaleTurn` and write nothing,
including cards. Methods are ``async`` so a networked store (PostgreSQL) can implement the
same interface; the SQLite store runs its short transactions inline on the trio thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentserver.agents.ports import LLMCompletion, ReplyRef


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
    """A compaction that waits for its step (issue 12): :meth:`AgentStore.complete_step`
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
class StepStart:
    """A step begun, with what its model call needs, read in the step's own transaction
    (:meth:`AgentStore.open_step`): the head as updated (``step_count`` counts this step)
    and the cards of the Turn's two boxes. ``step_id`` is None when the step limit was
    reached: then no step was begun and the head is as it was."""

    head: Head
    step_id: str | None
    step_no: int
    context: tuple[Card, ...]
    output: tuple[Card, ...]


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
class EnqueueResult:
    inbox_id: str
    leased: bool


@dataclass(frozen=True, slots=True)
class ClientReply:
    reply_id: int
    client: str
    thread_ref_json: str
    payload: bytes
    failed: bool
    created_at: float


class ScreenedStep(Protocol):
    """Governance's record of one step's calls, as ``complete_step`` takes it
    (``governance_store.StepRecord`` is the one implementation). Declared here so that the
    store does not import governance_store, which imports the store's row types."""

    @property
    def decisions(self) -> Sequence[Any]: ...

    @property
    def cards(self) -> Sequence[NewCard]: ...

    @property
    def approvals(self) -> Sequence[Any]: ...

    def __bool__(self) -> bool: ...


class AgentStore(Protocol):
    """Durable state of every agent; see the module docstring for the guarantees."""

    # -- intake (called by the pump through the runtime) ---------------------------
    async def ensure_agents(self, agent_ids: Sequence[str]) -> None: ...
    async def enqueue_turn(
        self, agent_id: str, payload: bytes, reply_ref: ReplyRef, *, conversation: str | None = None
    ) -> EnqueueResult:
        """Write a queued Turn (and lease it if the agent is idle) before anything else;
        with ``conversation`` the Turn continues that conversation's cards."""
        ...

    async def report_tool_result(
        self, agent_id: str, tool_call_id: str, payload: bytes, *, failed: bool
    ) -> str:
        """Write a tool_result row (``deferred`` when its waiting row does not exist yet)."""
        ...

    # -- worker ---------------------------------------------------------------------
    async def due_agents(self, limit: int) -> list[str]: ...
    async def claim_due(self, agent_id: str, limit: int) -> list[InboxRow]: ...
    async def head(self, agent_id: str) -> Head: ...
    async def start_turn(self, row: InboxRow) -> TurnToken: ...
    async def skip_row(self, row: InboxRow, reason: str) -> None: ...
    async def fail_turn_row(
        self, row: InboxRow, reason: str, reply_payload: bytes | None
    ) -> Finished | None: ...
    async def begin_step(self, token: TurnToken) -> tuple[str, int]: ...
    async def open_step(self, token: TurnToken, max_steps: int) -> StepStart:
        """Begin a step unless ``max_steps`` are taken, and read the Turn's cards, in one
        compare-and-set transaction (the worker's step: no separate head or card reads)."""
        ...

    async def start_turn_step(self, row: InboxRow, max_steps: int) -> StepStart:
        """:meth:`start_turn` and :meth:`open_step` in one transaction."""
        ...

    async def complete_step(
        self,
        token: TurnToken,
        step_id: str,
        completion: LLMCompletion | None,
        cards: Sequence[NewCard],
        *,
        swap: BoxSwap | None = None,
        screened: ScreenedStep | None = None,
    ) -> None:
        """Close the step with its cards; with ``swap``, the boxes are compacted first in
        the same transaction (a stale token writes neither); with ``screened`` (not with
        ``swap``), governance's record of the step's calls is written with it, as
        ``record_decisions`` would."""
        ...

    async def suspend(
        self,
        token: TurnToken,
        step_id: str,
        calls: Sequence[ToolCallRecord],
        cards: Sequence[NewCard],
        resume_deadline: float,
    ) -> int:
        """running → suspended; returns how many reports that came early are due now."""
        ...

    async def apply_report(self, row: InboxRow, *, then_step: int | None = None) -> ReportOutcome:
        """Apply a report; with ``then_step`` (the step limit), a resume also opens the
        next step in the same transaction (:meth:`open_step`)."""
        ...

    async def take_resume(self, row: InboxRow) -> TurnToken | None: ...
    async def add_cards(self, token: TurnToken, cards: Sequence[NewCard]) -> None: ...
    async def compact(
        self,
        token: TurnToken,
        summary: NewCard,
        keep: Sequence[str],
        *,
        edge: Mapping[str, Any] | None = None,
    ) -> int:
        """Swap the Turn's boxes to [summary] + [copies of ``keep``]; returns the count."""
        ...

    async def add_context_tokens(self, token: TurnToken, delta: int) -> None:
        """Correct the running token count up by ``delta`` (the provider's usage)."""
        ...

    async def retry_step(
        self,
        token: TurnToken,
        step_id: str,
        *,
        attempt: int,
        kind: str,
        delay_s: float,
        error: str,
    ) -> float:
        """Close a failed step as ``retrying`` and queue its durable retry wait."""
        ...

    async def finish(
        self,
        token: TurnToken,
        status: str,
        text: str,
        metadata: Mapping[str, Any],
        reply_payload: bytes,
        *,
        step_id: str | None = None,
        completion: LLMCompletion | None = None,
        cards: Sequence[NewCard] = (),
    ) -> Finished:
        """running → idle with the deliverable and the reply; with ``step_id``, that step
        is completed first in the same transaction (``complete_step(token, step_id,
        completion, cards)``: the Turn's last step and its end, one compare-and-set)."""
        ...

    async def force_end(
        self,
        agent_id: str,
        status: str,
        text: str,
        reply_payload: bytes | None,
        *,
        agent_turn_id: str | None = None,
        turn_epoch: int | None = None,
        expect_status: Sequence[str] | None = None,
    ) -> Finished | None: ...
    async def cards(self, box_id: str) -> list[Card]: ...
    async def card(self, card_id: str) -> Card | None: ...
    async def turn_reply_ref(self, token: TurnToken) -> str | None: ...

    # -- watchdog -------------------------------------------------------------------
    async def requeue_stuck(self, older_than_s: float) -> int: ...
    async def expired_suspensions(self) -> list[TurnToken]: ...
    async def suspended_turns(self) -> list[TurnToken]: ...
    async def inject_timeouts(
        self, token: TurnToken, reason: str = "timed out", only: Sequence[str] | None = None
    ) -> int: ...
    async def waiting_calls(self, token: TurnToken) -> list[ToolCallRecord]: ...
    async def rebind_call(
        self, token: TurnToken, old: str, new: str, resume_deadline: float
    ) -> None: ...
    async def stale_dispatched(self, older_than_s: float) -> list[Head]: ...
    async def overdue_running(self, older_than_s: float) -> list[Head]: ...
    async def recover_running(self) -> list[TurnToken]: ...

    # -- replies --------------------------------------------------------------------
    async def pending_replies(self, limit: int, older_than_s: float = 0.0) -> list[PendingReply]:
        """Replies not yet sent, created at least ``older_than_s`` ago."""
        ...

    async def mark_reply_sent(self, agent_turn_id: str) -> None: ...
    async def mark_reply_attempt(self, agent_turn_id: str, give_up: bool) -> None: ...
    async def record_client_reply(
        self,
        client: str,
        thread_ref: ReplyRef,
        payload: bytes,
        *,
        failed: bool,
        agent_turn_id: str | None = None,
    ) -> int: ...
    async def pending_client_replies(
        self, client: str, after_id: int = 0, limit: int = 100
    ) -> list[ClientReply]:
        """Replies kept for ``client`` (id above ``after_id``), oldest first; read only."""
        ...

    async def ack_client_replies(self, client: str, reply_ids: Sequence[int]) -> int:
        """Forget kept replies the client has received."""
        ...

    # -- memory across tasks --------------------------------------------------------
    async def conversation_cards(self, agent_id: str, conversation: str) -> list[Card]: ...
    async def conversation_boxes(
        self, agent_id: str, conversation: str
    ) -> tuple[str, str] | None: ...
    async def replace_conversation(
        self,
        agent_id: str,
        conversation: str,
        expect_boxes: tuple[str, str],
        summary: NewCard,
        keep: Sequence[str],
    ) -> bool: ...

    async def aclose(self) -> None: ...
