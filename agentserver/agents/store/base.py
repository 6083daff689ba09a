"""The agent store's protocols, one per role, and :class:`AgentStore`, all of them.

Each part of the agents talks to the store through the role it uses: intake
(:class:`IntakeStore`), the worker's Turn (:class:`TurnStore`), a Turn's end from outside
and the reply outbox (:class:`ReplyStore`), the watchdog and restart recovery
(:class:`WatchdogStore`), named clients (:class:`ClientReplyStore`), memory across tasks
(:class:`ConversationStore`), governance (:class:`~.governance.GovernanceStore`,
:class:`ApprovalStore`), the operator (:class:`OperatorStore`), read-only views
(:class:`ViewStore`) and the store's life in the process (:class:`StoreLifecycle`, with
the capabilities that differ between one process and several on a shared store). The
composition root (the runtime) holds :class:`AgentStore`; both backends
(``sqlite_store.SqliteAgentStore``, ``pg.store.PostgresAgentStore``) satisfy it whole.

Every method is one atomic transaction: it either commits fully or raises with nothing
written. Methods that act on a Turn take a :class:`TurnToken` and perform a
compare-and-set on the head (``agent_id`` + ``active_agent_turn_id`` + ``turn_epoch`` +
expected status); when it matches no row they raise
:class:`~agentserver.agents.errors.StaleTurn` and write nothing, including cards. Methods
are ``async`` so a networked store (PostgreSQL) can implement the same interface; the
SQLite store runs its short transactions inline on the trio thread. A cancelled call
commits nothing, or all of it (a cancel that lands while ``COMMIT`` is in flight).

The row types are in :mod:`.rows`, re-exported here under the names the package has
always imported them by.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import trio

from agentserver.agents.doorbell import Doorbell
from agentserver.agents.ports import LLMCompletion, ReplyRef
from agentserver.agents.profile.schedule import ScheduleSpec
from agentserver.agents.store.governance import GovernanceStore, PendingApproval, StepRecord
from agentserver.agents.store.outbox import OutboxItem
from agentserver.agents.store.rows import BoxSwap as BoxSwap
from agentserver.agents.store.rows import Card as Card
from agentserver.agents.store.rows import CardType as CardType
from agentserver.agents.store.rows import Claimed as Claimed
from agentserver.agents.store.rows import ClientReply as ClientReply
from agentserver.agents.store.rows import DoubleText as DoubleText
from agentserver.agents.store.rows import EnqueueResult as EnqueueResult
from agentserver.agents.store.rows import Finished as Finished
from agentserver.agents.store.rows import Fired as Fired
from agentserver.agents.store.rows import Head as Head
from agentserver.agents.store.rows import InboxRow as InboxRow
from agentserver.agents.store.rows import MultitaskAnswers as MultitaskAnswers
from agentserver.agents.store.rows import NewCard as NewCard
from agentserver.agents.store.rows import PendingReply as PendingReply
from agentserver.agents.store.rows import ReportOutcome as ReportOutcome
from agentserver.agents.store.rows import ScheduleRow as ScheduleRow
from agentserver.agents.store.rows import StepStart as StepStart
from agentserver.agents.store.rows import TaskStatus as TaskStatus
from agentserver.agents.store.rows import ToolCallRecord as ToolCallRecord
from agentserver.agents.store.rows import TurnToken as TurnToken
from agentserver.agents.store.rows import caller_key as caller_key
from agentserver.agents.store.sql.budgets import HoldFor as HoldFor
from agentserver.agents.store.sql.budgets import Spend as Spend

#: What a shared store does with the calls of a dead process's suspended Turn
#: (``await lost(token, reason)``: the runtime's ``lost_calls``), handed to the store's
#: :meth:`~StoreLifecycle.serve` and ``recover_running`` by the runtime that runs them.
LostCalls = Callable[[TurnToken, str], Awaitable[int]]


class IntakeStore(Protocol):
    """Intake, called by the pump's handlers through the runtime."""

    async def ensure_agents(self, agent_ids: Sequence[str]) -> None: ...
    async def enqueue_turn(
        self, agent_id: str, payload: bytes, reply_ref: ReplyRef, *, conversation: str | None = None
    ) -> EnqueueResult:
        """Write a queued Turn (and lease it if the agent is idle) before anything else;
        with ``conversation`` the Turn continues that conversation's cards."""
        ...

    async def enqueue_multitask(
        self,
        agent_id: str,
        payload: bytes,
        reply_ref: ReplyRef,
        *,
        conversation: str,
        mode: str,
        answers: MultitaskAnswers,
    ) -> DoubleText:
        """:meth:`enqueue_turn` for a task of ``conversation`` with double-texting
        ``mode`` (reject, interrupt, rollback: docs/runs.md), in one transaction."""
        ...

    async def report_tool_result(
        self, agent_id: str, tool_call_id: str, payload: bytes, *, failed: bool
    ) -> str:
        """Write a tool_result row (``deferred`` when its waiting row does not exist yet)."""
        ...


class TurnStore(Protocol):
    """The worker's Turn: claims, steps, tool waits, its own end (the worker, its model
    step and tool dispatch, the compactor)."""

    @property
    def others_alive(self) -> bool:
        """Whether another process may be using the store now (a Turn's end taken there
        must be watched for during a model call); always False on SQLite."""
        ...

    async def due_agents(self, limit: int) -> list[str]: ...
    async def claim_due(self, agent_id: str, limit: int) -> list[InboxRow]: ...
    async def claim_next(
        self,
        agent_id: str,
        max_steps: int,
        guardrails: bool,
        check: Callable[[InboxRow], str | None],
        hold_for: HoldFor | None = None,
    ) -> Claimed | None:
        """Claim the agent's next due row and take its first step in the same
        transaction (:func:`~agentserver.agents.store.sql.claims.claim_next`; a backend
        may only claim, returning a bare :class:`Claimed`). Raises what the step
        raises, with nothing claimed."""
        ...

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
        screened: StepRecord | None = None,
        spends: Sequence[Spend] = (),
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
        *,
        completion: LLMCompletion | None = None,
        step_cards: Sequence[NewCard] = (),
        screened: StepRecord | None = None,
        spends: Sequence[Spend] = (),
    ) -> int:
        """running → suspended; returns how many reports that came early are due now.
        With ``completion`` and ``step_cards`` (and governance's ``screened`` record),
        the step's reply is written in the same compare-and-set: one transaction."""
        ...

    async def apply_report(self, row: InboxRow, *, then_step: int | None = None) -> ReportOutcome:
        """Apply a report; with ``then_step`` (the step limit), a resume also opens the
        next step in the same transaction (:meth:`open_step`)."""
        ...

    async def apply_tool_result(
        self,
        agent_id: str,
        tool_call_id: str,
        payload: bytes,
        *,
        failed: bool,
        then_step: int | None = None,
        hold_for: HoldFor | None = None,
    ) -> ReportOutcome:
        """A peer's report, applied to its waiting set in the transaction that records
        it (no inbox row; a resume opens the next step with ``then_step``), or kept in
        the inbox when its Turn does not wait for it (``queued``)."""
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
        sent: Sequence[str] = (),
        spends: Sequence[Spend] = (),
    ) -> Finished:
        """running → idle with the deliverable and the reply; with ``step_id``, that step
        is completed first in the same transaction (``complete_step(token, step_id,
        completion, cards)``: the Turn's last step and its end, one compare-and-set).
        ``sent``: other Turns' replies sent since, marked so in the same transaction."""
        ...

    async def cards(self, box_id: str) -> list[Card]:
        """A box's cards in order; a context box's memory (sql/memory.py) first."""
        ...

    async def card(self, card_id: str) -> Card | None: ...
    async def turn_reply_ref(self, token: TurnToken) -> str | None: ...


class ReplyStore(Protocol):
    """A Turn's end from outside (stop, watchdog) and the reply outbox (the Turn's
    ender): replies sent, retried, handed to the process that holds the caller."""

    @property
    def replies_here(self) -> Doorbell | None:
        """Rings when a reply may be waiting for an anonymous caller connected here
        (:meth:`pending_replies_here`); None on SQLite, where every reply is this
        process's."""
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
    async def pending_replies(self, limit: int, older_than_s: float = 0.0) -> list[PendingReply]:
        """Replies not yet sent, created at least ``older_than_s`` ago."""
        ...

    async def mark_reply_sent(self, agent_turn_id: str) -> None: ...
    async def mark_replies_sent(self, agent_turn_ids: Sequence[str]) -> None:
        """Several replies marked sent, in one statement (:class:`SentMarks`' batches)."""
        ...

    async def mark_reply_attempt(self, agent_turn_id: str, give_up: bool) -> None: ...
    async def hand_over_reply(self, agent_turn_id: str, process: str) -> bool:
        """Leave a reply for its caller's process ``process`` and ring it (True), or give
        it up if that process is gone (False; always, on SQLite: one process)."""
        ...

    async def pending_replies_here(self, limit: int = 256) -> list[PendingReply]:
        """The pending replies other processes left for the anonymous callers connected
        to this one (none on SQLite)."""
        ...


class WatchdogStore(Protocol):
    """The watchdog and restart recovery: stuck rows, deadlines, lost tool calls, the
    calls to idempotent listeners sent again, replies left unsent."""

    async def due_agents(self, limit: int) -> list[str]: ...
    async def pending_replies(self, limit: int, older_than_s: float = 0.0) -> list[PendingReply]:
        """Replies not yet sent, created at least ``older_than_s`` ago."""
        ...

    async def turn_reply_ref(self, token: TurnToken) -> str | None: ...

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
    async def recover_running(self, lost_calls: LostCalls | None = None) -> list[TurnToken]:
        """Recover the running Turns left by a restart; a shared store also takes over
        a dead process's work, handing its suspended Turns' calls to ``lost_calls``
        (None: they are all reported lost)."""
        ...


class ClientReplyStore(Protocol):
    """Named clients' durable replies: kept until the client acknowledges them."""

    @property
    def client_replies(self) -> Doorbell | None:
        """Rings when some process kept a reply for a named client (None on SQLite: only
        this process keeps them, and it offers them itself)."""
        ...

    async def record_client_reply(
        self,
        client: str,
        thread_ref: Mapping[str, object],
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

    async def take_client_reply(self, client: str, reply_id: int) -> ClientReply | None:
        """Take a kept reply out of the store (its receipt) before writing it to a
        connection without acks; None if it is no longer kept."""
        ...

    async def restore_client_reply(self, reply: ClientReply) -> None:
        """Keep again, with its id, a reply taken that no connection wrote."""
        ...

    async def ack_client_replies(self, client: str, reply_ids: Sequence[int]) -> int:
        """Forget kept replies the client has received."""
        ...


class ConversationStore(Protocol):
    """Memory across tasks: a conversation's cards, compacted while idle, and forks."""

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
    async def fork(self, agent_id: str, thread: str, at_step: int) -> dict[str, Any]:
        """A forked conversation (agents/store/sql/forks.py). Raises ForkRefused."""
        ...


class ApprovalStore(Protocol):
    """Human approval of tool calls (agents/governance/approvals.py): requests sent,
    decided, timed out; a granted call forwarded."""

    async def unsent_approvals(self) -> list[PendingApproval]: ...
    async def pending_approvals(self, approver: str | None = None) -> list[PendingApproval]: ...
    async def approval_status(self, request_id: str) -> str | None: ...
    async def mark_approval_sent(
        self, request_id: str, events: Sequence[OutboxItem] = ()
    ) -> None: ...
    async def unsend_approvals(self, approvers: Sequence[str]) -> None: ...
    async def decide_approval(
        self, request_id: str, grant: bool, reason: str, by: str | None
    ) -> str: ...
    async def expire_approvals(self, now: float) -> int: ...
    async def begin_forward(self, row: InboxRow) -> tuple[str, TurnToken, str, str] | None: ...
    async def finish_forward(
        self, request_id: str, row: InboxRow, sub_thread: str, after: str, deadline: float
    ) -> None: ...
    async def fail_forward(self, request_id: str, row: InboxRow, text: str) -> None: ...
    async def turn_reply_ref(self, token: TurnToken) -> str | None: ...


class OperatorStore(Protocol):
    """The operator's cancel of queued tasks (console/operator.py)."""

    async def turn_of_thread(self, agent_id: str, caller_thread: str) -> str | None: ...
    async def cancel_queued(
        self, agent_id: str, caller_thread: str | None, failed_answer: bytes
    ) -> list[PendingReply]: ...


class ViewStore(Protocol):
    """Read-only views (HTTP API, metrics, replay's record) and the runner step log."""

    async def reachable(self) -> bool: ...
    async def agent_views(self, names: Sequence[str]) -> list[dict[str, Any]]: ...
    async def task_view(
        self, agent_id: str, thread: str, sender: str | None = None
    ) -> dict[str, Any] | None: ...
    async def recent_tasks(
        self, agent_id: str, limit: int = 20, sender: str | None = None
    ) -> list[dict[str, Any]]: ...
    async def task_sender(
        self, agent_id: str, thread: str, sender: str | None = None
    ) -> tuple[bool, str | None]: ...
    async def turn_task(self, agent_turn_id: str) -> tuple[str | None, str | None, str | None]: ...
    async def task_reading(
        self, agent_id: str, thread: str, sender: str | None = None
    ) -> dict[str, Any] | None: ...
    async def task_answer(self, thread: str) -> dict[str, Any] | None: ...
    async def turn_log(self, agent_turn_id: str) -> dict[str, Any]: ...
    async def turn_record(self, agent_id: str, thread: str) -> dict[str, Any] | None: ...
    async def turn_thread(self, agent_turn_id: str) -> tuple[str | None, str | None]: ...
    async def pending_approvals(self, approver: str | None = None) -> list[PendingApproval]: ...
    async def figures(self) -> Any: ...
    async def record_steps(self, rows: Sequence[Any]) -> None: ...
    async def step_rows(
        self, step: str | None, listener: str | None, after: int, limit: int
    ) -> list[Any]: ...


class A2aStore(Protocol):
    """The A2A tasks our agents were sent over A2A (agents/store/sql/a2a.py) and their
    push notifications (agents/store/sql/a2a_push.py)."""

    async def a2a_record(
        self,
        task_id: str,
        agent_id: str,
        context_id: str,
        owner: str,
        message_id: str,
        message: str,
    ) -> tuple[str, bool]: ...
    async def a2a_reject(self, task_id: str, text: str) -> None: ...
    async def a2a_task(self, task_id: str) -> dict[str, Any] | None: ...
    async def a2a_tasks(
        self,
        owner: str | None,
        context_id: str | None,
        agents: Sequence[str],
        limit: int,
        after: tuple[float, str] | None = None,
        keep: Callable[[dict[str, Any]], bool] | None = None,
    ) -> tuple[list[dict[str, Any]], int, bool]: ...
    async def a2a_push_put(self, task_id: str, config_id: str, config: str) -> None: ...
    async def a2a_push_configs(self, task_id: str) -> list[tuple[str, str]]: ...
    async def a2a_push_delete(self, task_id: str, config_id: str) -> bool: ...
    async def a2a_push_watched(self, limit: int) -> list[tuple[str, str, str | None]]: ...
    async def a2a_push_owe(
        self,
        task_id: str,
        config_id: str,
        seen: str | None,
        state: str,
        finished: bool,
        item: OutboxItem,
    ) -> bool: ...


class StoreLifecycle(Protocol):
    """The store's life in this process, and what differs when several processes share
    it (PostgreSQL) from one process owning it (SQLite, which answers the one-process
    values: not shared, nobody else alive, nothing handed over)."""

    @property
    def shared(self) -> bool:
        """Other processes may use this store: recovery at start takes over only the work
        of processes that are gone, and a caller's reply names the process that holds
        the caller's connection."""
        ...

    @property
    def owner(self) -> str:
        """This process's id in the store (the rows it owns, its lease on a shared
        store)."""
        ...

    async def serve(
        self,
        doorbell: Doorbell,
        lost_calls: LostCalls | None = None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The store's own background work until cancelled (PostgreSQL: rings from other
        processes, the lease, and the takeover of a dead process's work, whose suspended
        Turns' calls go to ``lost_calls`` (None: all reported lost); SQLite: WAL
        checkpoints off the trio thread, ``lost_calls`` unused: no other process can
        die)."""
        ...

    async def aclose(self) -> None: ...


class ScheduleStore(Protocol):
    """Schedules (docs/runs.md): definitions, and each tick claimed with its run queued in
    one transaction (agents/store/sql/schedules.py)."""

    async def put_schedule(
        self, spec: ScheduleSpec, source: str, next_tick: float, *, new: bool
    ) -> bool: ...
    async def drop_boot_schedules(self, keep: Sequence[str]) -> int: ...
    async def delete_schedule(self, name: str) -> None: ...
    async def set_schedule_paused(
        self, name: str, paused: bool, next_tick: float | None
    ) -> ScheduleRow: ...
    async def get_schedule(self, name: str) -> ScheduleRow: ...
    async def list_schedules(self) -> list[ScheduleRow]: ...
    async def skip_missed_ticks(
        self, name: str, tick: float, next_tick: float, count: int
    ) -> bool: ...
    async def fire_schedule(
        self,
        name: str,
        tick: float,
        next_tick: float | None,
        reply_ref: ReplyRef,
        conversation: str | None,
        cancelled_answer: bytes,
    ) -> Fired | None: ...
    async def schedule_runs(
        self, name: str | None = None
    ) -> list[tuple[str, float, str | None, str]]: ...


class UiSessionStore(Protocol):
    """The web console's sign-in sessions (agents/store/sql/ui_sessions.py), keyed by a
    hash of the session id; expiry in store time."""

    async def ui_session_put(
        self, id_hash: str, client: str, proof: str, lifetime_s: float
    ) -> float: ...
    async def ui_session_get(self, id_hash: str) -> tuple[str, str] | None: ...
    async def ui_session_delete(self, id_hash: str) -> bool: ...


class AgentStore(
    IntakeStore,
    ScheduleStore,
    UiSessionStore,
    TurnStore,
    ReplyStore,
    WatchdogStore,
    ClientReplyStore,
    ConversationStore,
    GovernanceStore,
    ApprovalStore,
    OperatorStore,
    ViewStore,
    A2aStore,
    StoreLifecycle,
    Protocol,
):
    """The whole store, every role: what the composition root (the runtime) holds and
    hands out by role; see the module docstring for the guarantees."""
