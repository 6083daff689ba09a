"""The store's size and its agents, for ``agentserver store stats`` and the pruner's
passes (issue 38). Plain read-only functions over one transaction, both engines."""

from __future__ import annotations

from agentserver.agents.store.sql.db import POSTGRESQL, StoreEnv, Tx

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
    "outbox": "created_at",
    "outbox_sequences": None,
    "outbox_channels": None,
    "webhooks": "created_at",
    "schedules": "created_at",
    "schedule_runs": "at",
    "budget_spend": "period_start",
    "budget_holds": "expires_at",
    "budget_overrides": None,
    "fair_share": None,
    "a2a_tasks": "created_at",
    "a2a_push_configs": "created_at",
    "ui_sessions": "created_at",
    "schema_version": None,
}


def agent_ids(tx: Tx, env: StoreEnv) -> list[str]:
    """Every agent with a head, inbox rows or boxes (the pruner's per-agent passes)."""
    rows = tx.all(
        "SELECT agent_id FROM agent_state_head UNION SELECT DISTINCT agent_id FROM agent_inbox "
        "UNION SELECT DISTINCT agent_id FROM boxes"
    )
    return sorted(str(r[0]) for r in rows)


def record_agents(tx: Tx, env: StoreEnv) -> tuple[list[str], list[str]]:
    """(agents with schedules, agents with refused A2A tasks): the pruner's passes over
    those records run for them only (an empty pass would still be a write transaction)."""
    scheduled = tx.all("SELECT DISTINCT agent_id FROM schedules")
    refused = tx.all("SELECT DISTINCT agent_id FROM a2a_tasks WHERE refusal IS NOT NULL")
    return sorted(str(r[0]) for r in scheduled), sorted(str(r[0]) for r in refused)


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
