"""``agentserver store stats`` and ``store prune`` (issue 38), ``turns migrate`` and the
versions ``check`` compares (issue 49): the agents' store of a boot file looked at, pruned
and changed by hand, on a stopped server's store or beside a running one.

SQLite: a stopped server's file is opened as the server would (its lock, migrated); a
running server's file is attached beside it (:meth:`SqliteAgentStore.attach`: no lock,
transactions take turns with the server's). ``prune`` on a stopped server's file that was
made before retention was on first converts it to ``auto_vacuum=INCREMENTAL`` (one
``VACUUM``, which needs free disk as large as the file), so the pages it frees go back to
the file system; beside a running server it cannot convert, and says so. PostgreSQL:
the database of ``<store url>``; bloat is left to autovacuum (docs/deploy.md).
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from agentserver.agents.profile.retention import RetentionSettings
from agentserver.agents.service import effective_retention
from agentserver.agents.store.pruner import Pruner, PruneReport
from agentserver.agents.store.sql import stats as sql_stats
from agentserver.agents.store.sql import versions as sql_versions
from agentserver.agents.store.sqlite_store import SqliteAgentStore
from agentserver.app.replay import open_beside, store_settings
from agentserver.config import loader as boot
from agentserver.config.topology import Topology
from agentserver.config.versions import agent_versions


def retention_of(topology: Topology) -> RetentionSettings | None:
    """The retention the server's pruner applies (the store's with each agent's over it;
    an agent's alone prunes that agent only); None: none configured."""
    profiles = {
        spec.name: spec.agent_profile
        for spec in topology.listeners
        if spec.agent and spec.agent_profile is not None
    }
    return effective_retention(topology.store, profiles)


async def _open(topology: Topology, store: str | os.PathLike[str] | None) -> tuple[Any, bool]:
    """(the store, whether a running server holds it)."""
    return await open_beside(store_settings(topology, store))


def _agents(topology: Topology) -> tuple[str, ...]:
    return tuple(spec.name for spec in topology.listeners if spec.agent)


async def stats(
    boot_path: str | os.PathLike[str],
    *,
    store: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Rows, bytes and the oldest row per table, the store's size, and what retention
    would remove now (a dry run: nothing is deleted). Raises ``BootError``, ``AgentError``."""
    topology = boot.load_or_raise(boot_path, environ=environ)
    opened, beside = await _open(topology, store)
    try:
        tables = [
            {"table": name, "rows": rows, "bytes": size, "oldest": oldest}
            for name, rows, size, oldest in await opened.read(sql_stats.table_stats)
        ]
        retention = retention_of(topology)
        would = None
        if retention is not None:
            report = await Pruner(opened, retention, _agents(topology)).prune_once(dry_run=True)
            would = report.as_dict()
        out: dict[str, Any] = {
            "store": opened.settings.where,
            "backend": opened.settings.backend,
            "server_running": beside,
            "tables": tables,
            "retention": None if retention is None else _retention_dict(retention),
            "would_remove": would,
        }
        if isinstance(opened, SqliteAgentStore):
            out["file_bytes"] = opened.file_bytes()
            out["auto_vacuum"] = {0: "none", 1: "full", 2: "incremental"}.get(
                opened.vacuum_mode(), "?"
            )
        return out
    finally:
        await opened.aclose()


async def prune(
    boot_path: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    store: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    progress: Callable[[PruneReport], None] | None = None,
) -> dict[str, Any]:
    """Apply the boot file's retention once (see the module docstring). Raises
    ``BootError``, ``AgentError``; ``ValueError`` when the boot file has no retention."""
    topology = boot.load_or_raise(boot_path, environ=environ)
    retention = retention_of(topology)
    if retention is None:
        raise ValueError(
            f"{boot_path} has no <retention> (store's or any agent's): nothing to prune"
        )
    opened, beside = await _open(topology, store)
    try:
        notes: list[str] = []
        before = opened.file_bytes() if isinstance(opened, SqliteAgentStore) else None
        if isinstance(opened, SqliteAgentStore) and opened.vacuum_mode() != 2 and not dry_run:
            if beside:
                notes.append(
                    "the file is not auto_vacuum=INCREMENTAL and a server holds it: rows are "
                    "pruned, their pages reused, but the file does not shrink until "
                    "'agentserver store prune' runs with the server stopped"
                )
            else:
                opened.make_incremental()
                notes.append("converted the file to auto_vacuum=INCREMENTAL (VACUUM)")
        pruner = Pruner(opened, retention, _agents(topology))
        report = await pruner.prune_once(dry_run=dry_run, progress=progress)
        out: dict[str, Any] = {"dry_run": dry_run, "server_running": beside, **report.as_dict()}
        if isinstance(opened, SqliteAgentStore):
            if beside:
                opened.checkpoint()  # PASSIVE: never waits for the server's readers
            else:
                opened.checkpoint_truncate()
            out["file_bytes_before"] = before
            out["file_bytes_after"] = opened.file_bytes()
        out["notes"] = notes
        return out
    finally:
        await opened.aclose()


def _retention_dict(r: RetentionSettings) -> dict[str, Any]:
    return {
        "defaults": dataclasses.asdict(r.defaults),
        "step_log_s": r.step_log_s,
        "acknowledged_replies_s": r.acknowledged_replies_s,
        "tombstones_s": r.tombstones_s,
        "deliveries_s": r.deliveries_s,
        "interval_s": r.interval_s,
        "agents": {n: dataclasses.asdict(a) for n, a in r.agents.items()},
    }


async def migrate_turns(
    boot_path: str | os.PathLike[str],
    agent: str,
    was: str,
    *,
    store: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``agentserver turns migrate``: move the active Turns of ``agent`` begun on version
    ``was`` to the version ``boot_path`` defines now (docs/deploy.md): a pinned one is
    pinned to it, and each continues there at its next step, as an ``upgrade`` Turn
    would. Raises ``BootError``, ``AgentError``; ``ValueError`` for an agent the file
    does not declare, or a version that is already the current one."""
    topology = boot.load_or_raise(boot_path, environ=environ)
    current = agent_versions(topology).get(agent)
    if current is None:
        agents = ", ".join(_agents(topology)) or "none"
        raise ValueError(f"{boot_path} declares no agent {agent!r} (its agents: {agents})")
    if current.version == was:
        raise ValueError(
            f"version {was} is the current version of {agent!r} in {boot_path}: "
            "nothing to migrate (name the version its Turns began on, as status shows it)"
        )
    opened, beside = await _open(topology, store)
    try:
        moved = await opened.run(sql_versions.migrate_turns, agent, was, current.version)
    finally:
        await opened.aclose()
    return {
        "agent": agent,
        "from": was,
        "to": current.version,
        "turns": moved,
        "server_running": beside,
    }


async def recorded_versions(
    topology: Topology, *, connect: bool = False
) -> dict[tuple[str, str], str] | None:
    """The versions the store of ``topology`` has seen served: (agent, version) → digest
    (``check``); empty when it has none yet. Read only: a SQLite file is attached (no lock,
    no migration); a PostgreSQL database is read only if ``connect``, else None."""
    settings = store_settings(topology, None)
    if settings.url:
        if not connect:
            return None
        opened, _ = await _open(topology, None)
    elif not settings.path.exists():
        return {}
    else:
        opened = SqliteAgentStore.attach(settings.path, settings=settings)
    try:
        return await opened.read(sql_versions.recorded)
    except sqlite3.OperationalError:  # a file from before agent versions
        return {}
    finally:
        await opened.aclose()
