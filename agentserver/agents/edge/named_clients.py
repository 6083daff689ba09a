"""Durable replies to named clients: kept in the store until received, offered to a live
connection of the client's identity, offered again when that connection ends.

A reply to a named client (declared in boot.xml) is written to ``client_replies`` first
(one short transaction, which also marks the Turn's outbox row sent), then offered to one
live connection of that identity, whichever connection sent the task. It leaves the store
only once received:

- on a connection whose hello asked for acknowledgement (``ack="true"``), when the client
  acknowledges its ``reply-id`` with a core ``<ack>``;
- on any other connection, when it is written to the socket. There the receipt (the
  reply taken out of the store, one conditional ``DELETE``) commits before the reply is
  queued for writing, so a process killed or stalled before that commit has written
  nothing and the reply stays kept; none is taken after the server read the client's
  end of input (it stays kept for her next connection).

When a connection ends, the replies it was offered and did not receive are offered to
another live connection of the identity, else handed over at the next hello. The server
implements :class:`~agentserver.net.roles.ClientLink`; it calls :meth:`NamedClientReplies.attach` after a named
client's hello and :meth:`~NamedClientReplies.detach` when the connection ends.

Each reply reaches a connection once. Two paths offer replies in one process: the
:meth:`~NamedClientReplies.deliver` that follows keeping a reply, and the flush that
offers what the store holds (at a hello, when a connection ends, and on a shared store
each time any process keeps one: this process's own replies included). A flush's read can
show a reply as still kept after it was received here, while the store's acknowledgement
commits; and it can offer a reply before the ``deliver`` that follows keeping it. So the
replies received here are remembered (:class:`_Receipts`) for as long as a store read,
or a keep not yet delivered, that began before their receipt was committed is in flight:
neither path offers a reply that is with a connection or received. A reply is offered
again only when the connection it was offered to ended (or read its end of input) without
receiving it (docs/wire.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Iterable, Iterator

import trio
from lxml import etree

from agentserver.agents.doorbell import Doorbell
from agentserver.agents.store.base import ClientReplyStore
from agentserver.agents.store.sql import replies as sql_replies
from agentserver.core.xmlsafe import canonicalize, make_parser
from agentserver.net.roles import ClientLink  # declared in net, which implements it

log = logging.getLogger(__name__)

#: The attribute of ``<message>`` that carries a durable reply's id (docs/wire.md).
REPLY_ID_ATTR = "reply-id"

#: At most this many received replies are remembered once their receipt committed (a
#: store read in flight for longer than that many receipts take is the only way to reach
#: it; the oldest are then forgotten, and such a read may offer one of them again).
MAX_REMEMBERED = 16384


def with_reply_id(body: bytes, reply_id: int) -> bytes:
    """A stored reply envelope with its ``reply-id`` set."""
    root = etree.fromstring(body, make_parser())
    root.set(REPLY_ID_ATTR, str(reply_id))
    return canonicalize(root)


class _Receipts:
    """The replies received in this process, by (identity, reply id), remembered while
    their store acknowledgement commits and after it for as long as some store read or
    keep that began before it committed is in flight (:meth:`busy`): only those can still
    show the reply as kept. Bounded: the acknowledgements in flight, plus at most
    :data:`MAX_REMEMBERED` committed ones. Synchronous: nothing here awaits."""

    def __init__(self) -> None:
        #: Orders the starts of reads and keeps and the commits of receipts.
        self._tick = 0
        #: The start ticks of the reads and keeps in flight, in order (the oldest first:
        #: ticks only grow, and a dict keeps insertion order).
        self._busy: dict[int, None] = {}
        #: (identity, reply id) -> the tick its receipt committed (None: committing).
        self._held: dict[tuple[str, int], int | None] = {}
        #: (commit tick, key) of the committed ones, oldest first.
        self._committed: deque[tuple[int, tuple[str, int]]] = deque()

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._held

    def _next(self) -> int:
        self._tick += 1
        return self._tick

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around a store read of kept replies, or a keep and the offer that follows it:
        a receipt that commits meanwhile is remembered until it ends (also on cancel)."""
        tick = self._next()
        self._busy[tick] = None
        try:
            yield
        finally:
            del self._busy[tick]
            self._forget()

    def committing(self, identity: str, reply_ids: Iterable[int]) -> None:
        """These replies were received; their acknowledgement is being committed."""
        for rid in reply_ids:
            self._held[identity, rid] = None

    def committed(self, identity: str, reply_ids: Iterable[int]) -> None:
        """Their acknowledgement committed (or failed: then a later read may offer them
        again, as after a reconnect)."""
        tick = self._next()
        for rid in reply_ids:
            key = (identity, rid)
            if key in self._held and self._held[key] is None:
                self._held[key] = tick
                self._committed.append((tick, key))
        self._forget()

    def dropped(self, identity: str, reply_ids: Iterable[int]) -> None:
        """These replies were not received after all (their receipt did not commit, or
        they were kept again): they may be offered again."""
        for rid in reply_ids:
            if self._held.get((identity, rid), 0) is None:
                del self._held[identity, rid]

    def _forget(self) -> None:
        # A read or keep that began after a commit cannot see the reply as kept.
        oldest = next(iter(self._busy), math.inf)
        committed, held = self._committed, self._held
        while committed and (committed[0][0] < oldest or len(committed) > MAX_REMEMBERED):
            tick, key = committed.popleft()
            if held.get(key) == tick:  # not received again since (then it is newer)
                del held[key]


class NamedClientReplies:
    """The live connections of each named client and the replies offered to them."""

    def __init__(self, store: ClientReplyStore, named_clients: Iterable[str]) -> None:
        self.store = store
        self.named = frozenset(named_clients)
        self._links: dict[str, list[ClientLink]] = {}
        #: Endpoint name -> identity, for tasks sent on a second connection.
        self._identities: dict[str, str] = {}
        #: Reply id -> the link it was offered to, until received or that link ends.
        self._offered: dict[int, ClientLink] = {}
        #: What was received here, while a flush's read may still show it kept.
        self._receipts = _Receipts()

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
        """The client has these replies (acknowledged, or written while it was reading).
        One store transaction; until it commits, and while a read that began before may
        still show them kept, they are offered to no connection again (also on cancel)."""
        receipts = self._receipts
        receipts.committing(link.identity, reply_ids)
        for rid in reply_ids:
            if self._offered.get(rid) is link:
                del self._offered[rid]
        try:
            if reply_ids:
                await self.store.run1(sql_replies.ack_client_replies, link.identity, reply_ids)
        finally:
            receipts.committed(link.identity, reply_ids)

    def keeping(self) -> contextlib.AbstractContextManager[None]:
        """Hold around keeping a reply in the store and the :meth:`deliver` that follows:
        a flush may offer the reply in between, and see it received, and ``deliver`` must
        still know. Synchronous; it remembers at most what :class:`_Receipts` does."""
        return self._receipts.busy()

    async def deliver(self, identity: str, reply_id: int, body: bytes) -> bool:
        """Offer a reply just kept for ``identity`` (within :meth:`keeping`); False if no
        connection took it. A reply a flush already offered, or that was received, is not
        offered again (True: it is with a connection)."""
        if (identity, reply_id) in self._receipts:
            return True
        for link in self._candidates(identity):
            if self._is_with(reply_id, link):
                return True
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

    def _is_with(self, reply_id: int, link: ClientLink) -> bool:
        """The reply was offered to ``link``, or to a connection that may still confirm
        receipt: offering it to ``link`` would send it twice."""
        holder = self._offered.get(reply_id)
        return holder is link or (holder is not None and holder.input_open)

    async def _offer(self, link: ClientLink, reply_id: int, body: bytes) -> bool:
        if not link.acks:
            return await self._hand_over(link, reply_id, body)
        # From the caller's check to link.offer() nothing awaits: no other task can offer
        # the same reply in between.
        if not link.offer(reply_id, with_reply_id(body, reply_id)):
            return False
        self._offered[reply_id] = link
        return True

    async def _hand_over(self, link: ClientLink, reply_id: int, body: bytes) -> bool:
        """Offer a reply to a connection without acks, where written is received: its
        receipt (the reply taken out of the store) commits first, and only then is the
        reply queued for writing. Written first and taken after, a process killed in
        between (or whose store stalled there: a lock wait) left the reply kept, and her
        next connection was handed it again (the 30-minute soak, seed 4302,
        docs/reliability.md). Taken first, a kill before the receipt commits has written
        nothing, and one after it has at most one write in flight left to make (that
        reply is lost, as one written to a connection that drops is: docs/wire.md).

        True when the reply is with a connection or received (another process or path
        took it first: the take is one conditional ``DELETE``, so two never both write
        it); False when ``link`` cannot take it (then it is kept again, with its id).
        The take and the give-back are shielded: a cancel must not leave a reply taken
        and never written."""
        if not link.input_open:
            return False  # nothing durable is written after her end of input
        identity, receipts = link.identity, self._receipts
        receipts.committing(identity, [reply_id])  # neither path offers it meanwhile
        received = False
        try:
            with trio.CancelScope(shield=True):
                taken = await self.store.run1(sql_replies.take_client_reply, identity, reply_id)
                if taken is None:
                    received = True  # already: by another process, or another path here
                    return True
                # Nothing awaits from here to the offer: the link's state is as checked.
                received = link.offer(reply_id, body)
                if not received:
                    await self.store.run1(sql_replies.restore_client_reply, taken)
                return received
            # Not reached: nothing cancels a shielded scope from outside (the checker
            # cannot know its exit swallows nothing).
            return received
        finally:
            if received:
                receipts.committed(identity, [reply_id])
            else:
                receipts.dropped(identity, [reply_id])

    async def _flush(self, link: ClientLink) -> int:
        """Offer ``link`` every kept reply not already with a connection that may still
        confirm it nor received, oldest first; stop when the connection takes no more.
        A store read per 100 replies."""
        sent = after = 0
        receipts = self._receipts
        while True:
            # Busy until the page is offered: a reply received meanwhile (its receipt
            # committed after the read began) must still be skipped below.
            with receipts.busy():
                replies = await self.store.read(
                    sql_replies.pending_client_replies, link.identity, after
                )
                if not replies:
                    return sent
                for reply in replies:
                    after = reply.reply_id
                    if (link.identity, reply.reply_id) in receipts or self._is_with(
                        reply.reply_id, link
                    ):
                        continue
                    if not await self._offer(link, reply.reply_id, reply.payload):
                        return sent
                    sent += 1


async def forward_kept(bell: Doorbell, clients: NamedClientReplies) -> None:
    """On a shared store: each time ``bell`` rings (another process kept a reply for a
    named client), offer the connected clients what is kept for them. Until cancelled."""
    while True:
        await bell.wait()
        await clients.flush_all()
