"""The schema on PostgreSQL: the shared migrations (``agents/store/sql/schema.py``) plus what
only a shared database needs (which process wrote a row last, and each process's lease),
created and migrated at start under a transaction-scoped advisory lock, so processes
starting together migrate once and the others wait, then find the schema current.

Ownership without touching the shared SQL: each connection carries its process's owner
id (``SET agentserver.owner``, from the connection options), and a trigger stamps it on
every row of ``agent_state_head`` and ``agent_inbox`` the connection inserts or updates.
A running or suspended head's owner is the process running its Turn (or waiting for its
tools); a ``processing`` inbox row's owner is the process that claimed it.
"""

from __future__ import annotations

import hashlib

from agentserver.agents.store.sql.db import StoreEnv, Tx
from agentserver.agents.store.sql.schema import migrate

#: ``pg_advisory_xact_lock`` key of the migration (a constant: "agentsrv" in ASCII).
MIGRATION_LOCK = 0x6167656E74737276

OWNER_SETTING = "agentserver.owner"

#: The SQLSTATE of ``agentserver_expect``'s error (a class of our own: "AS").
EXPECT_FAILED = "ASX01"

EXTRAS = (
    """CREATE TABLE IF NOT EXISTS agentserver_processes (
    owner TEXT PRIMARY KEY,
    lease_until DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL
)""",
    # Issue 49: the agent versions each process serves (JSON: agent → version), and
    # whether it is draining (it takes no new work): the newest live version of an agent
    # takes its new tasks (agents/store/sql/versions.py).
    "ALTER TABLE agentserver_processes ADD COLUMN IF NOT EXISTS versions TEXT",
    "ALTER TABLE agentserver_processes ADD COLUMN IF NOT EXISTS draining INTEGER NOT NULL "
    "DEFAULT 0",
    "ALTER TABLE agent_state_head ADD COLUMN IF NOT EXISTS owner TEXT",
    "ALTER TABLE agent_inbox ADD COLUMN IF NOT EXISTS owner TEXT",
    "CREATE INDEX IF NOT EXISTS agent_state_head_owner ON agent_state_head (owner, status)",
    "CREATE INDEX IF NOT EXISTS agent_inbox_owner ON agent_inbox (owner, status)",
    f"""CREATE OR REPLACE FUNCTION agentserver_stamp_owner() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.owner := coalesce(nullif(current_setting('{OWNER_SETTING}', true), ''), NEW.owner);
    RETURN NEW;
END $$""",
    "DROP TRIGGER IF EXISTS agentserver_head_owner ON agent_state_head",
    "CREATE TRIGGER agentserver_head_owner BEFORE INSERT OR UPDATE ON agent_state_head "
    "FOR EACH ROW EXECUTE FUNCTION agentserver_stamp_owner()",
    # A store call sent in one round trip (agents/store/pg/one_trip.py) checks what its
    # function would have checked between statements with this: false aborts the
    # transaction (SQLSTATE EXPECT_FAILED), so nothing after it runs or commits.
    f"""CREATE OR REPLACE FUNCTION agentserver_expect(ok boolean, what text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF ok IS NOT TRUE THEN
        RAISE EXCEPTION USING ERRCODE = '{EXPECT_FAILED}', MESSAGE = what;
    END IF;
    RETURN true;
END $$""",
    "DROP TRIGGER IF EXISTS agentserver_inbox_owner ON agent_inbox",
    "CREATE TRIGGER agentserver_inbox_owner BEFORE INSERT OR UPDATE ON agent_inbox "
    "FOR EACH ROW EXECUTE FUNCTION agentserver_stamp_owner()",
)


#: Fingerprint of :data:`EXTRAS`, kept in ``agentserver_extras``: a start whose
#: extras are already in place runs none of them (see :func:`migrate_pg`).
EXTRAS_DIGEST = hashlib.sha256("\n;\n".join(EXTRAS).encode()).hexdigest()


def migrate_pg(tx: Tx, env: StoreEnv | None = None) -> int:
    """Create or migrate the schema (one transaction, under the advisory lock); returns
    the version found.

    The extras run only when their fingerprint changed (a new database, or a version
    with new extras): their ``ALTER TABLE``/``CREATE TRIGGER``/``CREATE INDEX`` take
    table locks even when there is nothing to do, so running them at every start made a
    starting process queue behind the running processes' open transactions and every
    later statement queue behind it, up to ``lock_timeout`` (a process starting beside
    a busy one failed)."""
    tx.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK,))
    found = migrate(tx, env)
    tx.execute("CREATE TABLE IF NOT EXISTS agentserver_extras (digest TEXT NOT NULL)")
    row = tx.one("SELECT max(digest) FROM agentserver_extras")
    if row is None or row[0] != EXTRAS_DIGEST:
        for statement in EXTRAS:
            tx.execute(statement)
        tx.execute("DELETE FROM agentserver_extras")
        tx.execute("INSERT INTO agentserver_extras (digest) VALUES (?)", (EXTRAS_DIGEST,))
    return found
