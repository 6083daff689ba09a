"""Tombstones (issue 38): what stays of a pruned task (``pruned_turns``: its Turn, agent,
caller thread and hop), so a read of its thread answers "pruned" instead of "not found";
and their own bound: a tombstone goes ``<retention tombstones>`` (default 30 days) after
its task was pruned, and a read of the thread then answers "not found". Plain functions
over one transaction, both engines.
"""

from __future__ import annotations

from agentserver.agents.store.sql.db import StoreEnv, Tx
from agentserver.agents.store.sql.prune import DRY_LIMIT, Pruned, delete_or_count, holds

#: Schema migration 14 (with sql/memory.py's): the index a tombstones batch finds the
#: oldest by (written when a task is pruned, never by a Turn).
MIGRATION = """
CREATE INDEX pruned_turns_age ON pruned_turns (pruned_at);
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
    got = delete_or_count(
        tx,
        "pruned_turns",
        "agent_turn_id",
        "SELECT agent_turn_id FROM pruned_turns WHERE pruned_at < ? ORDER BY pruned_at LIMIT ?",
        (env.clock.now() - max_age_s, DRY_LIMIT if dry_run else limit),
        dry_run,
    )
    return got if dry_run else Pruned(rows=got.rows, done=got.rows < limit)


def thread_pruned(tx: Tx, agent_id: str, thread: str) -> bool:
    """Whether a Turn of ``agent_id`` on ``thread`` (caller thread or hop) was pruned."""
    row = tx.one(
        "SELECT 1 FROM pruned_turns WHERE agent_id = ? AND (caller_thread = ? OR hop = ?) LIMIT 1",
        (agent_id, thread, thread),
    )
    return row is not None
