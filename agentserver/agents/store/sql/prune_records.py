"""Pruning the records kept beside the Turns (issue 38): webhook and A2A push deliveries
with their sequence counters, schedules' run records, A2A tasks' records. Plain functions
over one transaction each, both engines; bounded by ``limit`` and fenced on the pruner's
lease like the Turns' batches (agents/store/sql/prune.py).

Never pruned:

- a delivery still ``pending`` or parked (``disabled``: its channel's enable sends it);
- a sequence counter while any delivery of its conversation is kept (so numbers never
  repeat within what a receiver can still be sent);
- a schedule's newest run record (what ``GET /v1/schedules/{name}`` shows last), and
  any run whose task is still in the inbox (queued, running, or kept by retention);
- an A2A task's record while its task or its tombstone is kept (its state, or its
  "pruned" answer, is read from there; the record is also the idempotency key of its
  message: one sent again meanwhile is the same task); a task refused at intake keeps
  its record for the agent's ``finished-tasks``.
"""

from __future__ import annotations

from agentserver.agents.store import outbox
from agentserver.agents.store.sql import prune as prune_sql
from agentserver.agents.store.sql.db import SqlValue, StoreEnv, Tx
from agentserver.agents.store.sql.prune import DRY_LIMIT, DRY_WINDOW, Pruned, holds, next_window

_DONE = (outbox.DELIVERED, outbox.EXPIRED, outbox.CANCELLED)


def prune_deliveries(
    tx: Tx,
    env: StoreEnv,
    owner: str | None,
    max_age_s: float,
    limit: int,
    dry_run: bool = False,
    after: int = 0,
) -> Pruned:
    """Up to ``limit`` deliveries done more than ``max_age_s`` ago among those after
    ``after`` (a window of ``prune.SCAN_WINDOW`` by ``seq``: a batch's work is bounded however
    many rows the window keeps), and the sequence counters of the conversations they were
    the last of. ``rows`` counts both.

    A counter goes only if its ``last_seq`` is still the one read here: on PostgreSQL an
    event of that conversation committed meanwhile (its counter bumped, its row added)
    keeps the counter, as the row lock makes the delete see the bumped value."""
    if not holds(tx, env, owner):
        return Pruned()
    cutoff = env.clock.now() - max_age_s
    # The module's value, read at the call: the window next_window moves by (tests shrink it).
    upto = DRY_WINDOW if dry_run else after + prune_sql.SCAN_WINDOW
    rows = tx.all(
        "SELECT seq, order_key FROM outbox WHERE seq > ? AND seq <= ? AND status IN (?, ?, ?) "
        "AND done_at < ? ORDER BY seq LIMIT ?",
        (after, upto, *_DONE, cutoff, DRY_LIMIT if dry_run else limit),
    )
    if dry_run:
        return Pruned(rows=len(rows))
    # A row is made before it is done: the pass stops at the first made after the cutoff.
    nxt, done = next_window(
        tx, "outbox", "seq", "created_at", after, limit, [r[0] for r in rows], cutoff, False
    )
    if not rows:
        return Pruned(after=nxt, done=done)
    tx.executemany("DELETE FROM outbox WHERE seq = ?", [(r[0],) for r in rows])
    gone = 0
    for key in sorted({str(r[1]) for r in rows}):  # sorted: counters locked in one order
        counter = tx.one(
            "SELECT s.last_seq FROM outbox_sequences s WHERE s.order_key = ? AND NOT EXISTS "
            "(SELECT 1 FROM outbox o WHERE o.order_key = s.order_key)",
            (key,),
        )
        if counter is not None:
            tx.execute(
                "DELETE FROM outbox_sequences WHERE order_key = ? AND last_seq = ?",
                (key, counter[0]),
            )
            gone += tx.rowcount
    return Pruned(rows=len(rows) + gone, after=nxt, done=done)


def prune_schedule_runs(
    tx: Tx,
    env: StoreEnv,
    owner: str | None,
    agent_id: str,
    max_age_s: float,
    limit: int,
    dry_run: bool = False,
) -> Pruned:
    """Up to ``limit`` run records of ``agent_id``'s schedules whose tick is more than
    ``max_age_s`` ago and whose task left the inbox (pruned, or never queued: a skipped
    tick), never a schedule's newest."""
    if not holds(tx, env, owner):
        return Pruned()
    return _find_and_delete(
        tx,
        "SELECT r.schedule, r.tick FROM schedule_runs r JOIN schedules s ON s.name = r.schedule "
        "WHERE s.agent_id = ? AND r.tick < ? AND (r.inbox_id IS NULL OR NOT EXISTS "
        "(SELECT 1 FROM agent_inbox i WHERE i.inbox_id = r.inbox_id)) AND r.tick < "
        "(SELECT max(m.tick) FROM schedule_runs m WHERE m.schedule = r.schedule) LIMIT ?",
        (agent_id, env.clock.now() - max_age_s),
        "DELETE FROM schedule_runs WHERE schedule = ? AND tick = ?",
        limit,
        dry_run,
    )


def prune_refused_a2a_tasks(
    tx: Tx,
    env: StoreEnv,
    owner: str | None,
    agent_id: str,
    max_age_s: float,
    limit: int,
    dry_run: bool = False,
) -> Pruned:
    """Up to ``limit`` records of A2A tasks of ``agent_id`` refused at intake (never
    queued: no Turn, no tombstone) more than ``max_age_s`` ago. The record of a task that
    ran goes with its tombstone (agents/store/sql/tombstones.py)."""
    if not holds(tx, env, owner):
        return Pruned()
    return _find_and_delete(
        tx,
        "SELECT task_id FROM a2a_tasks WHERE agent_id = ? AND refusal IS NOT NULL "
        "AND created_at < ? LIMIT ?",
        (agent_id, env.clock.now() - max_age_s),
        "DELETE FROM a2a_tasks WHERE task_id = ?",
        limit,
        dry_run,
    )


def _find_and_delete(
    tx: Tx,
    select: str,
    params: tuple[SqlValue, ...],
    delete: str,
    limit: int,
    dry_run: bool,
) -> Pruned:
    """Up to ``limit`` keys ``select`` finds (its last parameter is the limit), each
    deleted by ``delete``; ``dry_run`` counts every one and deletes nothing."""
    found = tx.all(select, (*params, DRY_LIMIT if dry_run else limit))
    if not dry_run and found:
        tx.executemany(delete, found)
    return Pruned(rows=len(found), done=dry_run or len(found) < limit)
