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
- a Turn with an approval still pending, or granted or being forwarded while the Turn
  still waits for the call (a grant that came after its Turn ended is never sent);
- a Turn (or a cancelled task) whose outbox reply is still ``pending``; the replies kept
  for a named client (``client_replies``) are never touched here: they go only when
  the client acknowledges them (``sql/replies.ack_client_replies``);
- a conversation's memory: the boxes ``conversations`` points at (its compaction
  summary and the recent cards it keeps), and the Turn they belong to;
- an idempotency record in its window: step log rows of a step with any event younger
  than ``step-log``;
- the newest ``keep-last`` tasks of each conversation (for an agent without memory, of
  each caller: a named client, or the origin of an anonymous chain).

Every batch is bounded by ``limit`` (tasks or rows) and, when a pruner runs it, fenced on
the pruner's lease (``prune_lease``): a process that lost the lease deletes nothing, so
two processes never prune at once. A batch is one transaction: a crash rolls it back
whole, and the next run finds the same rows again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agentserver.agents.store.sql import memory
from agentserver.agents.store.sql.db import POSTGRESQL, StoreEnv, Tx, marks
from agentserver.agents.store.states import (
    ApprovalStatus,
    InboxStatus,
    MessageType,
    ReplyStatus,
    WaitingStatus,
)
from agentserver.core.access import sender_of

#: Schema migration 8: tombstones, the pruner's lease, the indexes a batch looks up by.
MIGRATION = """
CREATE TABLE pruned_turns (
    agent_turn_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    caller_thread TEXT,
    hop TEXT,
    pruned_at REAL NOT NULL,
    inbox_id TEXT
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

#: Schema migration 14 (with sql/memory.py's): the caller of a task of an agent without
#: memory, which ``keep-last`` counts its tasks by, and the index it counts them with
#: (partial: the rows of agents with memory, keyed by their conversation, pay nothing).
CALLER_MIGRATION = """
ALTER TABLE agent_inbox ADD COLUMN caller TEXT;
CREATE INDEX agent_inbox_caller ON agent_inbox (agent_id, caller, seq) WHERE caller IS NOT NULL;
"""

#: Rows one batch looks at, at most, by primary key (a window of ``seq`` or ``edge_id``:
#: bounded work per transaction however many rows a rule keeps).
SCAN_WINDOW = 2000
#: Rows one batch of tasks deletes, about, at most (a big Turn's cards: the batch stops
#: after the task that crossed it, so a transaction stays in the milliseconds).
ROW_BUDGET = 400
#: A dry run's window and limit: the whole table in one read.
DRY_WINDOW = 1 << 62
DRY_LIMIT = 1 << 31

LEASE = "pruner"
#: How long the pruner's lease lasts past its last batch (a dead pruner's lease expires,
#: then another process's pruner takes it). Short: a live pruner renews it every batch
#: (milliseconds apart), and a server killed mid-run, restarted, prunes again after this
#: long (with 60 s, a 30-minute soak's store swelled for a minute after each such kill).
LEASE_S = 15.0
FINAL_INBOX = (InboxStatus.CONSUMED, InboxStatus.ERROR, InboxStatus.SKIPPED)
#: Approval statuses a Turn still waits on: a decision to come, or (while the Turn still
#: waits for the call) a call to forward.
OPEN_APPROVALS = (ApprovalStatus.PENDING, ApprovalStatus.GRANTED, ApprovalStatus.FORWARDING)
DONE_REPLIES = (ReplyStatus.SENT, ReplyStatus.UNDELIVERABLE)


@dataclass(frozen=True, slots=True)
class Pruned:
    """What one batch removed (or, dry, would remove), and where the next batch of the
    same pass starts: ``after`` (a primary key) and ``done`` (nothing older is left)."""

    tasks: int = 0
    rows: int = 0
    after: int = 0
    done: bool = True


# -- a dry run: the prune itself, rolled back ----------------------------------------

#: A rehearsal's batch size: every pass runs to its end (the batches only bound a real
#: prune's transactions, not what it removes).
REHEARSAL_LIMIT = 1 << 30


class Rehearsed(Exception):
    """Raised at the end of :func:`rehearse` so that its transaction rolls back; carries
    what each batch removed, in order."""

    def __init__(self, results: list[tuple[str, Pruned]]) -> None:
        super().__init__("rehearsed")
        self.results = results


#: One pass of a rehearsal: (the report's kind, the batch function over a transaction,
#: its arguments after the owner and before the limit, whether it resumes after a key).
RehearsalPass = tuple[str, Any, tuple[Any, ...], bool]


def rehearse(tx: Tx, env: StoreEnv, passes: list[RehearsalPass]) -> None:
    """Run every pass of a prune in this one transaction, unfenced, with the very
    statements and in the order a prune runs them (each later pass sees what the earlier
    ones removed), then raise :class:`Rehearsed` so nothing of it is committed. A dry run
    counted this way reports exactly what the prune then removes (counting the candidates
    alone missed the rows a task's Turn had and what an earlier pass frees)."""
    results: list[tuple[str, Pruned]] = []
    for kind, fn, args, paged in passes:
        after = 0
        while True:
            if paged:
                got = fn(tx, env, None, *args, REHEARSAL_LIMIT, False, after)
            else:
                got = fn(tx, env, None, *args, REHEARSAL_LIMIT, False)
            results.append((kind, got))
            if got.done:
                break
            after = got.after
    raise Rehearsed(results)


# -- the lease -------------------------------------------------------------------------


def take_lease(tx: Tx, env: StoreEnv, owner: str, lease_s: float) -> bool:
    """Take (or renew) the pruner's lease for ``lease_s`` seconds; False while another
    owner holds it. Atomic: the row's update is the compare-and-set. Times are the
    processes' clocks (hosts whose clocks differ by less than the lease agree; at worst
    two prune at once, which the batches' own conditions make harmless: a task deleted
    by one is simply not found by the other)."""
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


def holds(tx: Tx, env: StoreEnv, owner: str | None) -> bool:
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
    tx: Tx,
    agent_id: str,
    cutoff: float,
    keep_last: int | None,
    limit: int,
    after: int,
    upto: int,
) -> list[tuple[Any, ...]]:
    """Up to ``limit`` finished tasks of ``agent_id`` older than ``cutoff`` that no rule
    keeps, with ``after < seq <= upto``: (seq, inbox_id, agent_turn_id, reply_ref),
    oldest first. Every subquery is an indexed lookup."""
    keep = keep_last or 0
    same = "IS NOT DISTINCT FROM" if tx.dialect == POSTGRESQL else "IS"
    # SQLite: a unary + keeps the planner off the (agent_id, status) index, whose range
    # is every finished task of the agent, sorted at every batch: the window's primary
    # key range is what bounds the batch (PostgreSQL's planner picks it by itself).
    u = "" if tx.dialect == POSTGRESQL else "+"
    # The newer tasks of its conversation, or of its caller for an agent without memory
    # (its rows name their caller, not a conversation): one of the two counts is empty.
    newer = (
        " AND (SELECT count(*) FROM (SELECT 1 FROM agent_inbox j WHERE i.caller IS NULL "
        f"AND j.agent_id = i.agent_id AND j.conversation {same} i.conversation "
        "AND j.seq > i.seq AND j.message_type = i.message_type LIMIT ?) k) + "
        "(SELECT count(*) FROM (SELECT 1 FROM agent_inbox j WHERE j.agent_id = i.agent_id "
        "AND j.caller = i.caller AND j.seq > i.seq AND j.message_type = i.message_type "
        "LIMIT ?) k2) >= ?"
        if keep
        else ""
    )
    params: list[Any] = [after, upto, agent_id, MessageType.TURN, *FINAL_INBOX, cutoff]
    params += [*FINAL_INBOX, cutoff, cutoff, *OPEN_APPROVALS, WaitingStatus.WAITING]
    params.append(ReplyStatus.PENDING)
    if keep:
        params += [keep, keep, keep]
    params.append(limit)
    return tx.all(
        "SELECT i.seq, i.inbox_id, i.agent_turn_id, i.reply_ref FROM agent_inbox i "
        "WHERE i.seq > ? AND i.seq <= ? "
        f"AND {u}i.agent_id = ? AND i.message_type = ? AND {u}i.status IN ({marks(3)}) "
        "AND i.updated_at < ? "
        "AND (i.agent_turn_id IS NULL OR ("
        " NOT EXISTS (SELECT 1 FROM agent_state_head h "
        "  WHERE h.active_agent_turn_id = i.agent_turn_id)"
        " AND NOT EXISTS (SELECT 1 FROM agent_inbox o WHERE o.agent_turn_id = i.agent_turn_id"
        f"  AND (o.status NOT IN ({marks(3)}) OR o.updated_at >= ?))"
        " AND NOT EXISTS (SELECT 1 FROM agent_steps s WHERE s.agent_turn_id = i.agent_turn_id"
        "  AND coalesce(s.ended_at, s.started_at) >= ?)"
        # An approval still to decide, or granted with its call still awaited (a grant
        # that came after its Turn ended is never sent: it keeps nothing).
        " AND NOT EXISTS (SELECT 1 FROM approvals a WHERE a.agent_turn_id = i.agent_turn_id"
        "  AND (a.status = ? OR (a.status IN (?, ?) AND EXISTS (SELECT 1 FROM"
        "  turn_waiting_tools w WHERE w.agent_turn_id = a.agent_turn_id AND w.status = ?))))"
        # A conversation's memory: only the task's own conversation can point at its
        # Turn's boxes (a fork or a manual compaction makes boxes of its own).
        " AND NOT EXISTS (SELECT 1 FROM conversations c JOIN boxes b"
        "  ON b.box_id = c.context_box_id OR b.box_id = c.output_box_id"
        "  WHERE c.agent_id = i.agent_id AND c.conversation = i.conversation"
        "  AND b.agent_turn_id = i.agent_turn_id)))"
        " AND NOT EXISTS (SELECT 1 FROM agent_replies r WHERE r.status = ? AND"
        "  (r.agent_turn_id = i.agent_turn_id OR r.agent_turn_id = 'cancel:' || i.inbox_id))"
        f"{newer} ORDER BY i.seq LIMIT ?",
        params,
    )


def next_window(
    tx: Tx,
    table: str,
    key: str,
    at: str,
    after: int,
    limit: int,
    found: list[Any],
    cutoff: float,
    dry_run: bool,
) -> tuple[int, bool]:
    """Where the next batch of a windowed pass starts, and whether the pass is done:
    ``found`` (the batch's keys, ascending) filled ``limit``: right after the last; else
    after this window, done when no row follows it or the next is not older than
    ``cutoff`` (keys grow with time, so none after it is either)."""
    upto = DRY_WINDOW if dry_run else after + SCAN_WINDOW
    if len(found) >= limit:
        return int(found[-1]), False
    row = tx.one(f"SELECT {at} FROM {table} WHERE {key} > ? ORDER BY {key} LIMIT 1", (upto,))
    return upto, row is None or float(row[0]) >= cutoff


def _threads(ref_json: Any) -> tuple[str | None, str | None, str | None]:
    """(caller thread, hop, sender) of a stored reply reference (read here, not in SQL, so
    the statement is the same on both engines; the sender as the authorization rule
    reads it: :func:`agentserver.core.access.sender_of`)."""
    try:
        ref = json.loads(ref_json) if ref_json else None
    except ValueError:
        return None, None, None
    if not isinstance(ref, dict):
        return None, None, None
    caller, hop = ref.get("caller_thread"), ref.get("hop")
    return (
        caller if isinstance(caller, str) else None,
        hop if isinstance(hop, str) else None,
        sender_of(ref),
    )


def _delete_turn(
    tx: Tx, env: StoreEnv, agent_id: str, inbox_id: str, turn: str | None, ref: Any
) -> int:
    """Delete one finished task and all its Turn left; how many rows went (copies made
    for the Turns whose memory named its boxes count too)."""
    now = env.clock.now()
    rows = 0
    reply_keys: list[str] = [f"cancel:{inbox_id}"]
    if turn is not None:
        reply_keys.append(turn)
        # A later Turn whose context box names this Turn's boxes as its memory gets a
        # copy of it first (sql/memory.py): its record stays whole.
        boxes = [r[0] for r in tx.all("SELECT box_id FROM boxes WHERE agent_turn_id = ?", (turn,))]
        rows += memory.release(tx, env, boxes, turn)
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
    # while queued, failed at its lease) too: "pruned" is then the answer for its thread,
    # to its sender (kept here: the authorization rule's owner) and the operators.
    caller, hop, sender = _threads(ref)
    tx.execute(
        "INSERT INTO pruned_turns (agent_turn_id, agent_id, caller_thread, hop, pruned_at, "
        "inbox_id, sender) VALUES (?,?,?,?,?,?,?) ON CONFLICT (agent_turn_id) DO NOTHING",
        (turn or f"task:{inbox_id}", agent_id, caller, hop, now, inbox_id, sender),
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
    after: int = 0,
) -> Pruned:
    """Up to ``limit`` finished tasks of ``agent_id`` older than ``max_age_s`` among the
    inbox rows after ``after`` (a window of :data:`SCAN_WINDOW`), each with all its Turn
    left (one transaction; nothing if ``owner`` lost the lease). ``dry_run`` counts them
    (all, in one read) and deletes nothing."""
    if not holds(tx, env, owner):
        return Pruned()
    now = env.clock.now()
    cutoff = now - max_age_s
    upto = DRY_WINDOW if dry_run else after + SCAN_WINDOW
    found = _candidates(tx, agent_id, cutoff, keep_last, limit, after, upto)
    nxt, done = next_window(
        tx,
        "agent_inbox",
        "seq",
        "created_at",
        after,
        limit,
        [r[0] for r in found],
        cutoff,
        dry_run,
    )
    if dry_run:
        return Pruned(tasks=len(found))
    rows = tasks = 0
    # Newest first: a conversation's later Turn names the earlier one's boxes as its
    # memory, so going first it spares the earlier one's deletion a copy of them.
    for _, inbox_id, turn, ref in reversed(found):
        rows += _delete_turn(tx, env, agent_id, str(inbox_id), turn, ref)
        tasks += 1
        if rows >= ROW_BUDGET and tasks < len(found):
            # A batch of big Turns stops early: the next looks at the same window
            # again, where only the older tasks it left are still found.
            return Pruned(tasks=tasks, rows=rows, after=after, done=False)
    return Pruned(tasks=tasks, rows=rows, after=nxt, done=done)


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
    earlier manual compaction or fork), older than ``max_age_s``, with their cards.
    ``done`` when fewer than ``limit`` were found."""
    if not holds(tx, env, owner):
        return Pruned()
    cutoff = env.clock.now() - max_age_s
    # Such boxes are keyed by a conversation's key, not a Turn: ranges of boxes_turn.
    found = tx.all(
        "SELECT b.box_id FROM boxes b WHERE ((b.agent_turn_id >= 'compaction:' AND "
        "b.agent_turn_id < 'compaction;') OR (b.agent_turn_id >= 'fork:' AND "
        "b.agent_turn_id < 'fork;')) AND b.agent_id = ? AND b.created_at < ? "
        "AND NOT EXISTS (SELECT 1 FROM agent_inbox i WHERE i.agent_turn_id = b.agent_turn_id) "
        "AND NOT EXISTS (SELECT 1 FROM agent_state_head h WHERE h.active_agent_turn_id = "
        "b.agent_turn_id OR h.context_box_id = b.box_id OR h.output_box_id = b.box_id) "
        "AND NOT EXISTS (SELECT 1 FROM conversations c WHERE c.context_box_id = b.box_id "
        "OR c.output_box_id = b.box_id) LIMIT ?",
        (agent_id, cutoff, limit),
    )
    if not found or dry_run:
        return Pruned(rows=len(found))
    # (done unless the batch was full: the next one looks again)
    ids = [r[0] for r in found]
    # A Turn whose memory names one of them gets a copy first (sql/memory.py).
    copied = memory.release(tx, env, ids, None)
    tx.execute(f"DELETE FROM cards WHERE box_id IN ({marks(len(ids))})", ids)
    rows = tx.rowcount + copied
    tx.execute(f"DELETE FROM boxes WHERE box_id IN ({marks(len(ids))})", ids)
    return Pruned(rows=rows + tx.rowcount, done=len(found) < limit)


# -- rows with their own windows -------------------------------------------------------


def delete_or_count(
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
    after: int = 0,
) -> Pruned:
    """Execution edges of ``agent_id`` older than ``max_age_s`` (never an active Turn's),
    among those after ``after`` (a window of :data:`SCAN_WINDOW`)."""
    if not holds(tx, env, owner):
        return Pruned()
    cutoff = env.clock.now() - max_age_s
    upto = DRY_WINDOW if dry_run else after + SCAN_WINDOW
    found = [
        r[0]
        for r in tx.all(
            "SELECT e.edge_id FROM execution_edges e WHERE e.edge_id > ? AND e.edge_id <= ? "
            "AND e.agent_id = ? AND e.created_at < ? AND NOT EXISTS (SELECT 1 FROM "
            "agent_state_head h WHERE h.active_agent_turn_id = e.agent_turn_id) "
            "ORDER BY e.edge_id LIMIT ?",
            (after, upto, agent_id, cutoff, DRY_LIMIT if dry_run else limit),
        )
    ]
    if dry_run:
        return Pruned(rows=len(found))
    nxt, done = next_window(
        tx, "execution_edges", "edge_id", "created_at", after, limit, found, cutoff, False
    )
    if found:
        tx.execute(f"DELETE FROM execution_edges WHERE edge_id IN ({marks(len(found))})", found)
    return Pruned(rows=len(found), after=nxt, done=done)


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
    if not holds(tx, env, owner):
        return Pruned()
    got = delete_or_count(
        tx,
        "agent_replies",
        "agent_turn_id",
        "SELECT agent_turn_id FROM agent_replies "
        f"WHERE status IN ({marks(2)}) AND coalesce(sent_at, created_at) < ? "
        "ORDER BY created_at LIMIT ?",
        (*DONE_REPLIES, env.clock.now() - max_age_s, DRY_LIMIT if dry_run else limit),
        dry_run,
    )
    return Pruned(rows=got.rows, done=got.rows < limit)


def prune_step_log(
    tx: Tx,
    env: StoreEnv,
    owner: str | None,
    max_age_s: float,
    limit: int,
    dry_run: bool = False,
    after: int = 0,
) -> Pruned:
    """Step log rows of steps with no event in the last ``max_age_s`` (a step's record,
    its idempotency key's, stays whole while any of its events is in the window)."""
    if not holds(tx, env, owner):
        return Pruned()
    cutoff = env.clock.now() - max_age_s
    upto = DRY_WINDOW if dry_run else after + SCAN_WINDOW
    found = [
        r[0]
        for r in tx.all(
            "SELECT s.seq FROM step_log s WHERE s.seq > ? AND s.seq <= ? AND s.at < ? "
            "AND NOT EXISTS (SELECT 1 FROM step_log t WHERE t.step_id = s.step_id AND "
            "t.at >= ?) ORDER BY s.seq LIMIT ?",
            (after, upto, cutoff, cutoff, DRY_LIMIT if dry_run else limit),
        )
    ]
    if dry_run:
        return Pruned(rows=len(found))
    nxt, done = next_window(tx, "step_log", "seq", "at", after, limit, found, cutoff, False)
    if found:
        tx.execute(f"DELETE FROM step_log WHERE seq IN ({marks(len(found))})", found)
    return Pruned(rows=len(found), after=nxt, done=done)
