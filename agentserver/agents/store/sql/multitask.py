"""Double texting (docs/runs.md): a new task of a conversation while an earlier task of
that conversation is queued or running, decided and applied in one transaction."""

from __future__ import annotations

import json
from typing import Any

from agentserver.agents.errors import StaleTurn
from agentserver.agents.ports import ReplyRef
from agentserver.agents.store.rows import (
    DoubleText,
    MultitaskAnswers,
    PendingReply,
    TaskStatus,
)
from agentserver.agents.store.sql import a2a, head, turn_end
from agentserver.agents.store.sql.common import inbox_move
from agentserver.agents.store.sql.db import StoreEnv, Tx, new_id
from agentserver.agents.store.sql.inbox import queue
from agentserver.agents.store.states import (
    ACTIVE_HEAD,
    HeadStatus,
    InboxEvent,
    InboxStatus,
    MessageType,
    ReplyStatus,
)

REJECT = "reject"
INTERRUPT = "interrupt"
ROLLBACK = "rollback"

#: The deliverable's text of a running Turn a newer task ended, by mode.
ENDED_TEXT = {
    INTERRUPT: "interrupted: a newer task of this conversation runs next",
    ROLLBACK: "rolled back: a newer task of this conversation runs next",
}
#: A rejected task's answer.
BUSY_TEXT = "the conversation is busy: an earlier task of it is queued or running"
#: An earlier queued task's answer when a newer one replaced it.
SUPERSEDED_TEXT = "superseded: a newer task of this conversation runs instead"

_HEAD = (
    "SELECT h.status, h.active_agent_turn_id, i.conversation FROM agent_state_head h "
    "LEFT JOIN agent_inbox i ON i.inbox_id = h.turn_inbox_id WHERE h.agent_id = ?"
)
_QUEUED = (
    "SELECT inbox_id, reply_ref FROM agent_inbox WHERE agent_id = ? AND conversation = ? "
    "AND message_type = ? AND status = ? ORDER BY seq"
)


def _answer(
    tx: Tx, env: StoreEnv, agent_id: str, key: str, ref: str | None, payload: bytes
) -> PendingReply | None:
    """A failed answer in the reply outbox (sent like a Turn's, resent after a crash)."""
    if ref is None:
        return None
    tx.execute(
        "INSERT INTO agent_replies (agent_turn_id, agent_id, reply_ref, payload, failed, "
        "status, created_at) VALUES (?,?,?,?,1,?,?)",
        (key, agent_id, ref, payload, ReplyStatus.PENDING, env.clock.now()),
    )
    return PendingReply(key, agent_id, ref, payload, True, 0)


def enqueue_multitask(
    tx: Tx,
    env: StoreEnv,
    agent_id: str,
    payload: bytes,
    reply_ref: ReplyRef,
    *,
    conversation: str,
    mode: str,
    answers: MultitaskAnswers,
) -> DoubleText:
    """Queue the task of ``conversation`` and apply ``mode`` to the earlier tasks of it.

    Busy means: the head's active Turn is of ``conversation``, or a task of it is queued.
    Not busy (or mode ``enqueue``): exactly :func:`inbox.enqueue_turn`. ``reject``: the
    task's row is written ``skipped`` with its failed answer, nothing else changes.
    ``interrupt`` / ``rollback``: the queued earlier tasks are skipped, each with its
    failed answer; the running one is force-ended (stopped; under ``rollback`` the
    conversation does not continue from it) and the head leased to this task at once.
    Atomic: all of it or nothing. Raises ``StaleTurn`` (the caller decides again) when a
    queued earlier task was leased by another transaction after it was read. Raises
    ``TypeError``/``ValueError`` (nothing written) if ``reply_ref`` is not JSON. An A2A
    task enqueued before (sent again after a crash, docs/a2a.md) changes nothing."""
    ref_json = json.dumps(reply_ref)
    earlier = a2a.earlier_send(tx, env, agent_id, reply_ref)
    if earlier is not None:
        return DoubleText(earlier, "queued", False)
    inbox_id = new_id()
    found = tx.one(_HEAD, (agent_id,))
    if found is None:
        head.ensure(tx, env, agent_id)
    status, turn_id, running_conv = found if found is not None else (HeadStatus.IDLE, None, None)
    running = turn_id if status in ACTIVE_HEAD and running_conv == conversation else None
    queued: list[Any] = tx.all(
        _QUEUED, (agent_id, conversation, MessageType.TURN, InboxStatus.QUEUED)
    )
    queue(tx, env, inbox_id, agent_id, payload, ref_json, conversation)
    idle = status == HeadStatus.IDLE
    if mode not in (REJECT, INTERRUPT, ROLLBACK) or (running is None and not queued):
        return DoubleText(inbox_id, "queued", idle and head.lease_next(tx, env, agent_id))
    if mode == REJECT:
        inbox_move(tx, env, inbox_id, InboxEvent.CANCEL, defer_reason="conversation busy")
        busy = _answer(tx, env, agent_id, f"busy:{inbox_id}", ref_json, answers.busy)
        return DoubleText(inbox_id, "rejected", False, None, (busy,) if busy else ())
    replies: list[PendingReply] = []
    for earlier, ref in queued:
        if not inbox_move(tx, env, earlier, InboxEvent.CANCEL, defer_reason=f"superseded ({mode})"):
            # It was queued when read and is not now: on PostgreSQL (read committed) another
            # process's transaction leased it since (the end of the Turn ahead of it).
            # Going on would leave it to run, untouched by this mode, and this task to
            # wait behind it: all of this is rolled back and decided again on the new head.
            raise StaleTurn(f"{agent_id}: task {earlier} left the queue meanwhile")
        reply = _answer(tx, env, agent_id, f"superseded:{earlier}", ref, answers.superseded)
        if reply is not None:
            replies.append(reply)
    ended = None
    if running is not None:
        ended = turn_end.force_end(
            tx,
            env,
            agent_id,
            TaskStatus.STOPPED,
            ENDED_TEXT[mode],
            answers.ended,
            agent_turn_id=running,
            metadata={"multitask": mode},
            keep_memory=mode == INTERRUPT,
            next_row=(inbox_id, payload, conversation),
        )
    leased = ended.next_leased if ended is not None else idle and head.lease_next(tx, env, agent_id)
    return DoubleText(inbox_id, "superseded", leased, ended, tuple(replies))
