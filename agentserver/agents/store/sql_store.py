"""The backend-neutral agent store: every :class:`~agentserver.agents.store.base.AgentStore`
method (and the governance store's) as one call of one :mod:`agentserver.agents.store.sql`
function inside one transaction.

A backend supplies :meth:`SqlAgentStore._run` (run a function in one transaction and
commit it, or roll it back and re-raise), :meth:`SqlAgentStore._read` (a read-only call;
by default a transaction too), :meth:`SqlAgentStore._run1` (a one-statement write; by
default a transaction too) and :meth:`SqlAgentStore.aclose`. Its hooks:
:attr:`SqlAgentStore.claim_lock` (the row-lock clause of a claim, e.g. PostgreSQL's
``FOR UPDATE SKIP LOCKED``).
"""

from __future__ import annotations

import abc
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

from agentserver.agents.clock import Clock
from agentserver.agents.errors import StoreError
from agentserver.agents.ports import LLMCompletion, ReplyRef
from agentserver.agents.profile.schedule import ScheduleSpec
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store import step_log
from agentserver.agents.store.base import (
    BoxSwap,
    Card,
    Claimed,
    ClientReply,
    DoubleText,
    EnqueueResult,
    Finished,
    Head,
    InboxRow,
    LostCalls,
    MultitaskAnswers,
    NewCard,
    PendingReply,
    ReportOutcome,
    StepStart,
    ToolCallRecord,
    TurnToken,
)
from agentserver.agents.store.budget_store import BudgetStore
from agentserver.agents.store.governance import DecisionRecord, PendingApproval, StepRecord
from agentserver.agents.store.outbox import OutboxItem
from agentserver.agents.store.outbox_calls import OutboxCalls
from agentserver.agents.store.rows import Fired, ScheduleRow
from agentserver.agents.store.sql import (
    a2a,
    a2a_push,
    claims,
    common,
    conversations,
    forks,
    governance,
    head,
    inbox,
    memory,
    multitask,
    prune,
    prune_records,
    record,
    replies,
    schedules,
    stats,
    tombstones,
    tools,
    turn_end,
    turns,
    ui_sessions,
    views,
    watchdog,
)
from agentserver.agents.store.sql.budgets import HoldFor, Spend
from agentserver.agents.store.sql.db import StoreEnv, StoreFn, Tx
from agentserver.steps.log import StepRow

T = TypeVar("T")
P = ParamSpec("P")


class SqlAgentStore(OutboxCalls, BudgetStore, abc.ABC):
    """The store's logic over a backend's transactions (see the module docstring). A
    backend supplies :meth:`_run` and :meth:`aclose`; it cannot be instantiated without."""

    #: The row-lock clause appended to a claim's inner SELECT (a fixed SQL fragment).
    claim_lock: str = ""

    def __init__(
        self,
        clock: Clock,
        settings: StoreSettings,
        tool_result_caps: Mapping[str, int] | None = None,
    ) -> None:
        self.env = StoreEnv(clock, settings, dict(tool_result_caps or {}))
        self.settings = settings

    @property
    def _clock(self) -> Clock:
        return self.env.clock

    @property
    def tool_result_caps(self) -> dict[str, int]:
        """agent id → the most tokens one tool result is shown with (given at creation)."""
        return self.env.tool_result_caps

    # -- the backend's part ---------------------------------------------------------------
    @abc.abstractmethod
    async def _run(self, fn: StoreFn[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Call ``fn(tx, env, *args)`` in one transaction; commit, or roll back and raise."""

    async def _read(self, fn: StoreFn[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """A call that writes nothing (the backend may skip the transaction)."""
        return await self._run(fn, *args, **kwargs)

    async def _run1(self, fn: StoreFn[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """A call that runs exactly one statement, so it is atomic by itself (the backend
        may run it in autocommit, saving the ``BEGIN``/``COMMIT`` round trips)."""
        return await self._run(fn, *args, **kwargs)

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the backend's connections (and, for SQLite, the file's lock)."""

    # -- intake -----------------------------------------------------------------------------
    async def ensure_agents(self, agent_ids: Sequence[str]) -> None:
        await self._run(inbox.ensure_agents, list(agent_ids))

    async def enqueue_turn(
        self, agent_id: str, payload: bytes, reply_ref: ReplyRef, *, conversation: str | None = None
    ) -> EnqueueResult:
        return await self._run(inbox.enqueue_turn, agent_id, payload, reply_ref, conversation)

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
        return await self._run(
            multitask.enqueue_multitask,
            agent_id,
            payload,
            reply_ref,
            conversation,
            mode,
            answers,
        )

    async def report_tool_result(
        self, agent_id: str, tool_call_id: str, payload: bytes, *, failed: bool
    ) -> str:
        return await self._run(inbox.report_tool_result, agent_id, tool_call_id, payload, failed)

    # -- schedules --------------------------------------------------------------------------
    async def put_schedule(
        self, spec: ScheduleSpec, source: str, next_tick: float, *, new: bool
    ) -> bool:
        return await self._run(schedules.put_schedule, spec, source, next_tick, new)

    async def drop_boot_schedules(self, keep: Sequence[str]) -> int:
        return await self._run(schedules.drop_boot_schedules, list(keep))

    async def delete_schedule(self, name: str) -> None:
        await self._run(schedules.delete_schedule, name)

    async def set_schedule_paused(
        self, name: str, paused: bool, next_tick: float | None
    ) -> ScheduleRow:
        return await self._run(schedules.set_paused, name, paused, next_tick)

    async def get_schedule(self, name: str) -> ScheduleRow:
        return await self._read(schedules.get_schedule, name)

    async def list_schedules(self) -> list[ScheduleRow]:
        return await self._read(schedules.list_schedules)

    async def skip_missed_ticks(self, name: str, tick: float, next_tick: float, count: int) -> bool:
        return await self._run(schedules.skip_missed, name, tick, next_tick, count)

    async def fire_schedule(
        self,
        name: str,
        tick: float,
        next_tick: float | None,
        reply_ref: ReplyRef,
        conversation: str | None,
        cancelled_answer: bytes,
    ) -> Fired | None:
        return await self._run(
            schedules.fire, name, tick, next_tick, reply_ref, conversation, cancelled_answer
        )

    async def schedule_runs(
        self, name: str | None = None
    ) -> list[tuple[str, float, str | None, str]]:
        return await self._read(schedules.runs, name)

    # -- worker -----------------------------------------------------------------------------
    async def due_agents(self, limit: int) -> list[str]:
        return await self._read(inbox.due_agents, limit)

    async def claim_due(self, agent_id: str, limit: int) -> list[InboxRow]:
        return await self._run1(inbox.claim_due, agent_id, limit, self.claim_lock)

    async def claim_next(
        self,
        agent_id: str,
        max_steps: int,
        guardrails: bool,
        check: claims.TaskCheck,
        hold_for: HoldFor | None = None,
    ) -> Claimed | None:
        return await self._run(
            claims.claim_next, agent_id, max_steps, guardrails, check, self.claim_lock, hold_for
        )

    async def head(self, agent_id: str) -> Head:
        return await self._read(head.read, agent_id)

    async def start_turn(self, row: InboxRow) -> TurnToken:
        return await self._run(turns.start_turn, row)

    async def skip_row(self, row: InboxRow, reason: str) -> None:
        await self._run1(turns.skip_row, row, reason)

    async def fail_turn_row(
        self, row: InboxRow, reason: str, reply_payload: bytes | None
    ) -> Finished | None:
        return await self._run(turn_end.fail_turn_row, row, reason, reply_payload)

    async def begin_step(self, token: TurnToken) -> tuple[str, int]:
        return await self._run(turns.begin_step, token)

    async def open_step(self, token: TurnToken, max_steps: int) -> StepStart:
        return await self._run(turns.open_step, token, max_steps)

    async def start_turn_step(self, row: InboxRow, max_steps: int) -> StepStart:
        return await self._run(turns.start_turn_step, row, max_steps)

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
        if not screened:
            await self._run(turns.complete_step, token, step_id, completion, cards, swap, spends)
            return
        if swap is not None:
            raise ValueError("a step's governance record cannot be written with a box swap")
        await self._run(
            governance.complete_screened_step, token, step_id, completion, cards, screened, spends
        )

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
        if not calls:
            raise ValueError("suspend needs at least one tool call")
        # By position: PostgreSQL's one-trip form is taken only for a call without names.
        return await self._run(
            tools.suspend,
            token,
            step_id,
            calls,
            cards,
            resume_deadline,
            completion,
            step_cards,
            screened,
            spends,
        )

    async def apply_report(self, row: InboxRow, *, then_step: int | None = None) -> ReportOutcome:
        return await self._run(tools.apply_report, row, then_step)

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
        return await self._run(
            tools.apply_tool_result, agent_id, tool_call_id, payload, failed, then_step, hold_for
        )

    async def take_resume(self, row: InboxRow) -> TurnToken | None:
        return await self._run(turns.take_resume, row)

    async def add_cards(self, token: TurnToken, cards: Sequence[NewCard]) -> None:
        await self._run(turns.add_cards, token, cards)

    async def compact(
        self,
        token: TurnToken,
        summary: NewCard,
        keep: Sequence[str],
        *,
        edge: Mapping[str, Any] | None = None,
    ) -> int:
        return await self._run(turns.compact, BoxSwap(summary, tuple(keep), edge or {}), token)

    async def add_context_tokens(self, token: TurnToken, delta: int) -> None:
        if delta > 0:
            await self._run1(turns.add_context_tokens, token, delta)

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
        return await self._run(turns.retry_step, token, step_id, attempt, kind, delay_s, error)

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
        if step_id is None and (cards or spends):
            raise ValueError("cards and spends are written with the step they close")
        return await self._run(
            turn_end.finish,
            token,
            status,
            text,
            metadata,
            reply_payload,
            step_id,
            completion,
            list(cards),
            list(sent),
            list(spends),
        )

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
    ) -> Finished | None:
        return await self._run(
            turn_end.force_end,
            agent_id,
            status,
            text,
            reply_payload,
            agent_turn_id,
            turn_epoch,
            expect_status,
        )

    async def cards(self, box_id: str) -> list[Card]:
        return await self._read(_cards, box_id)

    async def card(self, card_id: str) -> Card | None:
        return await self._read(_card, card_id)

    async def turn_reply_ref(self, token: TurnToken) -> str | None:
        return await self._read(turns.turn_reply_ref, token)

    # -- watchdog ---------------------------------------------------------------------------
    async def requeue_stuck(self, older_than_s: float) -> int:
        return await self._run1(inbox.requeue_stuck, older_than_s)

    async def expired_suspensions(self) -> list[TurnToken]:
        return await self._read(watchdog.expired_suspensions)

    async def suspended_turns(self) -> list[TurnToken]:
        return await self._read(watchdog.suspended_turns)

    async def inject_timeouts(
        self, token: TurnToken, reason: str = "timed out", only: Sequence[str] | None = None
    ) -> int:
        return await self._run(tools.inject_timeouts, token, reason, only)

    async def waiting_calls(self, token: TurnToken) -> list[ToolCallRecord]:
        return await self._read(tools.waiting_calls, token)

    async def rebind_call(
        self, token: TurnToken, old: str, new: str, resume_deadline: float
    ) -> None:
        await self._run(tools.rebind_call, token, old, new, resume_deadline)

    async def stale_dispatched(self, older_than_s: float) -> list[Head]:
        return await self._read(watchdog.stale_dispatched, older_than_s)

    async def overdue_running(self, older_than_s: float) -> list[Head]:
        return await self._read(watchdog.overdue_running, older_than_s)

    async def recover_running(self, lost_calls: LostCalls | None = None) -> list[TurnToken]:
        # ``lost_calls``: unused here; a shared store's override takes over the dead.
        return await self._run(watchdog.recover_running)

    # -- replies ----------------------------------------------------------------------------
    async def pending_replies(self, limit: int, older_than_s: float = 0.0) -> list[PendingReply]:
        return await self._read(replies.pending_replies, limit, older_than_s)

    async def mark_reply_sent(self, agent_turn_id: str) -> None:
        await self._run1(replies.mark_reply_sent, agent_turn_id)

    async def mark_replies_sent(self, agent_turn_ids: Sequence[str]) -> None:
        await self._run1(replies.mark_replies_sent, list(agent_turn_ids))

    async def mark_reply_attempt(self, agent_turn_id: str, give_up: bool) -> None:
        await self._run1(replies.mark_reply_attempt, agent_turn_id, give_up)

    async def record_client_reply(
        self,
        client: str,
        thread_ref: Mapping[str, object],
        payload: bytes,
        *,
        failed: bool,
        agent_turn_id: str | None = None,
    ) -> int:
        return await self._run(
            replies.record_client_reply, client, thread_ref, payload, failed, agent_turn_id
        )

    async def pending_client_replies(
        self, client: str, after_id: int = 0, limit: int = 100
    ) -> list[ClientReply]:
        return await self._read(replies.pending_client_replies, client, after_id, limit)

    async def take_client_reply(self, client: str, reply_id: int) -> ClientReply | None:
        return await self._run1(replies.take_client_reply, client, reply_id)

    async def restore_client_reply(self, reply: ClientReply) -> None:
        await self._run1(replies.restore_client_reply, reply)

    async def ack_client_replies(self, client: str, reply_ids: Sequence[int]) -> int:
        if not reply_ids:
            return 0
        return await self._run1(replies.ack_client_replies, client, list(reply_ids))

    async def turn_of_thread(self, agent_id: str, caller_thread: str) -> str | None:
        return await self._read(replies.turn_of_thread, agent_id, caller_thread)

    async def cancel_queued(
        self, agent_id: str, caller_thread: str | None, failed_answer: bytes
    ) -> list[PendingReply]:
        return await self._run(replies.cancel_queued, agent_id, caller_thread, failed_answer)

    # -- memory across tasks ----------------------------------------------------------------
    async def conversation_cards(self, agent_id: str, conversation: str) -> list[Card]:
        return await self._read(conversations.conversation_cards, agent_id, conversation)

    async def conversation_boxes(self, agent_id: str, conversation: str) -> tuple[str, str] | None:
        return await self._read(conversations.conversation_boxes, agent_id, conversation)

    async def replace_conversation(
        self,
        agent_id: str,
        conversation: str,
        expect_boxes: tuple[str, str],
        summary: NewCard,
        keep: Sequence[str],
    ) -> bool:
        return await self._run(
            conversations.replace_conversation,
            agent_id,
            conversation,
            (expect_boxes[0], expect_boxes[1]),
            summary,
            list(keep),
        )

    # -- governance (agents/governance/governor.py, agents/governance/approvals.py) ------------------------------
    async def rate_window(self, rate_key: str, since: float) -> list[float]:
        return await self._read(governance.rate_window, rate_key, since)

    async def record_decisions(
        self,
        token: TurnToken,
        step_id: str,
        decisions: Sequence[DecisionRecord],
        cards: Sequence[NewCard],
        approvals: Sequence[PendingApproval] = (),
    ) -> None:
        await self._run(governance.record_decisions, token, step_id, decisions, cards, approvals)

    async def turn_decisions(self, agent_turn_id: str) -> list[DecisionRecord]:
        return await self._read(governance.turn_decisions, agent_turn_id)

    async def unsent_approvals(self) -> list[PendingApproval]:
        return await self._read(governance.unsent_approvals)

    async def pending_approvals(self, approver: str | None = None) -> list[PendingApproval]:
        return await self._read(governance.pending_approvals, approver)

    async def approval_status(self, request_id: str) -> str | None:
        return await self._read(governance.approval_status, request_id)

    async def mark_approval_sent(self, request_id: str, events: Sequence[OutboxItem] = ()) -> None:
        if events:
            await self._run(governance.mark_approval_sent, request_id, list(events))
        else:
            await self._run1(governance.mark_approval_sent, request_id)

    async def unsend_approvals(self, approvers: Sequence[str]) -> None:
        if approvers:
            await self._run1(governance.unsend_approvals, list(approvers))

    async def decide_approval(
        self, request_id: str, grant: bool, reason: str, by: str | None
    ) -> str:
        return await self._run(governance.decide_approval, request_id, grant, reason, by)

    async def expire_approvals(self, now: float) -> int:
        return await self._run(governance.expire_approvals, now)

    async def begin_forward(self, row: InboxRow) -> tuple[str, TurnToken, str, str] | None:
        return await self._run(governance.begin_forward, row)

    async def finish_forward(
        self, request_id: str, row: InboxRow, sub_thread: str, after: str, deadline: float
    ) -> None:
        await self._run(governance.finish_forward, request_id, row, sub_thread, after, deadline)

    async def fail_forward(self, request_id: str, row: InboxRow, text: str) -> None:
        await self._run(governance.fail_forward, request_id, row, text)

    # -- read-only views (HTTP API, metrics) and the runner step log -------------------------
    async def reachable(self) -> bool:
        """Whether the store answers a query now (``/readyz``)."""
        try:
            await self._read(views.ping)
        except (StoreError, sqlite3.Error):
            return False
        return True

    async def agent_views(self, names: Sequence[str]) -> list[dict[str, Any]]:
        return await self._read(views.agents, list(names))

    async def task_view(
        self, agent_id: str, thread: str, sender: str | None = None
    ) -> dict[str, Any] | None:
        return await self._read(views.task, agent_id, thread, sender)

    async def task_reading(
        self, agent_id: str, thread: str, sender: str | None = None
    ) -> dict[str, Any] | None:
        return await self._read(views.task_reading, agent_id, thread, sender)

    async def recent_tasks(
        self, agent_id: str, limit: int = 20, sender: str | None = None
    ) -> list[dict[str, Any]]:
        return await self._read(views.recent_tasks, agent_id, limit, sender)

    async def task_sender(
        self, agent_id: str, thread: str, sender: str | None = None
    ) -> tuple[bool, str | None]:
        return await self._read(views.task_sender, agent_id, thread, sender)

    async def turn_task(self, agent_turn_id: str) -> tuple[str | None, str | None, str | None]:
        return await self._read(views.turn_task, agent_turn_id)

    async def task_answer(self, thread: str) -> dict[str, Any] | None:
        """The latest task sent on the caller's ``thread``, with its sender and answer."""
        return await self._read(views.task_answer, thread)

    async def turn_log(self, agent_turn_id: str) -> dict[str, Any]:
        return await self._read(views.turn_log, agent_turn_id)

    async def fork(self, agent_id: str, thread: str, at_step: int) -> dict[str, Any]:
        """A forked conversation (agents/store/sql/forks.py). Raises ForkRefused."""
        return await self._run(forks.fork, agent_id, thread, at_step)

    async def turn_record(self, agent_id: str, thread: str) -> dict[str, Any] | None:
        """The latest Turn of ``agent_id`` on ``thread``, whole (agents/store/sql/record.py)."""
        return await self._read(record.turn_record, agent_id, thread)

    async def turn_thread(self, agent_turn_id: str) -> tuple[str | None, str | None]:
        return await self._read(views.turn_thread, agent_turn_id)

    # -- A2A tasks (agents/store/sql/a2a.py) ---------------------------------------------------
    async def a2a_record(
        self,
        task_id: str,
        agent_id: str,
        context_id: str,
        owner: str,
        message_id: str,
        message: str,
    ) -> tuple[str, bool]:
        """Record an A2A task unless ``owner`` sent ``message_id`` before: (its id, new?)."""
        return await self._run(
            a2a.record, task_id, agent_id, context_id, owner, message_id, message
        )

    async def a2a_reject(self, task_id: str, text: str) -> None:
        await self._run1(a2a.reject, task_id, text)

    async def a2a_task(self, task_id: str) -> dict[str, Any] | None:
        return await self._read(a2a.task, task_id)

    async def a2a_tasks(
        self,
        owner: str | None,
        context_id: str | None,
        agents: Sequence[str],
        limit: int,
        after: tuple[float, str] | None = None,
        keep: Callable[[dict[str, Any]], bool] | None = None,
    ) -> tuple[list[dict[str, Any]], int, bool]:
        return await self._read(a2a.tasks, owner, context_id, list(agents), limit, after, keep)

    async def a2a_push_put(self, task_id: str, config_id: str, config: str) -> None:
        await self._run1(a2a_push.put_config, task_id, config_id, config)

    async def a2a_push_configs(self, task_id: str) -> list[tuple[str, str]]:
        return await self._read(a2a_push.configs, task_id)

    async def a2a_push_delete(self, task_id: str, config_id: str) -> bool:
        return await self._run1(a2a_push.delete_config, task_id, config_id)

    async def a2a_push_watched(self, limit: int) -> list[tuple[str, str, str | None]]:
        return await self._read(a2a_push.watched, limit)

    async def a2a_push_owe(
        self,
        task_id: str,
        config_id: str,
        seen: str | None,
        state: str,
        finished: bool,
        item: OutboxItem,
    ) -> bool:
        return await self._run(a2a_push.owe, task_id, config_id, seen, state, finished, item)

    async def figures(self) -> views.FigureRows:
        return await self._read(views.figures)

    async def record_steps(self, rows: Sequence[StepRow]) -> None:
        """Insert step-log rows in one transaction (their ``seq`` set once committed)."""
        if rows:
            await self._run(step_log.record_rows, list(rows))

    async def step_rows(
        self, step: str | None, listener: str | None, after: int, limit: int
    ) -> list[StepRow]:
        return await self._read(step_log.select_rows, step, listener, after, limit)

    # -- retention (agents/store/sql/prune.py; the pruner is agents/store/pruner.py) --------
    async def take_prune_lease(self, owner: str, lease_s: float) -> bool:
        return await self._run(prune.take_lease, owner, lease_s)

    async def release_prune_lease(self, owner: str) -> None:
        await self._run(prune.release_lease, owner)

    async def prune_tasks(
        self,
        owner: str | None,
        agent_id: str,
        max_age_s: float,
        keep_last: int | None,
        limit: int,
        dry_run: bool = False,
        after: int = 0,
    ) -> prune.Pruned:
        """One batch of finished tasks (one transaction; see ``prune.prune_tasks``)."""
        return await self._run(
            prune.prune_tasks, owner, agent_id, max_age_s, keep_last, limit, dry_run, after
        )

    async def rehearse_prune(
        self, passes: Sequence[tuple[str, str, tuple[Any, ...], bool]]
    ) -> list[tuple[str, prune.Pruned]]:
        """Run the passes of a prune (each: its kind, the batch method of this store, its
        arguments between the owner and the limit, whether it resumes after a key) in one
        transaction, then roll it back (``prune.rehearse``): what each batch removed."""
        batches = {
            "prune_tasks": prune.prune_tasks,
            "prune_orphan_boxes": prune.prune_orphan_boxes,
            "prune_events": prune.prune_events,
            "prune_replies": prune.prune_replies,
            "prune_step_log": prune.prune_step_log,
            "prune_tombstones": tombstones.prune_tombstones,
            "prune_deliveries": prune_records.prune_deliveries,
            "prune_schedule_runs": prune_records.prune_schedule_runs,
            "prune_refused_a2a_tasks": prune_records.prune_refused_a2a_tasks,
        }
        plan = [(kind, batches[method], args, paged) for kind, method, args, paged in passes]
        try:
            await self._run(prune.rehearse, plan)
        except prune.Rehearsed as done:
            return done.results
        raise StoreError("a prune rehearsal ended without rolling back")

    async def prune_orphan_boxes(
        self,
        owner: str | None,
        agent_id: str,
        max_age_s: float,
        limit: int,
        dry_run: bool = False,
    ) -> prune.Pruned:
        return await self._run(prune.prune_orphan_boxes, owner, agent_id, max_age_s, limit, dry_run)

    async def prune_events(
        self,
        owner: str | None,
        agent_id: str,
        max_age_s: float,
        limit: int,
        dry_run: bool = False,
        after: int = 0,
    ) -> prune.Pruned:
        return await self._run(
            prune.prune_events, owner, agent_id, max_age_s, limit, dry_run, after
        )

    async def prune_replies(
        self, owner: str | None, max_age_s: float, limit: int, dry_run: bool = False
    ) -> prune.Pruned:
        return await self._run(prune.prune_replies, owner, max_age_s, limit, dry_run)

    async def prune_step_log(
        self,
        owner: str | None,
        max_age_s: float,
        limit: int,
        dry_run: bool = False,
        after: int = 0,
    ) -> prune.Pruned:
        return await self._run(prune.prune_step_log, owner, max_age_s, limit, dry_run, after)

    async def prune_tombstones(
        self, owner: str | None, max_age_s: float, limit: int, dry_run: bool = False
    ) -> prune.Pruned:
        return await self._run(tombstones.prune_tombstones, owner, max_age_s, limit, dry_run)

    async def prune_deliveries(
        self,
        owner: str | None,
        max_age_s: float,
        limit: int,
        dry_run: bool = False,
        after: int = 0,
    ) -> prune.Pruned:
        return await self._run(
            prune_records.prune_deliveries, owner, max_age_s, limit, dry_run, after
        )

    async def prune_schedule_runs(
        self, owner: str | None, agent_id: str, max_age_s: float, limit: int, dry_run: bool = False
    ) -> prune.Pruned:
        return await self._run(
            prune_records.prune_schedule_runs, owner, agent_id, max_age_s, limit, dry_run
        )

    async def prune_refused_a2a_tasks(
        self, owner: str | None, agent_id: str, max_age_s: float, limit: int, dry_run: bool = False
    ) -> prune.Pruned:
        return await self._run(
            prune_records.prune_refused_a2a_tasks, owner, agent_id, max_age_s, limit, dry_run
        )

    async def store_agents(self) -> list[str]:
        """Every agent the store has rows of (configured or not any more)."""
        return await self._read(stats.agent_ids)

    async def record_agents(self) -> tuple[list[str], list[str]]:
        """(agents with schedules, agents with refused A2A tasks), for the pruner."""
        return await self._read(stats.record_agents)

    async def table_stats(self) -> list[tuple[str, int, int | None, float | None]]:
        """Rows, bytes and oldest row time per table (see ``stats.table_stats``)."""
        return await self._read(stats.table_stats)

    # -- the web console's sessions (agents/store/sql/ui_sessions.py) -----------------------
    async def ui_session_put(
        self, id_hash: str, client: str, proof: str, lifetime_s: float
    ) -> float:
        """Store a sign-in session; when it expires (store time)."""
        return await self._run(ui_sessions.put_session, id_hash, client, proof, lifetime_s)

    async def ui_session_get(self, id_hash: str) -> tuple[str, str] | None:
        """(client, proof) of a live session, or None (unknown, signed out, expired)."""
        return await self._read(ui_sessions.get_session, id_hash)

    async def ui_session_delete(self, id_hash: str) -> bool:
        """Revoke a session; False if there was none."""
        return await self._run1(ui_sessions.delete_session, id_hash)

    async def reclaim_pages(self, max_pages: int) -> int:
        """Give up to ``max_pages`` free pages back to the file system; how many went.
        Only SQLite with ``auto_vacuum=INCREMENTAL`` has any (PostgreSQL leaves bloat to
        autovacuum): 0 here."""
        return 0

    async def checkpoint_after_prune(self) -> None:
        """After a prune run: copy the write-ahead log back so it can start over (SQLite,
        :class:`~agentserver.agents.store.sqlite_store.SqliteAgentStore`). PostgreSQL's
        WAL is the server's own business: nothing here."""


def _cards(tx: Tx, env: StoreEnv, box_id: str) -> list[Card]:
    # A context box's memory first: it names its conversation's cards, not copies.
    return memory.box_cards(tx, box_id)


def _card(tx: Tx, env: StoreEnv, card_id: str) -> Card | None:
    return common.card(tx, card_id)
