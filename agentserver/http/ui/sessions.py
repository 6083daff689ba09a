"""The web console's sign-in sessions (issue 44): signing in at ``/ui`` exchanges the
client's token for a session id (random, 256 bits), which is all the browser's cookie
holds. The server keeps, per session, a hash of its id, the client it was made for and a
proof bound to that client's token (:meth:`HttpAuth.session_proof`); never the token, and
never the id itself. A session resolves to the same :class:`Identity` the client's
bearer token gets, so it sees exactly what that client may see.

Where the rows live is the :class:`SessionTable` the composition root passes in: the
agents' store (``agents/store/sql/ui_sessions.py``: every process of a PostgreSQL store
and a restarted server know the session), or, for a topology without agents (no store),
:class:`MemorySessionTable`: this process only, forgotten at a restart.

A session ends at its expiry (``<http ui-session-ttl>``, default 12 hours after the
sign-in: a fixed lifetime, not renewed by use), at sign-out (the row is deleted: the old
cookie no longer works on any process), or when its client's token changes or the client
is removed from boot.xml (the proof no longer matches).
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Protocol

from agentserver.agents.clock import Clock
from agentserver.agents.store.base import StoreCalls
from agentserver.agents.store.sql import ui_sessions
from agentserver.core.handshake import Identity
from agentserver.http.auth import HttpAuth

#: Seconds a sign-in lasts by default (``<http ui-session-ttl>``).
DEFAULT_LIFETIME = 12 * 3600.0
#: Characters of a session id: ``secrets.token_urlsafe(32)`` gives 43.
ID_BYTES = 32
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


class SessionTable(Protocol):
    """Where sessions are kept: the agents' store (:class:`StoreSessionTable`) or this
    process's memory (:class:`MemorySessionTable`). Expiry is the table's clock's (store
    time)."""

    async def ui_session_put(
        self, id_hash: str, client: str, proof: str, lifetime_s: float
    ) -> float: ...

    async def ui_session_get(self, id_hash: str) -> tuple[str, str] | None: ...

    async def ui_session_delete(self, id_hash: str) -> bool: ...


class StoreSessionTable:
    """The sessions in the agents' store (:mod:`agentserver.agents.store.sql.ui_sessions`):
    every process of a PostgreSQL store, and restarts, know them."""

    def __init__(self, store: StoreCalls) -> None:
        self.store = store

    async def ui_session_put(
        self, id_hash: str, client: str, proof: str, lifetime_s: float
    ) -> float:
        return await self.store.run(ui_sessions.put_session, id_hash, client, proof, lifetime_s)

    async def ui_session_get(self, id_hash: str) -> tuple[str, str] | None:
        return await self.store.read(ui_sessions.get_session, id_hash)

    async def ui_session_delete(self, id_hash: str) -> bool:
        return await self.store.run1(ui_sessions.delete_session, id_hash)


class MemorySessionTable:
    """Sessions in this process's memory, for a topology with ``<http>`` and no agents
    (hence no store): lost at a restart, unknown to another process. Bounded: at most
    ``max_sessions`` (a sign-in past it drops the expired ones, then the oldest)."""

    def __init__(self, clock: Clock, max_sessions: int = 4096) -> None:
        self.clock = clock
        self.max_sessions = max_sessions
        #: id hash → (client, proof, expires at); in sign-in order.
        self.rows: dict[str, tuple[str, str, float]] = {}

    async def ui_session_put(
        self, id_hash: str, client: str, proof: str, lifetime_s: float
    ) -> float:
        now = self.clock.now()
        if len(self.rows) >= self.max_sessions:
            for key in [k for k, row in self.rows.items() if row[2] <= now]:
                del self.rows[key]
        while len(self.rows) >= self.max_sessions:
            del self.rows[next(iter(self.rows))]
        expires = now + lifetime_s
        self.rows[id_hash] = (client, proof, expires)
        return expires

    async def ui_session_get(self, id_hash: str) -> tuple[str, str] | None:
        row = self.rows.get(id_hash)
        if row is None or row[2] <= self.clock.now():
            return None
        return row[0], row[1]

    async def ui_session_delete(self, id_hash: str) -> bool:
        return self.rows.pop(id_hash, None) is not None


def id_hash(session: str) -> str:
    """What the table keys a session by: reading the table gives no cookie's value."""
    return hashlib.sha256(session.encode("utf-8")).hexdigest()


def well_formed(session: str) -> bool:
    """Whether ``session`` could be an id this class issued (others are not looked up)."""
    return 40 <= len(session) <= 64 and set(session) <= _ID_CHARS


class UiSessions:
    """Makes, resolves and revokes the console's sessions of one app."""

    def __init__(
        self, table: SessionTable, auth: HttpAuth, lifetime_s: float = DEFAULT_LIFETIME
    ) -> None:
        self.table = table
        self.auth = auth
        self.lifetime_s = lifetime_s

    async def create(self, identity: Identity) -> str:
        """A new session for ``identity`` (a named client, just authenticated by its
        token); its id, for the browser's cookie only."""
        if identity.name is None:
            raise ValueError("anonymous callers sign in to nothing")
        session = secrets.token_urlsafe(ID_BYTES)
        proof = self.auth.session_proof(identity.name, session)
        if proof is None:
            raise ValueError(f"client {identity.name} has no token")
        await self.table.ui_session_put(id_hash(session), identity.name, proof, self.lifetime_s)
        return session

    async def resolve(self, session: str) -> Identity | None:
        """The identity ``session`` stands for; None if it is unknown, expired, revoked,
        or its client's token changed since."""
        if not well_formed(session):
            return None
        found = await self.table.ui_session_get(id_hash(session))
        if found is None:
            return None
        client, proof = found
        return self.auth.session_identity(client, session, proof)

    async def revoke(self, session: str) -> bool:
        """End ``session`` everywhere (signing out); False if it was not live."""
        if not well_formed(session):
            return False
        return await self.table.ui_session_delete(id_hash(session))
