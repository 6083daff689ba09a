"""Anonymous callers on a shared store: answered by the process holding their connection.

A task's reply reference names the process whose pump holds the caller's connection
(:data:`PROCESS_KEY`, set at intake). Whichever process ends the Turn writes the reply to
the outbox (``agent_replies``) as always; if the caller is connected elsewhere, it leaves
the row pending and rings :data:`~.notify.REPLIES_CHANNEL`, and the caller's process sends
it (:func:`pending_here`). A caller's connection dies with its process, so the pending
replies of a process that is gone are given up (:func:`hand_over`, and the reclaim of
:mod:`.leases`): their answer stays in the store as the Turn's deliverable.
"""

from __future__ import annotations

import json

from agentserver.agents.ports import PROCESS_KEY
from agentserver.agents.store.base import PendingReply
from agentserver.agents.store.sql.db import StoreEnv, Tx
from agentserver.agents.store.states import ReplyStatus

#: The database's clock (leases are judged by one clock for all processes).
_DB_NOW = "extract(epoch from clock_timestamp())::double precision"


def process_of(ref_json: str | None) -> str | None:
    """The process named by a stored reply reference of an anonymous caller, if any."""
    try:
        ref = json.loads(ref_json) if ref_json else None
    except ValueError:
        return None
    if not isinstance(ref, dict) or ref.get("client") is not None:
        # A named client's reply is kept for her wherever she connects: never pinned to
        # a process, never given up with one.
        return None
    found = ref.get(PROCESS_KEY)
    return found if isinstance(found, str) else None


def _like(owner: str) -> str:
    # The references are written with json.dumps' default separators (sql/inbox.py); the
    # LIKE only narrows the scan, process_of() decides.
    escaped = owner.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f'%"{PROCESS_KEY}": "{escaped}"%'


def pending_here(tx: Tx, env: StoreEnv, owner: str, limit: int) -> list[PendingReply]:
    """The pending replies whose caller is connected to process ``owner``, oldest first."""
    rows = tx.all(
        "SELECT agent_turn_id, agent_id, reply_ref, payload, failed, attempts "
        "FROM agent_replies WHERE status = ? AND reply_ref LIKE ? ESCAPE '\\' "
        "ORDER BY created_at LIMIT ?",
        (ReplyStatus.PENDING, _like(owner), limit),
    )
    return [
        PendingReply(r[0], r[1], r[2], bytes(r[3]), bool(r[4]), r[5])
        for r in rows
        if process_of(r[2]) == owner
    ]


def hand_over(tx: Tx, env: StoreEnv, agent_turn_id: str, process: str) -> bool:
    """Leave a reply pending for ``process`` if that process is alive (True; the caller
    sends the NOTIFY with this transaction); else give it up (its caller is gone)."""
    live = tx.one(
        f"SELECT 1 FROM agentserver_processes WHERE owner = ? AND lease_until >= {_DB_NOW}",
        (process,),
    )
    if live:
        return True
    give_up(tx, env, (process,))
    return False


def give_up(tx: Tx, env: StoreEnv, owners: tuple[str, ...]) -> int:
    """Mark the pending replies of the callers of dead processes ``owners``
    undeliverable; how many."""
    gone = 0
    for owner in owners:
        for reply in pending_here(tx, env, owner, 100_000):
            tx.execute(
                "UPDATE agent_replies SET status = ? WHERE agent_turn_id = ? AND status = ?",
                (ReplyStatus.UNDELIVERABLE, reply.agent_turn_id, ReplyStatus.PENDING),
            )
            gone += tx.rowcount
    return gone
