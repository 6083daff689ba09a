"""The facade the pump uses: intake (Enqueue, tool results, stop) and the run loop.

Construct one per server with :meth:`AgentRuntime.open`, call the intake methods from the
agent listeners' pump handlers, and run :meth:`AgentRuntime.run` in the server's nursery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
from lxml import etree

from agentserver.agents.clock import Clock
from agentserver.agents.doorbell import Doorbell
from agentserver.agents.errors import StaleTurn, StoreError
from agentserver.agents.events import EventBus
from agentserver.agents.governance.approvals import Approvals
from agentserver.agents.governance.budgets import Budgets
from agentserver.agents.ports import ReplyRef, ToolPort
from agentserver.agents.profile.agent import MULTITASK_MODES, AgentProfile, not_in_version
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import (
    AgentStore,
    Finished,
    LostCalls,
    MultitaskAnswers,
    NewCard,
    TaskStatus,
    TurnToken,
)
from agentserver.agents.store.served import ServedVersions
from agentserver.agents.store.sql import conversations, forks, inbox, replies
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.sql import multitask as sql_multitask
from agentserver.agents.store.sql import tools as sql_tools
from agentserver.agents.store.sql import versions as sql_versions
from agentserver.agents.store.sql import watchdog as sql_watchdog
from agentserver.agents.store.sql.multitask import BUSY_TEXT, ENDED_TEXT, SUPERSEDED_TEXT
from agentserver.agents.store.sqlite_store import SqliteAgentStore
from agentserver.agents.turn.answer import answer_bytes
from agentserver.agents.turn.compaction import SUMMARY, plan, summary_chunks, summary_max_tokens
from agentserver.agents.turn.compactor import summarise
from agentserver.agents.turn.delivery import SentMarks, TurnEnder
from agentserver.agents.turn.hold import TurnHold
from agentserver.agents.turn.memory import CLIENT, conversation_key
from agentserver.agents.turn.resend import resend_waiting
from agentserver.agents.turn.scheduler import Scheduler
from agentserver.agents.turn.watchdog import Watchdog
from agentserver.agents.turn.worker import Worker

if TYPE_CHECKING:
    from agentserver.agents.store.pg.store import PostgresAgentStore

log = logging.getLogger(__name__)

#: The default double-texting mode: a task waits its turn (no added cost).
ENQUEUE = MULTITASK_MODES[0]
#: How often a double text is decided again when the Turn it ends moved on meanwhile.
MULTITASK_ATTEMPTS = 3


def _bytes(payload: etree._Element | bytes) -> bytes:
    return payload if isinstance(payload, bytes) else etree.tostring(payload)


def open_agent_store(
    settings: StoreSettings,
    profiles: Mapping[str, AgentProfile],
    *,
    clock: Clock,
    served: ServedVersions | None = None,
) -> SqliteAgentStore | PostgresAgentStore:
    """Open (creating or migrating) the store of ``settings``: the PostgreSQL database of
    ``settings.url`` if set, else the SQLite file at ``settings.path``, with each
    profile's tool-result cap and the versions this process serves (``served``, default
    the profiles'). Blocking: call once at start. Closed by its ``aclose``
    (:meth:`AgentRuntime.aclose` for the runtime's)."""
    caps = {n: p.budget.tool_result_cap for n, p in profiles.items()}
    served = served if served is not None else served_versions(profiles)
    if settings.url:
        from agentserver.agents.store.pg.store import PostgresAgentStore

        return PostgresAgentStore.open(
            settings.url, clock=clock, settings=settings, tool_result_caps=caps, served=served
        )
    return SqliteAgentStore.open(
        settings.path, clock=clock, settings=settings, tool_result_caps=caps, served=served
    )


def served_versions(profiles: Mapping[str, AgentProfile]) -> ServedVersions:
    """The versions of ``profiles`` this process serves (the unversioned left out)."""
    versioned = {n: p for n, p in profiles.items() if p.version}
    return ServedVersions(
        versions={n: p.version for n, p in versioned.items()},
        digests={n: p.digest for n, p in versioned.items()},
        pinned=frozenset(n for n, p in versioned.items() if p.versioning == "pinned"),
    )


#: Forks whose task has not been enqueued yet, at most (the oldest are forgotten).
MAX_EXPECTED_FORKS = 1024


@dataclass(frozen=True)
class RuntimeParts:
    """Everything an :class:`AgentRuntime` runs, built by the composition root
    (``agentserver/app/runtime_parts.py``) and passed in whole: the runtime builds none
    of it, and nothing is assigned to a part after it is built."""

    store: AgentStore
    profiles: dict[str, AgentProfile]
    settings: StoreSettings
    clock: Clock
    events: EventBus
    doorbell: Doorbell
    tools: ToolPort
    #: The replies sent, marked so in batches (its flusher runs with the runtime).
    sent_marks: SentMarks
    ender: TurnEnder
    approvals: Approvals
    #: Fences and finishes the Turns the worker runs (its parts share it).
    hold: TurnHold
    worker: Worker
    watchdog: Watchdog
    #: Fires schedules (boot.xml's ``<schedules>`` and those made at run time).
    scheduler: Scheduler
    #: Spend budgets (None: none declared).
    budgets: Budgets | None = None
    #: Approvers that are listeners (their requests are sent again after a restart).
    listener_approvers: tuple[str, ...] = ()
    #: Listeners whose steps may be retried (``idempotent``): a call to one that a
    #: restart interrupted is sent again with its idempotency key, not reported lost.
    retryable_tools: frozenset[str] = frozenset()
    #: The agent versions this process serves (the store's and the worker's: one object),
    #: and whether it drains (docs/deploy.md).
    served: ServedVersions = field(default_factory=ServedVersions)


@dataclass(frozen=True, slots=True)
class Holding:
    """What a process holds (:meth:`AgentRuntime.drain`): Turns its runners are in, and
    tool calls it sent whose results have not come back."""

    turns: int = 0
    calls: int = 0

    @property
    def empty(self) -> bool:
        return not (self.turns or self.calls)


class EndedElsewhere:
    """What the scheduler does with a Turn it ended from outside its run (a schedule's
    cancel-other): this process's run of it is cancelled with its model call, its end
    published and answered."""

    def __init__(self, worker: Worker, ender: TurnEnder) -> None:
        self.worker = worker
        self.ender = ender

    async def __call__(self, finished: Finished) -> None:
        self.worker.interrupt(finished.agent_id, finished.agent_turn_id)
        await self.ender.after(finished)


class AgentRuntime:
    """Store + worker + watchdog + event bus for a set of agent profiles: the intake the
    pump's handlers call and the loop that runs the Turns, over the parts it is given."""

    def __init__(self, parts: RuntimeParts) -> None:
        self.store = parts.store
        self.budgets = parts.budgets
        self.tools = parts.tools
        self.retryable_tools = parts.retryable_tools
        #: (agent, caller thread) → forked conversation, until that task is enqueued.
        self._forks: dict[tuple[str, str | None], str] = {}
        #: What a shared store does with a dead process's suspended Turns' calls, handed
        #: to its recovery and its ``serve`` (the store is not told after it is built: it
        #: only needs this while the runtime runs it). Without retryable tools the store
        #: reports them all lost itself.
        # (Versioned agents too: a lost call to a tool their version lacks says so.)
        self._takeover: LostCalls | None = (
            self.lost_calls if self.retryable_tools or parts.served.versions else None
        )
        self.served = parts.served
        self.profiles = parts.profiles
        self.settings = parts.settings
        self.clock = parts.clock
        self.events = parts.events
        self.doorbell = parts.doorbell
        self.sent_marks = parts.sent_marks
        self.ender = parts.ender
        self.approvals = parts.approvals
        self.hold = parts.hold
        self.worker = parts.worker
        self.watchdog = parts.watchdog
        self.listener_approvers = parts.listener_approvers
        self.scheduler = parts.scheduler

    # -- intake (from the pump handlers) ---------------------------------------------
    async def enqueue(
        self,
        agent_id: str,
        payload: etree._Element | bytes,
        reply_ref: ReplyRef,
        *,
        multitask: str | None = None,
        conversation: str | None = None,
    ) -> str:
        """Durably accept a task for ``agent_id``; returns the inbox id.

        When this returns, the task is committed and will end with exactly one deliverable
        (even across a restart); only then is the doorbell rung. ``reply_ref`` must be
        JSON-serialisable (``TypeError``/``ValueError`` otherwise, nothing written).

        ``conversation``: the conversation the task belongs to, when the way in knows it
        (an A2A ``contextId``); else, under ``memory="client"``, its caller's. ``multitask``:
        this task's double-texting mode (docs/runs.md), else the agent's; with
        ``enqueue`` (the default) this is one plain enqueue. Otherwise the mode is applied
        in the same transaction (:meth:`_double_text`). Raises ValueError for a mode not
        in ``MULTITASK_MODES`` (nothing written).
        """
        if agent_id not in self.profiles:
            raise KeyError(f"unknown agent {agent_id!r}")
        profile = self.profiles[agent_id]
        if conversation is None and profile.memory == CLIENT:
            conversation = conversation_key(reply_ref)
        if self._forks and isinstance(reply_ref, dict):
            # The first task on a fork's thread continues the fork's conversation.
            conversation = self._forks.pop((agent_id, reply_ref.get("caller_thread")), conversation)
        mode = multitask or profile.multitask
        if mode != ENQUEUE and conversation is not None:
            return await self._double_text(agent_id, _bytes(payload), reply_ref, conversation, mode)
        result = await self.store.run(
            inbox.enqueue_turn, agent_id, _bytes(payload), reply_ref, conversation=conversation
        )
        self.doorbell.ring()
        return result.inbox_id

    async def _double_text(
        self, agent_id: str, payload: bytes, reply_ref: ReplyRef, conversation: str, mode: str
    ) -> str:
        """A task sent with double-texting ``mode``: one store transaction decides and
        applies it (agents/store/sql/multitask.py); then, as :meth:`stop` does, this
        process's run of the Turn it ended is cancelled with its model call in flight (a
        run in another process is fenced out by the epoch), and the answers it owes are
        sent (they are in the reply outbox already: a crash resends them). A transaction
        that loses a race for the head (the Turn it ends moved on) is rolled back whole and
        decided again, at most :data:`MULTITASK_ATTEMPTS` times."""
        if mode not in MULTITASK_MODES:
            raise ValueError(f"multitask must be one of {', '.join(MULTITASK_MODES)}")
        profile = self.profiles[agent_id]
        answers = MultitaskAnswers(
            busy=answer_bytes(profile, BUSY_TEXT, failed=True),
            ended=answer_bytes(profile, ENDED_TEXT.get(mode, ""), failed=True),
            superseded=answer_bytes(profile, SUPERSEDED_TEXT, failed=True),
        )
        for attempt in range(MULTITASK_ATTEMPTS):
            try:
                done = await self.store.run(
                    sql_multitask.enqueue_multitask,
                    agent_id,
                    payload,
                    reply_ref,
                    conversation=conversation,
                    mode=mode,
                    answers=answers,
                )
                break
            except StaleTurn:
                # The running Turn ended (or another double text ended it) between this
                # transaction's read and its compare-and-set: all of it rolled back;
                # decide again on the head as it is now.
                if attempt == MULTITASK_ATTEMPTS - 1:
                    raise
        if done.ended is not None:
            self.worker.interrupt(agent_id, done.ended.agent_turn_id)
            await self.ender.after(done.ended)
        for reply in done.replies:
            await self.ender.resend(reply)
        if done.outcome != "queued":
            log.info("%s: task %s %s (multitask=%s)", agent_id, done.inbox_id, done.outcome, mode)
        self.doorbell.ring()
        return done.inbox_id

    async def fork(self, agent_id: str, thread: str, at_step: int) -> dict[str, object]:
        """A new conversation of ``agent_id`` made of the cards of its latest Turn on
        ``thread`` up to step ``at_step`` (docs/agents.md, "Fork"); the original is only
        read. Returns its ``conversation`` key, its ``origin`` (thread, turn, step) and the
        original ``task``. Raises ForkRefused. One store transaction."""
        if agent_id not in self.profiles:
            raise KeyError(f"unknown agent {agent_id!r}")
        return await self.store.run(forks.fork, agent_id, thread, at_step)

    def expect_fork(self, agent_id: str, thread: str, conversation: str) -> None:
        """The next task of ``agent_id`` whose caller's thread is ``thread`` continues the
        forked ``conversation`` (the fork's task is sent through the pump next). Bounded:
        the oldest expectations go first past :data:`MAX_EXPECTED_FORKS`."""
        self._forks[agent_id, thread] = conversation
        while len(self._forks) > MAX_EXPECTED_FORKS:
            self._forks.pop(next(iter(self._forks)))

    async def report_tool_result(
        self,
        agent_id: str,
        tool_call_id: str,
        payload: etree._Element | bytes,
        *,
        failed: bool = False,
    ) -> str:
        """Record a peer's response (or ``<huh>``/``<SystemError>``, ``failed=True``) that
        arrived on the sub-thread ``tool_call_id`` of an earlier tool call; returns what
        recording it came to (``ReportOutcome.kind``).

        One transaction: the report is applied to its Turn's waiting set as it is
        recorded; when it completes the set, the Turn resumes (its next step opened) and
        is handed to this process's worker (:meth:`Worker.hand_over`), with no inbox row
        and no claim. Should the process die before the worker runs it, the Turn is a
        running one that recovery re-runs. A report its Turn does not wait for is kept in
        the inbox, as the worker handles it (a duplicate, or one before its suspend)."""
        profile = self.profiles.get(agent_id)
        if profile is not None and self.worker.hands_over(profile):
            # The Turn's next step is another process's (this one drains, or serves an
            # older version: docs/deploy.md), so the report is queued for whoever takes
            # it rather than resumed here.
            await self.store.run(
                inbox.report_tool_result, agent_id, tool_call_id, _bytes(payload), failed
            )
            self.doorbell.ring()
            return "queued"
        then_step = profile.resume_step_limit if profile else None
        # The step it opens reserves its first model call with it (spend budgets).
        hold_for = self.worker.model.hold_for(profile) if profile else None
        outcome = await self.store.run(
            sql_tools.apply_tool_result,
            agent_id,
            tool_call_id,
            _bytes(payload),
            failed=failed,
            then_step=then_step,
            hold_for=hold_for,
        )
        if outcome.resumed is not None:
            self.worker.hand_over(outcome)
        elif outcome.kind == "queued":
            self.doorbell.ring()
        return outcome.kind

    async def compact_conversation(self, agent_id: str, conversation: str) -> bool:
        """Fold an idle conversation's older cards into its rolling summary now (the same
        rule as before a model call, ``agents/turn/compaction.py``). False when there is nothing
        to fold, or a Turn of that conversation ended meanwhile (nothing written then).
        Raises ``LLMUnavailable`` when the summary call fails."""
        profile = self.profiles[agent_id]
        boxes = await self.store.read(conversations.conversation_boxes, agent_id, conversation)
        if boxes is None:
            return False
        cards = await self.store.read(conversations.conversation_cards, agent_id, conversation)
        p = plan(cards, profile.budget)
        if not p.older:
            return False
        budget = profile.budget
        summary = await summarise(
            self.worker.llm,
            agent_id,
            profile,
            p.previous_summary,
            summary_chunks(p, budget, summary_max_tokens(budget)),
        )
        keep = ([p.pinned.card_id] if p.pinned else []) + [c.card_id for c in p.recent]
        return await self.store.run(
            conversations.replace_conversation,
            agent_id,
            conversation,
            boxes,
            NewCard(SUMMARY, summary, {"folded_cards": len(p.older)}),
            keep,
        )

    async def stop(self, agent_id: str, agent_turn_id: str | None = None) -> bool:
        """End the agent's active Turn (or only ``agent_turn_id``) with a stopped deliverable.

        The end (and the lease of the next queued Turn) commits first; then this process's
        run of the Turn, if a runner is in it, is cancelled with its model call in flight
        (:meth:`Worker.interrupt`), so the next Turn starts at once rather than when that
        call returns (up to ``llm-timeout``). A run elsewhere (another process on a shared
        store) is fenced out by the epoch change. Returns False when there was nothing to
        stop."""
        finished = await self.ender.force_end(
            agent_id,
            TaskStatus.STOPPED,
            "the task was stopped",
            agent_turn_id=agent_turn_id,
            # Before the stopped answer is sent: the runner need not wait for its caller.
            ended=lambda f: self.worker.interrupt(f.agent_id, f.agent_turn_id),
        )
        return finished is not None

    # -- running ------------------------------------------------------------------------
    async def recover(self) -> None:
        """Start-up recovery; call before :meth:`run` starts the worker (run does it).

        Running Turns whose worker died are fenced and re-run from their last committed
        card; rows left in ``processing`` are requeued; replies committed but never sent
        are sent now.
        """
        await self.store.run(inbox.ensure_agents, list(self.profiles))
        recovered = await self.store.recover_running(self._takeover)
        if recovered:
            log.warning("recovered %d running turn(s) after a restart", len(recovered))
        if self.store.shared:
            # Other live processes own the other suspended Turns and unsent replies; the
            # store's leases hand over a dead process's (recover_running, then its loop).
            return
        # The pump's threads did not survive: a tool call in flight before the restart will
        # never be answered, so do not make its Turn wait out the whole resume deadline;
        # a call to a listener whose steps may be retried is sent again, with its key.
        for token in await self.store.read(sql_watchdog.suspended_turns):
            try:
                await self.lost_calls(token, "was interrupted by a restart")
            except StaleTurn:
                continue
        for reply in await self.store.read(replies.pending_replies, 10_000):
            await self.ender.resend(reply)

    async def lost_calls(self, token: TurnToken, reason: str) -> int:
        """The tool calls suspended Turn ``token`` waits for were lost (a restart, or the
        process that sent them died): those to listeners whose steps may be retried are
        sent again with their idempotency keys (agents/turn/resend.py), the others reported
        lost (a timeout result each, with ``reason``). Returns how many were lost. Raises
        StaleTurn when the Turn moved on."""
        profile = self.profiles.get(token.agent_id)
        deadline = self.clock.now() + (profile.resume_deadline_s if profile else 60.0)
        gone = 0
        if profile is not None and profile.version:
            pin = (await self.store.read(sql_head.read, token.agent_id)).turn_pin
            if pin is not None and pin != profile.version:
                # Pinned to a version this process does not serve: a call sent again
                # would come back here and resume the Turn on this version. Its calls are
                # reported lost; their results wait for a process of its version.
                return await self._report_lost(token, reason, None)
            # Calls to a tool this version does not have say so (docs/deploy.md), and are
            # never sent again.
            removed: dict[str, list[str]] = {}
            for call in await self.store.read(sql_tools.waiting_calls, token):
                if not profile.has_tool(call.to):
                    removed.setdefault(call.to, []).append(call.tool_call_id)
            for tool, ids in removed.items():
                text = f"{reason}, and {not_in_version(tool, profile)}"
                gone += await self.store.run(sql_tools.inject_timeouts, token, text, ids)
        sent, rest = 0, None
        if self.retryable_tools:
            sent, rest = await resend_waiting(
                self.store, self.tools, token, self.retryable_tools, deadline
            )
        if sent:
            log.warning("turn %s: %d tool call(s) sent again", token.agent_turn_id, sent)
        else:
            rest = None  # every waiting call: the deadline goes too
        return gone + (await self._report_lost(token, reason, rest) if rest != [] else 0)

    async def _report_lost(self, token: TurnToken, reason: str, only: list[str] | None) -> int:
        """A timeout result for each of ``only`` (None: every waiting call, the Turn's
        deadline cleared); how many."""
        lost = await self.store.run(sql_tools.inject_timeouts, token, reason, only)
        if lost:
            log.warning("turn %s: %d tool call(s) %s", token.agent_turn_id, lost, reason)
        return lost

    async def drain(
        self, progress: Callable[[Holding], None] | None = None, poll_s: float = 0.2
    ) -> None:
        """Take no new work, and return once this process holds none (``agentserver
        drain``, docs/deploy.md). From the call on, this process claims no new task and
        no ``upgrade`` Turn's row; the runs under way go on to their next step, where an
        ``upgrade`` Turn is handed over (fenced, with a ``resume`` row for a process
        serving the agent's newest version) and a pinned one goes on; a report for an
        ``upgrade`` Turn is queued for another process rather than resumed here. It holds
        nothing once no runner is in a Turn and no tool call this process sent is still
        out (their results come back to its pump). Polls every ``poll_s``, calling
        ``progress`` with what it still holds. Cancelling the wait leaves the process
        draining: it takes no new work until it exits."""
        self.served.draining = True
        await self.store.announce()
        self.doorbell.ring()
        while True:
            holding = await self.holding()
            if progress is not None:
                progress(holding)
            if holding.empty:
                return
            await trio.sleep(poll_s)

    async def holding(self) -> Holding:
        """What this process holds now (:meth:`drain`)."""
        owner = self.store.owner if self.store.shared else None
        calls = await self.store.read(sql_versions.calls_in_flight, owner)
        return Holding(turns=self.worker.busy, calls=calls)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Recover, then run the worker and the watchdog until cancelled."""
        await self.recover()
        async with trio.open_nursery() as nursery:
            # The store's own background work: PostgreSQL, rings from other processes and
            # leases; SQLite, WAL checkpoints off the trio thread.
            await nursery.start(self.store.serve, self.doorbell, self._takeover)
            await nursery.start(self.sent_marks.run)
            await nursery.start(self.worker.run)
            await nursery.start(self.watchdog.run)
            await nursery.start(self.approvals.run, self.listener_approvers)
            await nursery.start(self.scheduler.run)
            here = self.store.replies_here
            if here is not None:
                nursery.start_soon(self._answer_callers_here, here)
            task_status.started()

    async def _answer_callers_here(self, bell: Doorbell) -> None:
        """On a shared store: send the replies other processes left for the anonymous
        callers connected to this one (rung by NOTIFY, and by the listener's poll)."""
        while True:
            await bell.wait()
            try:
                pending = await self.store.pending_replies_here()
            except StoreError as exc:
                log.warning("replies for callers here: %s", exc)
                continue
            for reply in pending:
                await self.ender.resend(reply)

    async def aclose(self) -> None:
        await self.store.aclose()
