"""What happens after a Turn-ending transaction committed: the one TaskEvent and the reply.

Replies are written to the store's outbox (``agent_replies``) in the same transaction as
the deliverable, so a crash between commit and send loses nothing: the watchdog resends
pending replies (at least once; ``turn_id`` lets the pump drop a duplicate).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import trio
from lxml import etree

from agentserver.agents.doorbell import Doorbell
from agentserver.agents.errors import CallerElsewhere
from agentserver.agents.events import EventBus, StateEvent, TaskEvent
from agentserver.agents.ports import ReplyPort
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.store.base import AgentStore, Finished, PendingReply
from agentserver.agents.store.sql import replies as sql_replies
from agentserver.agents.store.sql import turn_end
from agentserver.agents.turn.answer import answer_bytes
from agentserver.core.xmlsafe import make_parser

log = logging.getLogger(__name__)


#: The most replies one batch marks sent (one statement's parameters).
MARKS_PER_BATCH = 256


class SentMarks:
    """Replies sent, marked so in the store in batches: every mark a flush finds waiting
    goes in one statement (a group commit: under load the marks of many Turns share one,
    idle each has its own after :data:`MARK_GATHER_S`), and a Turn's end that commits
    meanwhile takes the marks waiting into its own transaction (:meth:`take`), so that
    under load most cost no transaction at all. Until :meth:`run` runs, each is marked
    as it comes.

    A reply sent and not yet marked is resent by the watchdog after a crash, as it was
    between the send and its own mark before (at least once; ``turn_id`` lets the pump
    drop the duplicate): the batch only widens that window by the flush under way. On
    cancel, :meth:`run` writes what is waiting (bounded by :data:`FLUSH_ON_EXIT_S`)."""

    def __init__(self, store: AgentStore) -> None:
        self._store = store
        self._waiting: list[str] = []
        self._wake = trio.Event()
        self._running = False
        #: A Turn's end took marks since the flusher's window began.
        self._took = False

    def take(self) -> list[str]:
        """The marks waiting, handed to a transaction about to commit (a Turn's end:
        ``TurnHold.finish``), which writes them with its own; none when the flusher does
        not run. :meth:`give_back` them if it does not commit. Never blocks."""
        batch = self._waiting[:MARKS_PER_BATCH]
        del self._waiting[:MARKS_PER_BATCH]
        self._took = self._took or bool(batch)
        return batch

    def give_back(self, batch: list[str]) -> None:
        """Marks :meth:`take` handed to a transaction that did not commit: the flusher
        writes them (or the next transaction takes them)."""
        if batch:
            self._waiting[:0] = batch
            self._wake.set()

    async def mark(self, agent_turn_id: str) -> None:
        """Mark a Turn's reply sent: soon (the flusher's next batch), or now when the
        flusher does not run."""
        if not self._running:
            await self._store.run1(sql_replies.mark_reply_sent, agent_turn_id)
            return
        self._waiting.append(agent_turn_id)
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Flush the marks as they come, until cancelled."""
        self._running = True
        task_status.started()
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                # Let the runners' next marks join this batch, or a Turn's end take them:
                # no one waits on a mark. While Turns end within the window, the marks
                # waiting are newer than the last end's, so the next end takes them: a
                # mark waits at most about two windows.
                while True:
                    self._took = False
                    await trio.sleep(MARK_GATHER_S)
                    if not (self._took and self._waiting):
                        break
                while self._waiting:
                    await self._flush()
        finally:
            self._running = False
            with trio.move_on_after(FLUSH_ON_EXIT_S) as scope:
                scope.shield = True
                while self._waiting:
                    await self._flush()

    async def _flush(self) -> None:
        batch = self._waiting[:MARKS_PER_BATCH]
        del self._waiting[:MARKS_PER_BATCH]
        try:
            await self._store.run1(sql_replies.mark_replies_sent, batch)
        except Exception:
            # Left pending: the watchdog sends them again (the pump drops a duplicate).
            log.warning("%d replies sent but not marked so", len(batch), exc_info=True)


#: How long the first mark of a batch waits for others, or for a Turn's end to take it
#: (the reply itself went already: the mark only keeps the watchdog from sending it again
#: after a crash).
MARK_GATHER_S = 0.05
#: The longest :meth:`SentMarks.run` writes waiting marks once cancelled.
FLUSH_ON_EXIT_S = 5.0


@dataclass(frozen=True, slots=True)
class TurnEnder:
    """What a Turn's end sets off, whoever ended it (the worker, the watchdog, a stop):
    one per runtime, shared by all three so the sequence is written once."""

    store: AgentStore
    profiles: Mapping[str, AgentProfile]
    replies: ReplyPort
    events: EventBus
    doorbell: Doorbell
    max_attempts: int
    #: Marks the replies sent (in batches once its flusher runs).
    marks: SentMarks

    async def after(self, finished: Finished) -> None:
        """Publish the Turn's TaskEvent (exactly once: only the committing caller gets a
        ``Finished``), send its reply, and ring the doorbell if the next Turn was leased."""
        self.events.publish(
            TaskEvent(
                finished.agent_id,
                finished.agent_turn_id,
                finished.status,
                finished.output_box_id,
                finished.deliverable_card_id,
            )
        )
        self.events.publish(StateEvent(finished.agent_id, None, "idle"))
        if finished.next_leased:
            self.doorbell.ring()
        if finished.reply is not None:
            await self.resend(finished.reply)

    async def resend(self, reply: PendingReply) -> bool:
        """Send a committed reply (again) and record the outcome; True when sent. One
        that cannot be read is given up at once; one that fails to send, after
        ``max_attempts`` tries."""
        store, turn_id = self.store, reply.agent_turn_id
        try:
            ref = json.loads(reply.reply_ref_json)
            payload = etree.fromstring(reply.payload, make_parser())
        except (ValueError, etree.XMLSyntaxError):
            log.error("reply of turn %s is unreadable; giving up", turn_id)
            await store.run1(sql_replies.mark_reply_attempt, turn_id, give_up=True)
            return False
        try:
            await self.replies.deliver(ref, payload, failed=reply.failed, turn_id=turn_id)
        except CallerElsewhere as elsewhere:
            # Still pending: the process holding the caller's connection sends it.
            if not await store.hand_over_reply(turn_id, elsewhere.process):
                log.info("turn %s: the caller's process is gone; answer kept", turn_id)
            return False
        except Exception:
            log.warning("reply of turn %s not delivered", turn_id, exc_info=True)
            give_up = reply.attempts + 1 >= self.max_attempts
            await store.run1(sql_replies.mark_reply_attempt, turn_id, give_up=give_up)
            return False
        await self.marks.mark(turn_id)
        return True

    async def force_end(
        self,
        agent_id: str,
        status: str,
        text: str,
        *,
        agent_turn_id: str | None = None,
        turn_epoch: int | None = None,
        expect_status: Sequence[str] | None = None,
        ended: Callable[[Finished], object] | None = None,
    ) -> Finished | None:
        """End the agent's active Turn from outside the worker, answering its caller with
        ``text``; then :meth:`after`. ``ended`` is called (it must not block) as soon as
        the end commits, before the answer is sent. The Turn that ended, None when the
        fence matched no Turn (nothing ended)."""
        profile = self.profiles.get(agent_id)
        finished = await self.store.run(
            turn_end.force_end,
            agent_id,
            status,
            text,
            answer_bytes(profile, text, failed=True) if profile else None,
            agent_turn_id=agent_turn_id,
            turn_epoch=turn_epoch,
            expect_status=expect_status,
        )
        if finished is not None:
            if ended is not None:
                ended(finished)
            await self.after(finished)
        return finished
