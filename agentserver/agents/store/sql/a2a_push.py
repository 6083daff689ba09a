"""A2A push notifications (docs/a2a.md, "Push notifications"): the configs clients set on
their tasks, and the notifications owed, durable until delivered (an outbox: a
notification is written, in the transaction that records the state it reports, before
any attempt; it leaves the owed set only once its POST succeeded, so it is delivered at
least once, across restarts). Every function is one backend-neutral transaction.
"""

from __future__ import annotations

from typing import Any

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
    push_id: str,
    body: str,
) -> bool:
    """Owe a notification of ``state`` (``body``), if the config's last notified state is
    still ``seen`` (another process may have owed it first): False then, nothing written."""
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
    now = env.clock.now()
    tx.execute(
        "INSERT INTO a2a_pushes (push_id, task_id, config_id, body, attempts, next_at, "
        "done_at, last_error, created_at) VALUES (?, ?, ?, ?, 0, ?, NULL, NULL, ?)",
        (push_id, task_id, config_id, body, now, now),
    )
    return True


def claim_due(tx: Tx, env: StoreEnv, lease: float, limit: int) -> list[dict[str, Any]]:
    """The notifications due now (at most ``limit``, oldest first), each leased for
    ``lease`` seconds (no other process tries it meanwhile), with its config's JSON."""
    now = env.clock.now()
    rows = tx.all(
        "SELECT p.push_id, p.task_id, p.config_id, p.body, p.attempts, p.next_at, c.config "
        "FROM a2a_pushes p JOIN a2a_push_configs c "
        "ON c.task_id = p.task_id AND c.config_id = p.config_id "
        "WHERE p.done_at IS NULL AND p.next_at <= ? ORDER BY p.next_at LIMIT ?",
        (now, limit),
    )
    out = []
    for push_id, task_id, config_id, body, attempts, next_at, config in rows:
        tx.execute(
            "UPDATE a2a_pushes SET next_at = ? WHERE push_id = ? AND next_at = ?",
            (now + lease, push_id, next_at),
        )
        if tx.rowcount == 1:
            out.append(
                {
                    "push_id": push_id,
                    "task_id": task_id,
                    "config_id": config_id,
                    "body": body,
                    "attempts": int(attempts),
                    "config": config,
                }
            )
    return out


def delivered(tx: Tx, env: StoreEnv, push_id: str) -> None:
    tx.execute(
        "UPDATE a2a_pushes SET done_at = ?, attempts = attempts + 1 WHERE push_id = ?",
        (env.clock.now(), push_id),
    )


def failed(tx: Tx, env: StoreEnv, push_id: str, delay: float | None, error: str) -> None:
    """An attempt failed: try again in ``delay`` seconds (None: given up, kept with its
    error)."""
    now = env.clock.now()
    if delay is None:
        tx.execute(
            "UPDATE a2a_pushes SET done_at = ?, attempts = attempts + 1, last_error = ? "
            "WHERE push_id = ?",
            (now, error[:2000], push_id),
        )
    else:
        tx.execute(
            "UPDATE a2a_pushes SET next_at = ?, attempts = attempts + 1, last_error = ? "
            "WHERE push_id = ?",
            (now + delay, error[:2000], push_id),
        )
