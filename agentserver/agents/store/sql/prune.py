"""Pruning (issue 38): what retention removes, in small batches, one transaction each,
never anything a promise still needs. Plain functions over one transaction, both engines.

A *finished task* is a ``turn`` inbox row in a final status (``consumed``, ``error``,
``skipped``) whose Turn is no agent's active Turn. It goes with everything its Turn left
(its other inbox rows, steps, boxes and cards, waiting rows, edges, policy decisions,
approvals and outbox reply) in one transaction, and leaves a tombstone in
``pruned_turns`` (keyed by its Turn, or ``task:INBOX_ID`` for a task that never got one)
so reads of its thread answer "pruned" instead of "not found". Never pruned:

- a Turn that is queued, running or suspended (the head names it, or one of its inbox
  rows is not final), with everything it references;
- a Turn with an approval still pending, granted or being forwarded;
- a Turn (or a cancelled task) whose outbox reply is still ``pending``; the replies kept
  for a named client (``client_replies``) are never touched here: they go only when
  the client acknowledges them (``sql/replies.ack_client_replies``);
- a conversation's memory: the boxes ``conversations`` points at (its compaction
  summary and the recent cards it keeps), and the Turn they belong to;
- an idempotency record in its window: step log rows of a step with any event younger
  than ``step-log``;
- the newest ``keep-last`` tasks of each conversation (of each agent without memory).

Every batch is bounded by ``limit`` (tasks or rows) and, when a pruner runs it, fenced on
the pruner's lease (``prune_lease``): a process that lost the lease deletes nothing, so
two processes never prune at once. A batch is one transaction: a crash rolls it back
whole, and the next run finds the same rows again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agentserver.agents.store.sql.db import POSTGRESQL, StoreEnv, Tx, marks
from agentserver.agents.store.states import (
    ApprovalStatus,
    InboxStatus,
    MessageType,
    ReplyStatus,
)

#: Schema migration 8: tombstones, the pruner's lease, the indexes a batch looks up by.
MIGRATION = """
CREATE TABLE pruned_turns (
    agent_turn_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    caller_thread TEXT,
    hop TEXT,
    pruned_at REAL NOT NULL
);
CREATE INDEX pruned_turns_caller ON pruned_turns (agent_id, caller_thread);
CREATE INDEX pruned_turns_hop ON pruned_turns (agent_id, hop);
CREATE TABLE prune_lease (
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    lease_until REAL NOT NULL
);
CREATE INDEX agent_inbox_turn ON agent_inbox (agent_turn_id);
CREATE INDEX agent_inbox_conversation ON agent_inbox (agent_id, conversation, seq);
CREATE INDEX boxes_turn ON boxes (agent_turn_id);
CREATE INDEX approvals_turn ON approvals (agent_turn_id);
"""

LEASE = "pruner"
#: How long the pruner's lease lasts past its last batch (a dead pruner's lease expires,
#: then another process's pruner takes it).
LEASE_S = 60.0
FINAL_INBOX = (InboxStatus.CONSUMED, InboxStatus.ERROR, InboxStatus.SKIPPED)
#: Approval statuses a Turn still waits on (a decision to come, or a call to forward).
OPEN_APPROVALS = (ApprovalStatus.PENDING, ApprovalStatus.GRANTED, ApprovalStatus.FORWARDING)
DONE_REPLIES = (ReplyStatus.SENT, ReplyStatus.UNDELIVERABLE)

#: Every table the store keeps, and the column that says how old a row is (stats).
TABLES: dict[str, str | None] = {
    "agent_inbox": "created_at",
    "agent_state_head": "updated_at",
    "turn_waiting_tools": "created_at",
    "execution_edges": "created_at",
    "agent_steps": "started_at",
    "boxes": "created_at",
    "cards": "created_at",
    "agent_replies": "created_at",
    "client_replies": "created_at",
    "conversations": "updated_at",
    "policy_decisions": "at",
    "approvals": "created_at",
    "step_log": "at",
    "forks": "created_at",
    "pruned_turns": "pruned_at",
    "prune_lease": None,
    "schema_version": None,
}


@dataclass(frozen=True, slots=True)
class Pruned:
    """What one batch removed (or, dry, would remove)."""

    tasks: int = 0
    rows: int = 0


# -- the lease -------------------------------------------------------------------------


def take_lease(tx: Tx, env: StoreEnv, owner: str, lease_s: float) -> bool:
    """Take (or renew) the pruner's lease for ``lease_s`` seconds; False while another
    owner holds it. Atomic: the row's update is the compare-and-set."""
    now = env.clock.now()
    tx.execute(
        "INSERT INTO prune_lease (name, owner, lease_until) VALUES (?,?,?) "
        "ON CONFLICT (name) DO NOTHING",
        (LEASE, owner, now + lease_s),
    )
    tx.execute(
        "UPDATE prune_lease SET owner = ?, lease_until = ? "
        "WHERE name = ? AND (owner = ? OR lease_until < ?)",
        (owner, now + lease_s, LEASE, owner, now),
    )
    return tx.rowcount == 1


def release_lease(tx: Tx, env: StoreEnv, owner: str) -> None:
    tx.execute("DELETE FROM prune_lease WHERE name = ? AND owner = ?", (LEASE, owner))


def _holds(tx: Tx, env: StoreEnv, owner: str | None) -> bool:
    """The fence of a batch: ``owner`` still holds the lease, now renewed for
    :data:`LEASE_S` (None: unfenced, a dry run). The update locks the lease row, so a
    take-over waits for the batch to commit."""
    if owner is None:
        return True
    now = env.clock.now()
    tx.execute(
        "UPDATE prune_lease SET lease_until = ? WHERE name = ? AND owner = ? AND lease_until >= ?",
        (now + LEASE_S, LEASE, owner, now),
    )
    return tx.rowcount == 1


# -- finished tasks --------------------------------------------------------------------


def _candidates(
    tx: Tx, agent_id: str, cutoff: float, keep_last: int | None, limit: int
) -> list[tuple[Any, ...]]:
    """Up to ``limit`` finished tasks of ``agent_id`` older than ``cutoff`` that no rule
    keeps: (inbox_id, agent_turn_id, reply_ref), oldest first."""
    keep = keep_last or 0
    newer = (
        " AND (SELECT count(*) FROM (SELECT 1 FROM agent_inbox j WHERE j.agent_id = i.agent_id "
        "AND j.message_type = i.message_type AND j.seq > i.seq AND "
        "(j.conversation = i.conversation OR (i.conversation IS NULL AND j.conversation IS NULL))"
        " LIMIT ?) k) >= ?"
        if keep
        else ""
    )
    params: list[Any] = [agent_id, MessageType.TURN, *FINAL_INBOX, cutoff]
    params += [*FINAL_INBOX, cutoff, cutoff, *OPEN_APPROVALS, ReplyStatus.PENDING]
    if keep:
        params += [keep, keep]
    params.append(limit)
    return tx.all(
        "SELECT i.inbox_id, i.agent_turn_id, i.reply_ref FROM agent_inbox i "
        f"WHERE i.agent_id = ? AND i.message_type = ? AND i.status IN ({marks(3)}) "
        "AND i.updated_at < ? "
        "AND (i.agent_turn_id IS NULL OR ("
        " NOT EXISTS (SELECT 1 FROM agent_state_head h "
        "  WHERE h.active_agent_turn_id = i.agent_turn_id)"
        " AND NOT EXISTS (SELECT 1 FROM agent_inbox o WHERE o.agent_turn_id = i.agent_turn_id"
        f"  AND (o.status NOT IN ({marks(3)}) OR o.updated_at >= ?))"
        " AND NOT EXISTS (SELECT 1 FROM agent_steps s WHERE s.agent_turn_id = i.agent_turn_id"
        "  AND coalesce(s.ended_at, s.started_at) >= ?)"
        " AND NOT EXISTS (SELECT 1 FROM approvals a WHERE a.agent_turn_id = i.agent_turn_id"
        f"  AND a.status IN ({marks(3)}))"
        " AND NOT EXISTS (SELECT 1 FROM boxes b JOIN conversations c"
        "  ON c.context_box_id = b.box_id OR c.output_box_id = b.box_id"
        "  WHERE b.agent_turn_id = i.agent_turn_id)))"
        " AND NOT EXISTS (SELECT 1 FROM agent_replies r WHERE r.status = ? AND"
        "  (r.agent_turn_id = i.agent_turn_id OR r.agent_turn_id = 'cancel:' || i.inbox_id))"
        f"{newer} ORDER BY i.seq LIMIT ?",
        params,
    )


def _threads(ref_json: Any) -> tuple[str | None, str | None]:
    """(caller thread, hop) of a stored reply reference (read here, not in SQL, so the
    statement is the same on both engines)."""
    try:
        ref = json.loads(ref_json) if ref_json else None
    except ValueError:
        return None, None
    if not isinstance(ref, dict):
        return None, None
    caller, hop = ref.get("caller_thread"), ref.get("hop")
    return (
        caller if isinstance(caller, str) else None,
        hop if isinstance(hop, str) else None,
    )


def _delete_turn(
    tx: Tx, now: float, agent_id: str, inbox_id: str, turn: str | None, ref: Any
) -> int:
    """Delete one finished task and all its Turn left; how many rows went."""
    rows = 0
    reply_keys: list[str] = [f"cancel:{inbox_id}"]
    if turn is not None:
        reply_keys.append(turn)
        tx.execute(
            "DELETE FROM cards WHERE box_id IN (SELECT box_id FROM boxes WHERE agent_turn_id = ?)",
            (turn,),
        )
        rows += tx.rowcount
        for table in (
            "boxes",
            "agent_steps",
            "turn_waiting_tools",
            "execution_edges",
            "policy_decisions",
            "approvals",
            "agent_inbox",
        ):
            tx.execute(f"DELETE FROM {table} WHERE agent_turn_id = ?", (turn,))
            rows += tx.rowcount
    tx.execute(
        f"DELETE FROM agent_replies WHERE agent_turn_id IN ({marks(len(reply_keys))})",
        reply_keys,
    )
    rows += tx.rowcount
    tx.execute("DELETE FROM agent_inbox WHERE inbox_id = ?", (inbox_id,))
    rows += tx.rowcount
    # Every pruned task leaves its tombstone, a task that never got a Turn (cancelled
    # while queued, failed at its lease) too: "pruned" is then the answer for its thread.
    tx.execute(
        "INSERT INTO pruned_turns (agent_turn_id, agent_id, caller_thread, hop, pruned_at) "
        "VALUES (?,?,?,?,?) ON CONFLICT (agent_turn_id) DO NOTHING",
        (turn or f"task:{inbox_id}", agent_id, *_threads(ref), now),
    )
    return rows


def prune_tasks(
    tx: Tx,
    env: StoreEnv,
    owner: str | None,
    agent_id: str,
    max_age_s: float,
    keep_last: int | None,
    limit: int,
    dry_run: bool = False,
) -> Pruned:
    """Up to ``limit`` finished tasks of ``agent_id`` older than ``max_age_s``, each with
    all its Turn left (one transaction; nothing if ``owner`` lost the lease). ``dry_run``
    counts them and deletes nothing."""
    if not _holds(tx, env, owner):
        return Pruned()
    now = env.clock.now()
    found = _candidates(tx, agent_id, now - max_age_s, keep_last, limit)
    if dry_run:
        return Pruned(tasks=len(found))
    rows = sum(_delete_turn(tx, now, agent_id, str(i), t, ref) for i, t, ref in found)
    return Pruned(tasks=len(found), rows=rows)


def prune_orphan_boxes(
    tx: Tx,
    env: StoreEnv,
    owner: str | None,
    agent_id: str,
    max_age_s: float,
    limit: int,
    dry_run: bool = False,
) -> Pruned:
    """Boxes no task, head or conversation names any more (those of a conversation's
    earlier manual compaction or fork), older than ``max_age_s``, with their cards."""
    if not _holds(tx, env, owner):
        return Pruned()
    cutoff = env.clock.now() - max_age_s
    found = tx.all(
        "SELECT b.box_id FROM boxes b WHERE b.agent_id = ? AND b.created_at < ? "
        "AND NOT EXISTS (SELECT 1 FROM agent_inbox i WHERE i.agent_turn_id = b.agent_turn_id) "
        "AND NOT EXISTS (SELECT 1 FROM agent_state_head h WHERE h.active_agent_turn_id = "
        "b.agent_turn_id OR h.context_box_id = b.box_id OR h.output_box_id = b.box_id) "
        "AND NOT EXISTS (SELECT 1 FROM conversations c WHERE c.context_box_id = b.box_id "
        "OR c.output_box_id = b.box_id) LIMIT ?",
        (agent_id, cutoff, limit),
    )
    if not found or dry_run:
        return Pruned(rows=len(found))
    ids = [r[0] for r in found]
    tx.execute(f"DELETE FROM cards WHERE box_id IN ({marks(len(ids))})", ids)
    rows = tx.rowcount
    tx.execute(f"DELETE FROM boxes WHERE box_id IN ({marks(len(ids))})", ids)
    return Pruned(rows=rows + tx.rowcount)


# -- rows with their own windows -------------------------------------------------------


def _delete_or_count(
    tx: Tx, table: str, key: str, select: str, params: tuple[Any, ...], dry_run: bool
) -> Pruned:
    """``DELETE FROM table WHERE key IN (select)``, or (``dry_run``) count the keys."""
    if dry_run:
        row = tx.one(f"SELECT count(*) FROM ({select}) k", params)
        return Pruned(rows=int(row[0]) if row else 0)
    tx.execute(f"DELETE FROM {table} WHERE {key} IN ({select})", params)
    return Pruned(rows=tx.rowcount)


def prune_events(
    tx: Tx,
    env: StoreEnv,
    owner: str | None,
    agent_id: str,
    max_age_s: float,
    limit: int,
    dry_run: bool = False,
) -> Pruned:
    """Execution edges of ``agent_id`` older than ``max_age_s`` (never an active Turn's)."""
    if not _holds(tx, env, owner):
        return Pruned()
    return _delete_or_count(
        tx,
        "execution_edges",
        "edge_id",
        "SELECT e.edge_id FROM execution_edges e "
        "WHERE e.agent_id = ? AND e.created_at < ? AND NOT EXISTS (SELECT 1 FROM "
        "agent_state_head h WHERE h.active_agent_turn_id = e.agent_turn_id) "
        "ORDER BY e.edge_id LIMIT ?",
        (agent_id, env.clock.now() - max_age_s, limit),
        dry_run,
    )


def prune_replies(
    tx: Tx,
    env: StoreEnv,
    owner: str | None,
    max_age_s: float,
    limit: int,
    dry_run: bool = False,
) -> Pruned:
    """Outbox replies delivered (or given up) more than ``max_age_s`` ago. A ``pending``
    reply is never one of them."""
    if not _holds(tx, env, owner):
        return Pruned()
    return _delete_or_count(
        tx,
        "agent_replies",
        "agent_turn_id",
        "SELECT agent_turn_id FROM agent_replies "
        f"WHERE status IN ({marks(2)}) AND coalesce(sent_at, created_at) < ? "
        "ORDER BY created_at LIMIT ?",
        (*DONE_REPLIES, env.clock.now() - max_age_s, limit),
        dry_run,
    )


def prune_step_log(
    tx: Tx,
    env: StoreEnv,
    owner: str | None,
    max_age_s: float,
    limit: int,
    dry_run: bool = False,
) -> Pruned:
    """Step log rows of steps with no event in the last ``max_age_s`` (a step's record,
    its idempotency key's, stays whole while any of its events is in the window)."""
    if not _holds(tx, env, owner):
        return Pruned()
    cutoff = env.clock.now() - max_age_s
    return _delete_or_count(
        tx,
        "step_log",
        "seq",
        "SELECT s.seq FROM step_log s WHERE s.at < ? "
        "AND NOT EXISTS (SELECT 1 FROM step_log t WHERE t.step_id = s.step_id AND t.at >= ?) "
        "ORDER BY s.seq LIMIT ?",
        (cutoff, cutoff, limit),
        dry_run,
    )


# -- reads -----------------------------------------------------------------------------


def thread_pruned(tx: Tx, agent_id: str, thread: str) -> bool:
    """Whether a Turn of ``agent_id`` on ``thread`` (caller thread or hop) was pruned."""
    row = tx.one(
        "SELECT 1 FROM pruned_turns WHERE agent_id = ? AND (caller_thread = ? OR hop = ?) LIMIT 1",
        (agent_id, thread, thread),
    )
    return row is not None


def agent_ids(tx: Tx, env: StoreEnv) -> list[str]:
    """Every agent with a head, inbox rows or boxes (the pruner's per-agent passes)."""
    rows = tx.all(
        "SELECT agent_id FROM agent_state_head UNION SELECT DISTINCT agent_id FROM agent_inbox "
        "UNION SELECT DISTINCT agent_id FROM boxes"
    )
    return sorted(str(r[0]) for r in rows)


def table_stats(tx: Tx, env: StoreEnv) -> list[tuple[str, int, int | None, float | None]]:
    """Per table: (name, rows, bytes or None where the engine cannot say, oldest time)."""
    sizes: dict[str, int] = {}
    if tx.dialect == POSTGRESQL:
        for name in TABLES:
            row = tx.one("SELECT pg_total_relation_size(to_regclass(?))", (name,))
            sizes[name] = int(row[0]) if row and row[0] is not None else 0
    else:
        try:
            got = tx.all(
                "SELECT coalesce(m.tbl_name, d.name), sum(d.pgsize) FROM dbstat d "
                "LEFT JOIN sqlite_master m ON m.name = d.name GROUP BY 1"
            )
            sizes = {str(n): int(b) for n, b in got}
        except Exception:  # dbstat not compiled in: rows only
            sizes = {}
    out = []
    for name, col in TABLES.items():
        count = tx.one(f"SELECT count(*) FROM {name}")
        oldest = tx.one(f"SELECT min({col}) FROM {name}") if col else None
        out.append(
            (
                name,
                int(count[0]) if count else 0,
                sizes.get(name) if sizes else None,
                float(oldest[0]) if oldest and oldest[0] is not None else None,
            )
        )
    return out
