"""Leases on a shared store: which processes are alive, and taking over the work of the
ones that are not. Store functions (one transaction each), no leader.

Each process has a row in ``agentserver_processes`` whose ``lease_until`` it renews every
heartbeat (times are the database server's clock, so processes on machines whose clocks
differ still agree). The rows a process writes carry its owner id (``pg/schema.py``), so
a process whose lease has expired is known by what it held:

- its ``running`` Turns are fenced (epoch + 1) and get a ``resume`` row, exactly as at a
  restart (``sql/watchdog.recover_turn``): any process's worker then re-runs the next
  step from the last committed card; a write of the old process, should it still be
  alive, matches no row (the compare-and-set on the epoch);
- its ``processing`` inbox rows go back to ``pending``;
- its ``suspended`` Turns are returned, so the caller injects timeouts for their tool
  calls (the results would have arrived at the dead process's pump).

Every process runs :func:`reclaim` after its heartbeat; ``FOR UPDATE SKIP LOCKED`` on the
process rows lets exactly one of them take over one dead process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from agentserver.agents.store.base import TurnToken
from agentserver.agents.store.pg import callers
from agentserver.agents.store.sql import versions
from agentserver.agents.store.sql.db import StoreEnv, Tx, marks
from agentserver.agents.store.sql.watchdog import recover_turn
from agentserver.agents.store.states import HeadStatus, InboxEvent, inbox_sources, inbox_transition

_DB_NOW = "extract(epoch from clock_timestamp())::double precision"


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """What one :func:`reclaim` took over."""

    owners: tuple[str, ...] = ()
    recovered: list[TurnToken] = field(default_factory=list)
    suspended: list[TurnToken] = field(default_factory=list)
    requeued: int = 0


def heartbeat(tx: Tx, env: StoreEnv, owner: str, lease_s: float, host: str, pid: int) -> int:
    """Register ``owner`` or renew its lease to ``lease_s`` from now, with the versions it
    serves and whether it drains (``env.served``); returns how many other processes hold
    a live lease. Sets ``env.served.newest``: the agents whose newest live version this
    process serves (agents/store/served.py)."""
    served = env.served
    tx.execute(
        "INSERT INTO agentserver_processes (owner, lease_until, started_at, host, pid, "
        f"versions, draining) VALUES (?, {_DB_NOW} + ?, {_DB_NOW}, ?, ?, ?, ?) "
        "ON CONFLICT (owner) DO UPDATE SET lease_until = excluded.lease_until, "
        "versions = excluded.versions, draining = excluded.draining",
        (owner, lease_s, host, pid, json.dumps(dict(served.versions)), int(served.draining)),
    )
    live = tx.all(
        "SELECT owner, versions, draining FROM agentserver_processes "
        f"WHERE lease_until >= {_DB_NOW}"
    )
    if served.versions:
        served.newest = versions.newest_here(tx, env, [(r[1], bool(r[2])) for r in live])
    return sum(1 for r in live if r[0] != owner)


def release(tx: Tx, env: StoreEnv, owner: str) -> None:
    """End ``owner``'s lease now (a clean stop): the others take over at their next
    heartbeat instead of after the lease."""
    tx.execute("UPDATE agentserver_processes SET lease_until = 0 WHERE owner = ?", (owner,))


def reclaim(tx: Tx, env: StoreEnv, limit: int = 8, mine: str | None = None) -> Reclaimed:
    """Take over the work of up to ``limit`` processes whose lease has expired; with
    ``mine``, also that owner's own (its worker is not running: start-up recovery)."""
    dead = tuple(
        r[0]
        for r in tx.all(
            f"SELECT owner FROM agentserver_processes WHERE lease_until < {_DB_NOW} "
            "ORDER BY lease_until LIMIT ? FOR UPDATE SKIP LOCKED",
            (limit,),
        )
    )
    owners = (*dead, mine) if mine else dead
    if not owners:
        return Reclaimed()
    now = env.clock.now()
    of = f"owner IN ({marks(len(owners))})"
    sources = inbox_sources(InboxEvent.REQUEUE)
    target = inbox_transition(sources[0], InboxEvent.REQUEUE).target
    tx.execute(
        "UPDATE agent_inbox SET status = ?, updated_at = ?, next_retry_at = ?, "
        f"processing_at = NULL WHERE status IN ({marks(len(sources))}) AND {of}",
        (target, now, now, *sources, *owners),
    )
    requeued = tx.rowcount
    heads = tx.all(
        "SELECT agent_id, active_agent_turn_id, turn_epoch, status FROM agent_state_head "
        f"WHERE status IN (?, ?) AND {of} ORDER BY agent_id FOR UPDATE",
        (HeadStatus.RUNNING, HeadStatus.SUSPENDED, *owners),
    )
    recovered = [
        recover_turn(tx, env, TurnToken(a, t, e), now)
        for a, t, e, status in heads
        if status == HeadStatus.RUNNING
    ]
    suspended = [TurnToken(a, t, e) for a, t, e, status in heads if status == HeadStatus.SUSPENDED]
    if dead:
        # Their callers' connections died with them: nobody is left to answer.
        callers.give_up(tx, env, dead)
        tx.execute(f"DELETE FROM agentserver_processes WHERE owner IN ({marks(len(dead))})", dead)
    return Reclaimed(dead, recovered, suspended, requeued)


def processes(tx: Tx, env: StoreEnv) -> list[tuple[str, float, str, int]]:
    """Every registered process: owner, seconds its lease has left, host, pid."""
    return [
        (r[0], float(r[1]), r[2], int(r[3]))
        for r in tx.all(
            f"SELECT owner, lease_until - {_DB_NOW}, host, pid FROM agentserver_processes "
            "ORDER BY started_at"
        )
    ]
