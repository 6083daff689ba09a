"""Tombstones (issue 38): what stays of a pruned task (``pruned_turns``: its Turn, agent,
caller thread and hop, and since migration 17 the client that sent it), so a read of its
thread answers "pruned" instead of "not found" (to the task's sender and the operators
only: docs/security.md, "Who may see and act on what");
and their own bound: a tombstone goes ``<retention tombstones>`` (default 30 days) after
its task was pruned, and a read of the thread then answers "not found". An A2A task's
record goes with its tombstone. Plain functions over one transaction, both engines.
"""

from __future__ import annotations

from agentserver.agents.store.sql.db import StoreEnv, Tx
from agentserver.agents.store.sql.prune import Pruned, delete_or_count, holds

#: Schema migration 14 (with sql/memory.py's): the index a tombstones batch finds the
#: oldest by (written when a task is pruned, never by a Turn).
MIGRATION = """
CREATE INDEX pruned_turns_age ON pruned_turns (pruned_at);
"""

#: Schema migration 17 (issue 44): the client that sent a pruned task (its reply
#: reference's ``client`` or ``speaks_for``; NULL for a task no declared client sent, and
#: on every tombstone written before), so that only its sender (and the operators) is
#: told "pruned": to another client a pruned task answers as a missing one.
SENDER_MIGRATION = """
ALTER TABLE pruned_turns ADD COLUMN sender TEXT;
"""


def prune_tombstones(
    tx: Tx,
    env: StoreEnv,
    owner: str | None,
    max_age_s: float,
    limit: int,
    dry_run: bool = False,
) -> Pruned:
    """Up to ``limit`` tombstones made more than ``max_age_s`` ago, oldest first (nothing
    if ``owner`` lost the pruner's lease). ``dry_run`` counts them all."""
    if not holds(tx, env, owner):
        return Pruned()
    cutoff = env.clock.now() - max_age_s
    if dry_run:
        return delete_or_count(
            tx,
            "pruned_turns",
            "agent_turn_id",
            "SELECT agent_turn_id FROM pruned_turns WHERE pruned_at < ?",
            (cutoff,),
            dry_run,
        )
    found = tx.all(
        "SELECT agent_turn_id, agent_id, caller_thread, hop FROM pruned_turns "
        "WHERE pruned_at < ? ORDER BY pruned_at LIMIT ?",
        (cutoff, limit),
    )
    if not found:
        return Pruned()
    tx.executemany("DELETE FROM pruned_turns WHERE agent_turn_id = ?", [(r[0],) for r in found])
    # An A2A task's record (its id is the thread it was sent on) goes with its tombstone:
    # until then its GetTask answers "pruned" (agents/store/sql/prune_records.py).
    threads = [(r[1], t) for r in found for t in {r[2], r[3]} if t]
    if threads:
        tx.executemany("DELETE FROM a2a_tasks WHERE agent_id = ? AND task_id = ?", threads)
    return Pruned(rows=len(found), done=len(found) < limit)


def thread_pruned(tx: Tx, agent_id: str, thread: str) -> bool:
    """Whether a Turn of ``agent_id`` on ``thread`` (caller thread or hop) was pruned."""
    row = tx.one(
        "SELECT 1 FROM pruned_turns WHERE agent_id = ? AND (caller_thread = ? OR hop = ?) LIMIT 1",
        (agent_id, thread, thread),
    )
    return row is not None


def pruned_sender(
    tx: Tx, agent_id: str, thread: str, sender: str | None = None
) -> tuple[bool, str | None]:
    """Whether a task of ``agent_id`` on ``thread`` (caller thread or hop) was pruned, and
    the client that sent it (None: no declared client, or a tombstone older than
    migration 17, which kept none): ``sender`` if one of its tasks there was pruned, else
    the latest pruned one's. What the authorization rule reads of a pruned task."""
    where = "agent_id = ? AND (caller_thread = ? OR hop = ?)"
    params = (agent_id, thread, thread)
    if sender is not None and tx.one(
        f"SELECT 1 FROM pruned_turns WHERE {where} AND sender = ? LIMIT 1", (*params, sender)
    ):
        return True, sender
    row = tx.one(
        f"SELECT sender FROM pruned_turns WHERE {where} ORDER BY pruned_at DESC LIMIT 1", params
    )
    return (True, row[0]) if row is not None else (False, None)
