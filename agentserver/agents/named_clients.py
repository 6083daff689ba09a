"""Durable replies to named clients: kept in the store until received, offered to a live
connection of the client's identity, offered again when that connection ends.

A reply to a named client (declared in boot.xml) is written to ``client_replies`` first
(one short transaction, which also marks the Turn's outbox row sent), then offered to one
live connection of that identity, whichever connection sent the task. It leaves the store
only once received:

- on a connection whose hello asked for acknowledgement (``ack="true"``), when the client
  acknowledges its ``reply-id`` with a core ``<ack>``;
- on any other connection (today's semantics), when it is written to the socket while the
  client's input is still open; one written after the client's end of input stays kept.

When a connection ends, the replies it was offered and did not receive are offered to
another live connection of the identity, else handed over at the next hello. The server
implements :class:`~agentserver.net.roles.ClientLink`; it calls :meth:`NamedClientReplies.attach` after a named
client's hello and :meth:`~NamedClientReplies.detach` when the connection ends.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from lxml import etree

from agentserver.agents.store import AgentStore
from agentserver.core.xmlsafe import canonicalize, make_parser
from agentserver.net.roles import ClientLink  # declared in net, which implements it

log = logging.getLogger(__name__)

#: The attribute of ``<message>`` that carries a durable reply's id (docs/wire.md).
REPLY_ID_ATTR = "reply-id"


def with_reply_id(body: bytes, reply_id: int) -> bytes:
    """A stored reply envelope with its ``reply-id`` set."""
    root = etree.fromstring(body, make_parser())
    root.set(REPLY_ID_ATTR, str(reply_id))
    return canonicalize(root)


class NamedClientReplies:
    """The live connections of each named client and the replies offered to them."""

    def __init__(self, store: AgentStore, named_clients: Iterable[str]) -> None:
        self.store = store
        self.named = frozenset(named_clients)
        self._links: dict[str, list[ClientLink]] = {}
        #: Endpoint name -> identity, for tasks sent on a second connection.
        self._identities: dict[str, str] = {}
        #: Reply id -> the link it was offered to, until received or that link ends.
        self._offered: dict[int, ClientLink] = {}

    def identity_of(self, endpoint_name: str) -> str | None:
        """The named client behind an endpoint, or None for an anonymous one."""
        identity = self._identities.get(endpoint_name)
        if identity is not None:
            return identity
        return endpoint_name if endpoint_name in self.named else None

    async def attach(self, link: ClientLink) -> None:
        """A named client said hello: hand it what is kept for its identity."""
        if link.identity not in self.named:
            return
        self._links.setdefault(link.identity, []).append(link)
        self._identities[link.endpoint_name] = link.identity
        await self._flush(link)

    async def detach(self, link: ClientLink) -> None:
        """A connection ended: what it did not receive goes to another live one, if any."""
        links = self._links.get(link.identity)
        if links is None or link not in links:
            return
        links.remove(link)
        if not links:
            del self._links[link.identity]
        if self._identities.get(link.endpoint_name) == link.identity:
            del self._identities[link.endpoint_name]
        lost = [rid for rid, holder in self._offered.items() if holder is link]
        for rid in lost:
            del self._offered[rid]
        for target in self._candidates(link.identity):
            await self._flush(target)
            break

    async def received(self, link: ClientLink, reply_ids: list[int]) -> None:
        """The client has these replies (acknowledged, or written while it was reading)."""
        for rid in reply_ids:
            if self._offered.get(rid) is link:
                del self._offered[rid]
        await self.store.ack_client_replies(link.identity, reply_ids)

    async def deliver(self, identity: str, reply_id: int, body: bytes) -> bool:
        """Offer a reply just kept for ``identity``; False if no connection took it."""
        for link in self._candidates(identity):
            if await self._offer(link, reply_id, body):
                return True
        return False

    async def flush_all(self) -> int:
        """Offer every connected identity what is kept for it (replies another server
        process recorded, on a shared store); how many were offered."""
        sent = 0
        for identity in list(self._links):
            for link in self._candidates(identity):
                sent += await self._flush(link)
                break
        return sent

    def _candidates(self, identity: str) -> list[ClientLink]:
        """The identity's connections, best first: the newest that can still confirm
        receipt, then the others (a reply written to those stays kept)."""
        links = self._links.get(identity, [])
        return [lk for lk in reversed(links) if lk.input_open] + [
            lk for lk in reversed(links) if not lk.input_open
        ]

    async def _offer(self, link: ClientLink, reply_id: int, body: bytes) -> bool:
        data = with_reply_id(body, reply_id) if link.acks else body
        if not link.offer(reply_id, data):
            return False
        self._offered[reply_id] = link
        written = link.take_written()
        if written:
            await self.received(link, written)
        return True

    async def _flush(self, link: ClientLink) -> int:
        """Offer ``link`` every kept reply not already with a connection that may still
        confirm it, oldest first; stop when the connection takes no more."""
        sent = after = 0
        while True:
            replies = await self.store.pending_client_replies(link.identity, after)
            if not replies:
                return sent
            for reply in replies:
                after = reply.reply_id
                holder = self._offered.get(reply.reply_id)
                if holder is link or (holder is not None and holder.input_open):
                    continue
                if not await self._offer(link, reply.reply_id, reply.payload):
                    return sent
                sent += 1


async def forward_kept(bell, clients: NamedClientReplies) -> None:
    """On a shared store: each time ``bell`` rings (another process kept a reply for a
    named client), offer the connected clients what is kept for them. Until cancelled."""
    while True:
        await bell.wait()
        await clients.flush_all()
