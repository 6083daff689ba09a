"""A recorded Turn read whole, for export and replay (agents/replay/record.py). Read only."""

from __future__ import annotations

import json
from typing import Any

from agentserver.agents.errors import TurnPruned
from agentserver.agents.store.base import CardType
from agentserver.agents.store.sql.db import StoreEnv, Tx
from agentserver.agents.store.sql.memory import turn_memory
from agentserver.agents.store.sql.tombstones import thread_pruned
from agentserver.agents.store.sql.views import json_text
from agentserver.agents.store.states import MessageType


def find_turn(tx: Tx, agent: str, thread: str) -> tuple[str, str] | None:
    """(Turn id, task payload) of the latest Turn of ``agent`` whose task came on
    ``thread`` (the caller's thread or the agent's hop); None: none."""
    caller, hop = json_text(tx, "reply_ref", "caller_thread"), json_text(tx, "reply_ref", "hop")
    # A started Turn's row gave its payload up (common.CONSUMED_PAYLOAD): the task is then
    # the Turn's first task.input card (its own: memory cards keep their Turns).
    row = tx.one(
        "SELECT i.agent_turn_id, i.payload, (SELECT c.content FROM boxes b JOIN cards c "
        "ON c.box_id = b.box_id WHERE b.agent_turn_id = i.agent_turn_id "
        "AND c.agent_turn_id = i.agent_turn_id AND c.card_type = ? ORDER BY c.seq LIMIT 1) "
        f"FROM agent_inbox i WHERE i.agent_id = ? AND i.message_type = ? "
        f"AND ({caller} = ? OR {hop} = ?) "
        "AND i.agent_turn_id IS NOT NULL ORDER BY i.seq DESC LIMIT 1",
        (CardType.TASK_INPUT, agent, MessageType.TURN.value, thread, thread),
    )
    if row is None:
        return None
    payload = bytes(row[1])
    if not payload and row[2] is not None:
        return row[0], str(row[2])
    return row[0], payload.decode("utf-8", "replace")


def turn_record(tx: Tx, env: StoreEnv, agent: str, thread: str) -> dict[str, Any] | None:
    """The latest Turn of ``agent`` whose task came on ``thread`` (the caller's thread or
    the agent's hop), as plain data: its task, steps, cards (in order, every box the Turn
    wrote, folded ones included) and policy decisions. None when there is no such Turn;
    :class:`TurnPruned` when retention removed it."""
    found = find_turn(tx, agent, thread)
    if found is None:
        if thread_pruned(tx, agent, thread):
            raise TurnPruned(agent, thread)
        return None
    turn, payload = found
    steps = [
        {
            "step": r[0],
            "status": r[1],
            "model": r[2] or "",
            "prompt_tokens": r[3] or 0,
            "completion_tokens": r[4] or 0,
            "tool_call_ids": json.loads(r[5] or "[]"),
            "step_id": r[6],
        }
        for r in tx.all(
            "SELECT step_no, status, model, prompt_tokens, completion_tokens, tool_call_ids, "
            "step_id FROM agent_steps WHERE agent_turn_id = ? ORDER BY step_no, started_at",
            (turn,),
        )
    ]
    # The memory its context box named first (sql/memory.py), as the copies it once held.
    cards = [
        {"type": r[0], "content": r[1], "metadata": json.loads(r[2] or "{}")}
        for r in [(m[2], m[3], m[4]) for m in turn_memory(tx, turn)]
        + tx.all(
            "SELECT card_type, content, metadata FROM cards WHERE agent_turn_id = ? ORDER BY seq",
            (turn,),
        )
    ]
    decisions = [
        {"step_id": r[0], "target": r[1], "tag": r[2], "decision": r[3], "rule": r[4]}
        for r in tx.all(
            "SELECT step_id, target, payload_tag, decision, rule FROM policy_decisions "
            "WHERE agent_turn_id = ? ORDER BY seq",
            (turn,),
        )
    ]
    return {
        "agent": agent,
        "thread": thread,
        "turn": turn,
        "task": payload,
        "steps": steps,
        "cards": cards,
        "decisions": decisions,
    }
