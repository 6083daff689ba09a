"""Agent versions in the store (docs/deploy.md, "Deploying with Turns in flight").

What each Turn runs is recorded where it is decided: a task's row names the version of the
process that enqueued it (``agent_inbox.version``; the one that started it, once started),
the head the version its Turn started with (``turn_version``) and its pin (``turn_pin``,
the same, for an agent whose Turns are pinned), each step the version that ran it
(``agent_steps.version``). ``agent_versions`` lists every version of each agent a process
served, with its digest: the newest live version of an agent is the one first seen last
among those that live processes serve.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from agentserver.agents.store.base import TurnToken
from agentserver.agents.store.sql import head
from agentserver.agents.store.sql.common import edge
from agentserver.agents.store.sql.db import POSTGRESQL, StoreEnv, Tx, marks
from agentserver.agents.store.states import (
    ACTIVE_HEAD,
    AfterExecution,
    HeadStatus,
    MessageType,
    WaitingStatus,
)

MIGRATION = """
ALTER TABLE agent_state_head ADD COLUMN turn_version TEXT;
ALTER TABLE agent_state_head ADD COLUMN turn_pin TEXT;
ALTER TABLE agent_inbox ADD COLUMN version TEXT;
ALTER TABLE agent_steps ADD COLUMN version TEXT;
CREATE TABLE agent_versions (
    agent_id TEXT NOT NULL,
    version TEXT NOT NULL,
    digest TEXT NOT NULL,
    versioning TEXT NOT NULL,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    PRIMARY KEY (agent_id, version)
);
"""


@dataclass(frozen=True, slots=True)
class Redefined:
    """A named version whose definition changed under its name."""

    agent_id: str
    version: str
    was: str
    now: str

    def text(self) -> str:
        return (
            f"agent {self.agent_id!r}: version {self.version!r} was defined differently "
            f"before (digest {self.was[:12]}, now {self.now[:12]}): rename the version "
            "when its definition changes, or pinned Turns of the old definition run the new"
        )


def register(tx: Tx, env: StoreEnv) -> list[Redefined]:
    """Record the versions this process serves (``env.served``): a new one is first seen
    now. Returns the named versions whose digest changed (each now recorded as it is)."""
    served = env.served
    now = env.clock.now()
    changed = []
    for agent_id, version in sorted(served.versions.items()):
        digest = served.digests.get(agent_id, "")
        versioning = "pinned" if agent_id in served.pinned else "upgrade"
        row = tx.one(
            "SELECT digest FROM agent_versions WHERE agent_id = ? AND version = ?",
            (agent_id, version),
        )
        if row is None:
            tx.execute(
                "INSERT INTO agent_versions (agent_id, version, digest, versioning, "
                "first_seen, last_seen) VALUES (?,?,?,?,?,?)",
                (agent_id, version, digest, versioning, now, now),
            )
            continue
        if row[0] != digest:
            changed.append(Redefined(agent_id, version, row[0], digest))
        tx.execute(
            "UPDATE agent_versions SET digest = ?, versioning = ?, last_seen = ? "
            "WHERE agent_id = ? AND version = ?",
            (digest, versioning, now, agent_id, version),
        )
    return changed


def recorded(tx: Tx, env: StoreEnv) -> dict[tuple[str, str], str]:
    """Every version recorded: (agent, version) → digest."""
    rows = tx.all("SELECT agent_id, version, digest FROM agent_versions")
    return {(r[0], r[1]): r[2] for r in rows}


def newest(
    served_by: dict[str, set[str]], first_seen: dict[tuple[str, str], float]
) -> dict[str, str]:
    """agent → its newest version among those served (``served_by``: agent → versions
    live processes serve), by when each was first seen."""
    return {
        agent: max(versions, key=lambda v: (first_seen.get((agent, v), 0.0), v))
        for agent, versions in served_by.items()
        if versions
    }


def newest_here(tx: Tx, env: StoreEnv, live: list[tuple[str, bool]]) -> frozenset[str]:
    """The agents whose newest live version this process serves, given the live
    processes' ``(versions JSON, draining)``; a draining process serves no new work."""
    served_by: dict[str, set[str]] = {}
    for versions_json, draining in live:
        if draining:
            continue
        for agent, version in process_versions(versions_json).items():
            served_by.setdefault(agent, set()).add(version)
    seen = {
        (r[0], r[1]): float(r[2])
        for r in tx.all("SELECT agent_id, version, first_seen FROM agent_versions")
    }
    best = newest(served_by, seen)
    mine = env.served.versions
    return frozenset(a for a, v in mine.items() if best.get(a, v) == v)


def upgrade_turn(tx: Tx, env: StoreEnv, token: TurnToken, was: str | None) -> None:
    """Turn ``token`` (an ``upgrade`` one, begun on version ``was``) continues on this
    process's version: recorded on its head, with an ``upgrade`` edge. Fenced (StaleTurn
    when it moved on; then nothing is written)."""
    version = env.served.version(token.agent_id)
    head.fence(
        tx,
        env,
        token,
        HeadStatus.RUNNING,
        sets={"turn_version": version},
        where=" AND turn_pin IS NULL",
    )
    edge(
        tx,
        env,
        token.agent_id,
        token.agent_turn_id,
        "upgrade",
        "request",
        metadata={"from": was, "to": version},
    )


def migrate_turns(tx: Tx, env: StoreEnv, agent_id: str, was: str, to: str) -> list[str]:
    """Move the active Turns of ``agent_id`` begun on version ``was`` to version ``to``
    (``agentserver turns migrate``): a pinned one is pinned to ``to``, and it continues
    there as an ``upgrade`` Turn would. Returns the Turns moved."""
    rows = tx.all(
        "UPDATE agent_state_head SET turn_version = ?, "
        "turn_pin = CASE WHEN turn_pin IS NULL THEN NULL ELSE ? END, updated_at = ? "
        f"WHERE agent_id = ? AND turn_version = ? AND status IN ({marks(len(ACTIVE_HEAD))}) "
        "RETURNING active_agent_turn_id",
        (to, to, env.clock.now(), agent_id, was, *sorted(ACTIVE_HEAD)),
    )
    moved = [r[0] for r in rows]
    for turn_id in moved:
        edge(tx, env, agent_id, turn_id, "migrate", "request", metadata={"from": was, "to": to})
    return moved


def live_served(tx: Tx, env: StoreEnv) -> set[tuple[str, str]]:
    """(agent, version) pairs some live process serves: on PostgreSQL every process whose
    lease is live (draining ones too: they finish their pinned Turns), on SQLite this
    process (the only one)."""
    if tx.dialect != POSTGRESQL:
        return set(env.served.versions.items())
    out: set[tuple[str, str]] = set()
    for (versions_json,) in tx.all(
        "SELECT versions FROM agentserver_processes "
        "WHERE lease_until >= extract(epoch from clock_timestamp())::double precision"
    ):
        out.update(process_versions(versions_json).items())
    return out


def process_versions(versions_json: str | None) -> dict[str, str]:
    """A process's lease row's ``versions`` (agent → version); empty when it has none or
    they cannot be read."""
    try:
        versions = json.loads(versions_json or "{}")
    except ValueError:
        return {}
    return versions if isinstance(versions, dict) else {}


def calls_in_flight(tx: Tx, env: StoreEnv, owner: str | None) -> int:
    """Tool calls sent and not answered yet, of the suspended Turns ``owner`` holds (a
    PostgreSQL process id; None: all of them, SQLite's one process): what a draining
    process waits for before it exits, as their results come back to its pump. Calls
    waiting for an approval are not in flight, nor calls whose report has arrived."""
    where = ""
    params: tuple[str, ...] = ()
    if owner is not None and tx.dialect == POSTGRESQL:
        where, params = " AND h.owner = ?", (owner,)
    # A call whose report is in the inbox (queued for another process) is answered.
    row = tx.one(
        "SELECT count(*) FROM turn_waiting_tools w JOIN agent_state_head h "
        "ON h.agent_id = w.agent_id AND h.active_agent_turn_id = w.agent_turn_id "
        f"WHERE w.status = ? AND w.after_execution != ? AND h.status = ?{where} "
        "AND NOT EXISTS (SELECT 1 FROM agent_inbox r WHERE r.correlation_id = w.tool_call_id "
        "AND r.message_type IN (?, ?))",
        (
            WaitingStatus.WAITING,
            AfterExecution.APPROVAL,
            HeadStatus.SUSPENDED,
            *params,
            MessageType.TOOL_RESULT,
            MessageType.TIMEOUT,
        ),
    )
    return int(row[0]) if row else 0
