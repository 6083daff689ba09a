"""The web console's sign-in sessions (issue 44): what stays on the server of a browser
signed in at ``/ui``. A row is keyed by a hash of the session id (the cookie's value is
never stored, so reading the table signs no one in), names the client the session was
made for, and holds the session's proof (an HMAC of the session id under that client's
token, checked by the HTTP API's authentication: a token changed in the environment ends
its sessions). Kept in the agents' store so every process of a PostgreSQL store and a
restarted server know it. Plain functions over one transaction, both engines.

Bounded: a row expires ``lifetime_s`` after its sign-in (store time, ``env.clock``);
each sign-in deletes up to :data:`SWEEP` expired rows and keeps a client's newest
:data:`MAX_PER_CLIENT` sessions (a client signing in without end cannot grow the table).
"""

from __future__ import annotations

from agentserver.agents.store.sql.db import StoreEnv, Tx

#: Schema migration 15: the sessions, their expiry (the sweep) and a client's (its cap).
MIGRATION = """
CREATE TABLE ui_sessions (
    id_hash TEXT PRIMARY KEY,
    client TEXT NOT NULL,
    proof TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX ui_sessions_expiry ON ui_sessions (expires_at);
CREATE INDEX ui_sessions_client ON ui_sessions (client, created_at);
"""

#: Expired rows one sign-in deletes at most.
SWEEP = 100
#: Live sessions one client keeps; a sign-in past it ends the client's oldest.
MAX_PER_CLIENT = 64


def put_session(
    tx: Tx, env: StoreEnv, id_hash: str, client: str, proof: str, lifetime_s: float
) -> float:
    """Store a new session of ``client``; returns when it expires (store time)."""
    now = env.clock.now()
    tx.execute(
        "DELETE FROM ui_sessions WHERE id_hash IN "
        "(SELECT id_hash FROM ui_sessions WHERE expires_at <= ? LIMIT ?)",
        (now, SWEEP),
    )
    expires = now + lifetime_s
    tx.execute(
        "INSERT INTO ui_sessions (id_hash, client, proof, created_at, expires_at) "
        "VALUES (?, ?, ?, ?, ?)",
        (id_hash, client, proof, now, expires),
    )
    tx.execute(
        "DELETE FROM ui_sessions WHERE client = ? AND id_hash NOT IN "
        "(SELECT id_hash FROM ui_sessions WHERE client = ? "
        "ORDER BY created_at DESC, id_hash LIMIT ?)",
        (client, client, MAX_PER_CLIENT),
    )
    return expires


def get_session(tx: Tx, env: StoreEnv, id_hash: str) -> tuple[str, str] | None:
    """(client, proof) of a live session; None if there is none (never made, signed out,
    ended by the cap) or it has expired. Read only."""
    row = tx.one(
        "SELECT client, proof FROM ui_sessions WHERE id_hash = ? AND expires_at > ?",
        (id_hash, env.clock.now()),
    )
    return (str(row[0]), str(row[1])) if row else None


def delete_session(tx: Tx, env: StoreEnv, id_hash: str) -> bool:
    """Revoke a session (signing out); False if there was none. One statement."""
    tx.execute("DELETE FROM ui_sessions WHERE id_hash = ?", (id_hash,))
    return tx.rowcount > 0
