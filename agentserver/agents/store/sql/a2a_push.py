"""A2A push notifications (docs/a2a.md, "Push notifications"): the configs clients set on
their tasks, and the state each was last notified of. A notification owed is a row of the
webhooks' durable outbox (agents/store/outbox.py), written in the transaction that
records the state it reports, before any attempt, and delivered from there at least once,
across restarts. Every function is one backend-neutral transaction.
"""

from __future__ import annotations

from agentserver.agents.store import outbox
from agentserver.agents.store.outbox import OutboxItem
from agentserver.agents.store.sql.db import StoreEnv, Tx

MIGRATION = """
CREATE TABLE a2a_push_configs (
    task_id TEXT NOT NULL,
    config_id TEXT NOT NULL,
    config TEXT NOT NULL,
    last_state TEXT,
    finished INTEGER NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (task_id, config_id)
);
CREATE TABLE a2a_pushes (
    push_id TEXT PRIMARY KEY,
    task_id TEXT NOT NULL,
    config_id TEXT NOT NULL,
    body TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    next_at REAL NOT NULL,
    done_at REAL,
    last_error TEXT,
    created_at REAL NOT NULL
);
CREATE INDEX a2a_pushes_due ON a2a_pushes (done_at, next_at);
"""
#: The notifications moved to the webhooks' outbox (``outbox``, agents/store/outbox.py):
#: their own table goes. It was never in a release.
OUTBOX_MIGRATION = """
DROP INDEX a2a_pushes_due;
DROP TABLE a2a_pushes;
"""


def put_config(tx: Tx, env: StoreEnv, task_id: str, config_id: str, config: str) -> None:
    """Set (or replace) config ``config_id`` of ``task_id`` (the SDK's config as JSON)."""
    tx.execute(
        "INSERT INTO a2a_push_configs (task_id, config_id, config, last_state, finished, "
        "created_at) VALUES (?, ?, ?, NULL, 0, ?) ON CONFLICT (task_id, config_id) "
        "DO UPDATE SET config = excluded.config",
        (task_id, config_id, config, env.clock.now()),
    )


def configs(tx: Tx, env: StoreEnv, task_id: str) -> list[tuple[str, str]]:
    """(config id, config JSON) of ``task_id``, oldest first."""
    rows = tx.all(
        "SELECT config_id, config FROM a2a_push_configs WHERE task_id = ? "
        "ORDER BY created_at, config_id",
        (task_id,),
    )
    return [(str(r[0]), str(r[1])) for r in rows]


def delete_config(tx: Tx, env: StoreEnv, task_id: str, config_id: str) -> bool:
    tx.execute(
        "DELETE FROM a2a_push_configs WHERE task_id = ? AND config_id = ?", (task_id, config_id)
    )
    return tx.rowcount > 0


def watched(tx: Tx, env: StoreEnv, limit: int) -> list[tuple[str, str, str | None]]:
    """(task, config, last state notified) of the configs whose task has not been
    notified of its end, at most ``limit``, oldest first."""
    rows = tx.all(
        "SELECT task_id, config_id, last_state FROM a2a_push_configs WHERE finished = 0 "
        "ORDER BY created_at LIMIT ?",
        (limit,),
    )
    return [(str(r[0]), str(r[1]), r[2]) for r in rows]


def owe(
    tx: Tx,
    env: StoreEnv,
    task_id: str,
    config_id: str,
    seen: str | None,
    state: str,
    finished: bool,
    item: OutboxItem,
) -> bool:
    """Owe a notification of ``state`` (``item``, on the webhooks' outbox), if the
    config's last notified state is still ``seen`` (another process may have owed it
    first): False then, nothing written. The outbox row is written in this transaction:
    a notification is owed exactly when its state is recorded as notified."""
    if seen is None:
        tx.execute(
            "UPDATE a2a_push_configs SET last_state = ?, finished = ? "
            "WHERE task_id = ? AND config_id = ? AND last_state IS NULL",
            (state, int(finished), task_id, config_id),
        )
    else:
        tx.execute(
            "UPDATE a2a_push_configs SET last_state = ?, finished = ? "
            "WHERE task_id = ? AND config_id = ? AND last_state = ?",
            (state, int(finished), task_id, config_id, seen),
        )
    if tx.rowcount != 1:
        return False
    outbox.enqueue(tx, env, [item])
    return True
