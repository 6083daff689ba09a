"""The schema: created and migrated on open, tracked in ``schema_version``.

The migrations are written in SQLite's DDL (files in the field are at version 4);
:func:`ddl` gives a migration's statements for a dialect. PostgreSQL differs only in
column types: ``INTEGER PRIMARY KEY AUTOINCREMENT`` becomes an identity column, ``BLOB``
``BYTEA`` and ``REAL`` ``DOUBLE PRECISION`` (times are seconds since the epoch).
"""

from __future__ import annotations

from agentserver.agents.errors import StoreError
from agentserver.agents.store import outbox, step_log
from agentserver.agents.store.sql import (
    a2a,
    a2a_push,
    fair,
    memory,
    prune,
    tombstones,
    ui_sessions,
    versions,
)
from agentserver.agents.store.sql import budgets as budget_sql
from agentserver.agents.store.sql.db import POSTGRESQL, SQLITE, Tx

_GOVERNANCE = """
CREATE TABLE policy_decisions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT NOT NULL,
    step_id TEXT NOT NULL,
    target TEXT NOT NULL,
    payload_tag TEXT NOT NULL,
    decision TEXT NOT NULL,
    rule TEXT NOT NULL,
    reason TEXT NOT NULL,
    rate_key TEXT,
    at REAL NOT NULL
);
CREATE INDEX policy_decisions_rate ON policy_decisions (rate_key, at);
CREATE INDEX policy_decisions_turn ON policy_decisions (agent_turn_id, seq);
CREATE TABLE approvals (
    request_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT NOT NULL,
    step_id TEXT NOT NULL,
    target TEXT NOT NULL,
    payload TEXT NOT NULL,
    rule TEXT NOT NULL,
    approver TEXT NOT NULL,
    thread TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT,
    deadline REAL NOT NULL,
    created_at REAL NOT NULL,
    sent_at REAL,
    decided_at REAL,
    decided_by TEXT,
    tool_call_id TEXT
);
CREATE INDEX approvals_status ON approvals (status, deadline);
"""

MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE agent_state_head (
    agent_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    active_agent_turn_id TEXT,
    turn_epoch INTEGER NOT NULL DEFAULT 0,
    turn_inbox_id TEXT,
    context_box_id TEXT,
    output_box_id TEXT,
    step_count INTEGER NOT NULL DEFAULT 0,
    waiting_tool_count INTEGER NOT NULL DEFAULT 0,
    resume_deadline REAL,
    expecting_correlation_id TEXT,
    -- unused: submit_result ends its Turn, so it is used at most once (kept in v1 files)
    submit_used INTEGER NOT NULL DEFAULT 0,
    dispatched_at REAL,
    running_since REAL,
    updated_at REAL NOT NULL
);
CREATE TABLE agent_inbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    inbox_id TEXT NOT NULL UNIQUE,
    agent_id TEXT NOT NULL,
    message_type TEXT NOT NULL,
    status TEXT NOT NULL,
    agent_turn_id TEXT,
    turn_epoch INTEGER,
    correlation_id TEXT,
    payload BLOB NOT NULL,
    reply_ref TEXT,
    failed INTEGER NOT NULL DEFAULT 0,
    retry_count INTEGER NOT NULL DEFAULT 0,
    next_retry_at REAL NOT NULL,
    defer_reason TEXT,
    processing_at REAL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX agent_inbox_due ON agent_inbox (agent_id, status, next_retry_at, created_at);
CREATE INDEX agent_inbox_status ON agent_inbox (status, next_retry_at);
CREATE INDEX agent_inbox_corr ON agent_inbox (correlation_id);
CREATE TABLE turn_waiting_tools (
    tool_call_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT NOT NULL,
    turn_epoch INTEGER NOT NULL,
    step_id TEXT NOT NULL,
    to_listener TEXT NOT NULL,
    after_execution TEXT NOT NULL,
    status TEXT NOT NULL,
    result_card_id TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX turn_waiting_turn ON turn_waiting_tools (agent_turn_id, turn_epoch, status);
CREATE TABLE execution_edges (
    edge_id INTEGER PRIMARY KEY AUTOINCREMENT,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT,
    primitive TEXT NOT NULL,
    edge_phase TEXT NOT NULL,
    correlation_id TEXT,
    inbox_id TEXT,
    created_at REAL NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX execution_edges_turn ON execution_edges (agent_turn_id);
CREATE TABLE agent_steps (
    step_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT NOT NULL,
    turn_epoch INTEGER NOT NULL,
    step_no INTEGER NOT NULL,
    status TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    model TEXT,
    backend TEXT,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    total_tokens INTEGER,
    cost REAL,
    tool_call_ids TEXT NOT NULL DEFAULT '[]',
    metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX agent_steps_turn ON agent_steps (agent_turn_id, step_no);
CREATE TABLE boxes (
    box_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    agent_turn_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE cards (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    card_id TEXT NOT NULL UNIQUE,
    box_id TEXT NOT NULL REFERENCES boxes (box_id),
    agent_turn_id TEXT NOT NULL,
    card_type TEXT NOT NULL,
    content TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL
);
CREATE INDEX cards_box ON cards (box_id, seq);
CREATE TABLE agent_replies (
    agent_turn_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    reply_ref TEXT NOT NULL,
    payload BLOB NOT NULL,
    failed INTEGER NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    sent_at REAL
);
CREATE INDEX agent_replies_status ON agent_replies (status, created_at);
CREATE TABLE client_replies (
    reply_id INTEGER PRIMARY KEY AUTOINCREMENT,
    client TEXT NOT NULL,
    thread_ref TEXT NOT NULL,
    payload BLOB NOT NULL,
    failed INTEGER NOT NULL,
    created_at REAL NOT NULL,
    delivered_at REAL
);
CREATE INDEX client_replies_client ON client_replies (client, delivered_at, reply_id);
""",
    # Issue 12: the context budget. A card's estimated cost as the model is shown it, and
    # the running sum over the head's two boxes (so the budget check is O(1) per step).
    2: """
ALTER TABLE cards ADD COLUMN tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE agent_state_head ADD COLUMN context_tokens INTEGER NOT NULL DEFAULT 0;
""",
    # Issue 12: memory across tasks. A Turn's conversation (agents/turn/memory.py), and where
    # each conversation's last Turn left its cards.
    3: """
ALTER TABLE agent_inbox ADD COLUMN conversation TEXT;
CREATE TABLE conversations (
    agent_id TEXT NOT NULL,
    conversation TEXT NOT NULL,
    context_box_id TEXT NOT NULL,
    output_box_id TEXT NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (agent_id, conversation)
);
""",
    # Issue 14: governance. Policy decisions (rate windows) and approval requests.
    4: _GOVERNANCE,
    # Issue 15: the step log of remote listeners (agents/store/step_log.py).
    5: step_log.MIGRATION,
    # Issue 26: forks. A forked conversation names the Turn and step it was copied from.
    6: """
CREATE TABLE forks (
    agent_id TEXT NOT NULL,
    conversation TEXT NOT NULL,
    origin_thread TEXT NOT NULL,
    origin_turn TEXT NOT NULL,
    at_step INTEGER NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (agent_id, conversation)
);
""",
    # Issue 36: the durable outbox (webhooks and A2A push notifications), the webhooks
    # made at run time (agents/store/outbox.py).
    7: outbox.MIGRATION,
    # Issue 38: retention. Tombstones of pruned Turns, the pruner's lease, the indexes a
    # prune batch looks rows up by (agents/store/sql/prune.py).
    8: prune.MIGRATION,
    # Issue 37: spend budgets, reserved before each model call (agents/store/sql/budgets.py).
    9: budget_sql.MIGRATION + fair.MIGRATION,
    # Issue 36: schedules (agents/store/sql/schedules.py). A schedule's next tick is the
    # compare-and-set key of its claim; a run is keyed (schedule, tick): fired once.
    10: """
CREATE TABLE schedules (
    name TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    cron TEXT NOT NULL,
    timezone TEXT NOT NULL,
    overlap TEXT NOT NULL,
    catchup_window REAL NOT NULL,
    jitter REAL NOT NULL,
    payload BLOB NOT NULL,
    source TEXT NOT NULL,
    paused INTEGER NOT NULL DEFAULT 0,
    next_tick REAL,
    last_tick REAL,
    last_outcome TEXT,
    last_inbox_id TEXT,
    fired INTEGER NOT NULL DEFAULT 0,
    skipped INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE schedule_runs (
    schedule TEXT NOT NULL,
    tick REAL NOT NULL,
    inbox_id TEXT,
    outcome TEXT NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (schedule, tick)
);
""",
    # Issue 35: A2A tasks (agents/store/sql/a2a.py).
    11: a2a.MIGRATION + a2a_push.MIGRATION,
    # Issue 37: budgets changed at run time hold across processes and periods
    # (agents/store/sql/budgets.py).
    12: budget_sql.OVERRIDES_MIGRATION,
    # Issue 35/36: A2A push notifications delivered from the webhooks' outbox.
    13: a2a_push.OUTBOX_MIGRATION,
    # Issue 38: a new Turn names its conversation's memory instead of copying it
    # (agents/store/sql/memory.py); a task of an agent without memory names its caller,
    # whom keep-last counts its tasks by (agents/store/sql/prune.py); tombstones are
    # pruned by age (agents/store/sql/tombstones.py).
    14: memory.MIGRATION + prune.CALLER_MIGRATION + tombstones.MIGRATION,
    # Issue 44: the web console's sign-in sessions, server-side (agents/store/sql/ui_sessions.py).
    15: ui_sessions.MIGRATION,
    # Issue 43: a budget hold belongs to the Turn's step that made its call, not to a
    # process (agents/store/sql/budgets.py).
    16: budget_sql.HOLDS_MIGRATION,
    # Issue 44: a tombstone names the client that sent its task, so only that client (and
    # the operators) is told "pruned" (agents/store/sql/tombstones.py).
    17: tombstones.SENDER_MIGRATION,
    # Issue 49: agent versions. What each Turn, task and step ran, and the versions
    # processes served (agents/store/sql/versions.py).
    18: versions.MIGRATION,
}
#: The newest schema version: migrations are numbered 1..N without gaps.
SCHEMA_VERSION = max(MIGRATIONS)
if sorted(MIGRATIONS) != list(range(1, SCHEMA_VERSION + 1)):
    raise RuntimeError(f"schema migrations must be numbered 1..N: {sorted(MIGRATIONS)}")


_PG_TYPES = (
    ("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"),
    (" BLOB", " BYTEA"),
    (" REAL", " DOUBLE PRECISION"),
)


def ddl(version: int, dialect: str) -> list[str]:
    """The statements of migration ``version`` in ``dialect``."""
    text = MIGRATIONS[version]
    if dialect == POSTGRESQL:
        for old, new in _PG_TYPES:
            text = text.replace(old, new)
    elif dialect != SQLITE:
        raise StoreError(f"no schema for dialect {dialect!r}")
    return [s.strip() for s in text.split(";") if s.strip()]


def migrate(tx: Tx, env: object = None) -> int:
    """Bring the schema to :data:`SCHEMA_VERSION`; returns the version found. (``env``:
    unused, so the backend runs it like any store function.)"""
    tx.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = tx.one("SELECT max(version) FROM schema_version")
    current = (row[0] if row else None) or 0
    if current > SCHEMA_VERSION:
        raise StoreError(f"store schema {current} is newer than this code")
    for version in range(current + 1, SCHEMA_VERSION + 1):
        for statement in ddl(version, tx.dialect):
            tx.execute(statement)
        tx.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    return current
