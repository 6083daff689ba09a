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
from agentserver.agents.store.base import caller_key
from agentserver.agents.store.rows import SPEAKS_FOR as SPEAKS_FOR

NONE = "none"
CLIENT = "client"


def conversation_key(reply_ref: ReplyRef) -> str | None:
    """The conversation of a task's reply reference (None: it names no caller): its
    caller's key (:func:`~agentserver.agents.store.base.caller_key`, which retention's
    ``keep-last`` counts an agent without memory by too)."""
    return caller_key(reply_ref)
