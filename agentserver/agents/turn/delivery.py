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

from lxml import etree

from agentserver.agents.doorbell import Doorbell
from agentserver.agents.errors import CallerElsewhere
from agentserver.agents.events import EventBus, StateEvent, TaskEvent
from agentserver.agents.ports import ReplyPort
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.store.base import AgentStore, Finished, PendingReply
from agentserver.agents.turn.answer import answer_bytes
from agentserver.core.xmlsafe import make_parser

log = logging.getLogger(__name__)


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
            await store.mark_reply_attempt(turn_id, give_up=True)
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
            await store.mark_reply_attempt(turn_id, give_up=give_up)
            return False
        await store.mark_reply_sent(turn_id)
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
        finished = await self.store.force_end(
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
