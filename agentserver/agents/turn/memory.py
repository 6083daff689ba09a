"""Memory across tasks (``<agent memory="client">``): which conversation a task continues.

With ``memory="client"`` each caller has one durable conversation with the agent: a named
client by its identity (every connection of ``alice`` shares hers, across restarts, and so
do her HTTP messages, by their bearer token's identity), any
other caller by the origin of its chain (an anonymous connection's endpoint, which lives as
long as the connection; the in-process console). A new Turn's context box starts with the
conversation's cards (kept bounded by compaction), then the new task. Two callers never
share one.
"""

from __future__ import annotations

from agentserver.agents.ports import ReplyRef

NONE = "none"
CLIENT = "client"
#: The reply reference's key naming the client an HTTP message was sent by (its bearer
#: token's identity): her conversation, though the answer goes to the message's endpoint.
SPEAKS_FOR = "speaks_for"


def conversation_key(reply_ref: ReplyRef) -> str | None:
    """The conversation of a task's reply reference (None: it names no caller)."""
    if not isinstance(reply_ref, dict):
        return None
    client = reply_ref.get("client") or reply_ref.get(SPEAKS_FOR)
    if isinstance(client, str) and client:
        return f"client:{client}"
    chain = reply_ref.get("chain")
    if isinstance(chain, list) and chain and isinstance(chain[0], str) and chain[0]:
        return f"origin:{chain[0]}"
    return None
