"""A trio client for the agentserver wire protocol (docs/wire.md).

::

    async with open_client("127.0.0.1", 7340) as client:
        reply = await client.request(Ping(text="hi"), to="echo", timeout=5)
        print(reply.payload_xml)

Several requests may be in flight on one connection; each reply is matched by its thread.
Replies nobody waits for (another ``send``, a broadcast's extra answers) go to a bounded
inbox read with :meth:`Client.receive`; when the inbox is full the oldest is dropped and
counted in :attr:`Client.dropped`.

A named client always asks for reply acknowledgement (docs/wire.md): a durable reply
carries an id (:attr:`Reply.id`), is acknowledged once :meth:`Client.request` or
:meth:`Client.receive` has handed it to the application, and a second copy of an id
already handed over is dropped (counted in :attr:`Client.duplicates`). Pass one
:class:`DeliveredIds` to every connection of a client to drop copies that come again
after a reconnect.
"""

from __future__ import annotations

import collections
import contextlib
import ssl
from collections.abc import AsyncIterator

import trio
from lxml import etree
from pydantic_xml import BaseXmlModel

from agentserver.core.envelope import MULTITASK, build_envelope
from agentserver.core.errors import HuhReason, sole_exception
from agentserver.core.framing import FrameDecoder, FramingError, encode_frame
from agentserver.core.handshake import MAX_ACK_IDS, ack_frame_body, hello_frame_body
from agentserver.core.threads import is_uuid4, new_thread_id
from agentserver.core.xmlsafe import DEFAULT_MAX_MESSAGE_BYTES, SafeParser
from agentserver.net.connect import PathLike, TlsSessions, connect_stream, tls_context
from agentserver.net.reply import (
    AuthenticationRefused,
    ClientError,
    ConnectionClosed,
    DeliveredIds,
    ProtocolError,
    Reply,
    RequestTimeout,
    TlsHandshakeError,
    approval_ack_status,
    approval_request,
    parse_reply,
    payload_element,
)
from agentserver.net.tlsstream import TlsStream
from agentserver.primitives.approval import ApprovalDecision

__all__ = [
    "ACK_FLUSH_TIMEOUT",
    "AuthenticationRefused",
    "Client",
    "ClientError",
    "ConnectionClosed",
    "DeliveredIds",
    "PathLike",
    "ProtocolError",
    "Reply",
    "RequestTimeout",
    "TlsHandshakeError",
    "TlsSessions",
    "approval_ack_status",
    "approval_request",
    "connect_stream",
    "open_client",
    "parse_reply",
    "payload_element",
    "tls_context",
]

#: How long closing a connection waits to send the acknowledgements still owed.
ACK_FLUSH_TIMEOUT = 1.0


class Client:
    """A connection to an agentserver. Create with :func:`open_client`."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        name: str = "client",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        inbox_size: int = 1024,
        delivered: DeliveredIds | None = None,
    ) -> None:
        self._stream = stream
        self._name = name
        self._max = max_message_bytes
        self._parser = SafeParser(max_message_bytes)
        self._send_lock = trio.Lock()
        self._waiters: dict[str, trio.MemorySendChannel[Reply]] = {}
        self._inbox: collections.deque[Reply] = collections.deque()
        self._inbox_size = inbox_size
        self._inbox_ready = trio.Event()
        self._closed = trio.Event()
        self._failure: ClientError | None = None
        #: Replies dropped because the inbox was full.
        self.dropped = 0
        #: Durable replies received again and dropped (already handed over, or queued).
        self.duplicates = 0
        self.delivered = delivered if delivered is not None else DeliveredIds()
        #: Ids of durable replies received and not yet handed to the application.
        self._queued_ids: set[int] = set()
        #: Ids handed over (or dropped as copies) and not yet acknowledged.
        self._to_ack: list[int] = []
        self._ack_wanted = trio.Event()
        #: The server sent its canned authentication refusal: the close that follows
        #: is that refusal, not a network fault.
        self._refused = False

    # -- sending -------------------------------------------------------------------------

    async def send(
        self,
        payload: BaseXmlModel | etree._Element | bytes | str,
        *,
        to: str | None = None,
        thread: str | None = None,
        multitask: str | None = None,
    ) -> str:
        """Send one payload to listener ``to`` (None: routed by its root tag). Returns the
        thread its replies will carry: ``thread`` if given (a uuid4 of this client's), else
        a fresh one. ``multitask``: for a task to an agent, what it does if an earlier task
        of its conversation is queued or running (``enqueue``, ``reject``, ``interrupt``,
        ``rollback``; docs/runs.md); None: the agent's own mode. The server checks it (a
        ``<huh>`` names the modes)."""
        if thread is None:
            thread = new_thread_id()
        element = payload_element(payload)
        envelope = build_envelope(self._name, to, thread, element)
        if multitask is not None:
            envelope.set(MULTITASK, multitask)
        body = etree.tostring(envelope)
        await self.send_raw(body)
        return thread

    async def decide_approval(
        self, agent: str, request_id: str, grant: bool, reason: str = ""
    ) -> str:
        """Answer an approval request (see :func:`approval_request`) addressed to ``agent``:
        grant or deny the tool call it holds. The agent acknowledges it with an
        ``<approval-ack status="applied|duplicate|unknown|not-yours">`` on the returned
        thread (:func:`approval_ack_status` reads it)."""
        return await self.send(
            ApprovalDecision(request=request_id, grant=grant, reason=reason), to=agent
        )

    async def send_raw(self, body: bytes) -> None:
        """Send one frame with ``body`` as is (tests, tools)."""
        if self._failure is not None:
            raise self._failure
        async with self._send_lock:
            try:
                await self._stream.send_all(encode_frame(body))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ConnectionClosed(str(exc) or "connection closed") from None

    async def request(
        self,
        payload: BaseXmlModel | etree._Element | bytes | str,
        *,
        to: str | None = None,
        # A per-request deadline is the point of request(); callers may still wrap it.
        timeout: float = 30.0,  # noqa: ASYNC109
        thread: str | None = None,
        multitask: str | None = None,
    ) -> Reply:
        """Send and wait for the first reply on the request's thread (which may be a
        ``<huh>`` or ``<SystemError>``: check :attr:`Reply.is_error`). ``multitask``: as
        :meth:`send`'s.
        Raises :class:`RequestTimeout` or :class:`ConnectionClosed`."""
        if thread is None:
            thread = new_thread_id()
        elif not is_uuid4(thread):
            raise ValueError("thread must be a uuid4 (the server replaces anything else)")
        send, receive = trio.open_memory_channel[Reply](1)
        if thread in self._waiters:
            raise ValueError(f"a request on thread {thread} is already waiting")
        self._waiters[thread] = send
        try:
            await self.send(payload, to=to, thread=thread, multitask=multitask)
            with trio.move_on_after(timeout):
                try:
                    reply = await receive.receive()
                except trio.EndOfChannel:
                    raise self._failure or ConnectionClosed("connection closed") from None
                self._handed(reply)
                return reply
            raise RequestTimeout(f"no reply on thread {thread} within {timeout:g} s")
        finally:
            self._waiters.pop(thread, None)
            try:
                late = receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                pass
            else:
                # Arrived as the request gave up: a durable reply is not dropped unseen
                # (unacknowledged, it would come again only on the next connection).
                if late.id is not None:
                    self._to_inbox(late)

    # -- receiving -----------------------------------------------------------------------

    async def receive(self) -> Reply:
        """The next reply no :meth:`request` was waiting for.
        Raises :class:`ConnectionClosed` once the connection is gone and the inbox empty."""
        while True:
            while not self._inbox:
                if self._closed.is_set():
                    raise self._failure or ConnectionClosed("connection closed")
                if self._inbox_ready.is_set():
                    # A fresh event only once the last one fired: several tasks may wait at
                    # once, and each must be woken by the next reply or by the close.
                    self._inbox_ready = trio.Event()
                await self._inbox_ready.wait()
            reply = self._inbox.popleft()
            if reply.id is not None and reply.id in self.delivered:
                # Handed over meanwhile by another connection sharing ``delivered``.
                self._queued_ids.discard(reply.id)
                self.duplicates += 1
                continue
            self._handed(reply)
            return reply

    # -- acknowledgement -----------------------------------------------------------------

    def _handed(self, reply: Reply) -> None:
        """``reply`` reached the application: remember and acknowledge its id."""
        if reply.id is None:
            return
        self._queued_ids.discard(reply.id)
        self.delivered.add(reply.id)
        self._acknowledge(reply.id)

    def _acknowledge(self, reply_id: int) -> None:
        self._to_ack.append(reply_id)
        self._ack_wanted.set()

    async def _ack_loop(self) -> None:
        """Send the acknowledgements, all that are owed in one frame."""
        while True:
            await self._ack_wanted.wait()
            self._ack_wanted = trio.Event()
            await self.flush_acks()

    def start(self, nursery: trio.Nursery, *, acks: bool) -> None:
        """Start the connection's background tasks in ``nursery``: the reader, and with
        ``acks`` (the hello asked for acknowledgement) the acknowledgement sender. Both
        run until cancelled; neither raises."""
        if acks:
            nursery.start_soon(self._ack_loop)
        nursery.start_soon(self._read_loop)

    async def finish_acks(self) -> None:
        """Let an acknowledgement being sent finish, then send those still owed (leaving
        :func:`open_client` does it, so what the application got does not come again)."""
        async with self._send_lock:
            pass
        await self.flush_acks()

    async def flush_acks(self) -> None:
        """Send the acknowledgements owed now (the connection's close does it too)."""
        while self._to_ack and self._failure is None:
            ids, self._to_ack = self._to_ack[:MAX_ACK_IDS], self._to_ack[MAX_ACK_IDS:]
            try:
                await self.send_raw(ack_frame_body(self._name, ids))
            except ConnectionClosed:
                return

    async def receive_on(self, thread: str) -> Reply:
        """The next reply on ``thread`` no :meth:`request` was waiting for; replies on
        other threads stay in the inbox (not handed over, so not acknowledged: a durable
        one is sent again on the next connection if nobody reads it here).
        Raises :class:`ConnectionClosed` once the connection is gone and none is left."""
        while True:
            for reply in self._inbox:
                if reply.thread == thread:
                    self._inbox.remove(reply)
                    if reply.id is not None and reply.id in self.delivered:
                        self._queued_ids.discard(reply.id)
                        self.duplicates += 1
                        break  # look again: the deque changed
                    self._handed(reply)
                    return reply
            else:
                if self._closed.is_set():
                    raise self._failure or ConnectionClosed("connection closed")
                if self._inbox_ready.is_set():
                    self._inbox_ready = trio.Event()
                await self._inbox_ready.wait()

    def __aiter__(self) -> AsyncIterator[Reply]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Reply]:
        while True:
            try:
                yield await self.receive()
            except ConnectionClosed:
                return

    async def _read_loop(self) -> None:
        decoder = FrameDecoder(self._max)
        try:
            while True:
                try:
                    data = await self._stream.receive_some(64 * 1024)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    if self._refused:
                        self._fail(
                            AuthenticationRefused(
                                "the server requires authentication and refused this "
                                "connection's (a client name and its token)"
                            )
                        )
                    else:
                        self._fail(ConnectionClosed("the server closed the connection"))
                    return
                decoder.feed(data)
                while (frame := decoder.next_frame()) is not None:
                    self._dispatch(parse_reply(frame, self._parser))
        except (FramingError, ProtocolError) as exc:
            self._fail(ProtocolError(str(exc)))

    def _dispatch(self, reply: Reply) -> None:
        if reply.is_huh and reply.error_text == HuhReason.UNAUTHENTICATED.value:
            # The server's one refusal before it closes (net/hello.py): say so at the close.
            self._refused = True
        if reply.id is not None:
            if reply.id in self.delivered:
                # Sent again: our acknowledgement was lost (e.g. the server restarted).
                self.duplicates += 1
                self._acknowledge(reply.id)
                return
            if reply.id in self._queued_ids:
                self.duplicates += 1
                return
            self._queued_ids.add(reply.id)
        waiter = self._waiters.pop(reply.thread, None)
        if waiter is not None:
            waiter.send_nowait(reply)  # capacity 1, used once
            return
        self._to_inbox(reply)

    def _to_inbox(self, reply: Reply) -> None:
        if len(self._inbox) >= self._inbox_size:
            lost = self._inbox.popleft()
            self.dropped += 1
            if lost.id is not None:
                # Not acknowledged: the server sends it again on the next connection.
                self._queued_ids.discard(lost.id)
        self._inbox.append(reply)
        self._inbox_ready.set()

    def _fail(self, error: ClientError) -> None:
        if self._failure is None:
            self._failure = error
        self._closed.set()
        self._inbox_ready.set()
        for waiter in self._waiters.values():
            waiter.close()
        self._waiters.clear()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        """Return once the connection is gone."""
        await self._closed.wait()


@contextlib.asynccontextmanager
async def open_client(
    host: str,
    port: int,
    *,
    client: str | None = None,
    token: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    connect_timeout: float = 10.0,
    tls: bool | ssl.SSLContext = False,
    ca: PathLike | None = None,
    cert: PathLike | None = None,
    key: PathLike | None = None,
    server_hostname: str | None = None,
    delivered: DeliveredIds | None = None,
    sessions: TlsSessions | None = None,
) -> AsyncIterator[Client]:
    """Connect; with ``client`` and ``token``, send the hello first, asking for reply
    acknowledgement. Leaving the block sends the acknowledgements still owed (for up to
    ``ACK_FLUSH_TIMEOUT`` s) and closes the connection. ``delivered``: see
    :class:`DeliveredIds`.

    TLS: ``tls=True`` (or any of ``ca``/``cert``/``key``) verifies the server's
    certificate against ``ca`` (default: the system's CAs) and its name against
    ``server_hostname`` (default: ``host``); ``cert``/``key`` present a client
    certificate (mutual TLS; then ``client`` needs no token: the hello carries an empty
    one and only asks for acknowledgement). A ready ``ssl.SSLContext`` may be passed as
    ``tls`` instead. A failed handshake raises :class:`TlsHandshakeError`.

    ``sessions``: a :class:`TlsSessions` given to every connection of this client, so a
    reconnection resumes the TLS session of the last one (no certificates exchanged)."""
    context = tls_context(tls, ca=ca, cert=cert, key=key, sessions=sessions)
    by_certificate = context is not None and (cert is not None or isinstance(tls, ssl.SSLContext))
    if client is not None and token is None and not by_certificate:
        raise ValueError("a client name needs a token (or a client certificate)")
    with trio.fail_after(connect_timeout):
        stream = await connect_stream(host, port, context, server_hostname, sessions=sessions)
    try:
        async with stream, trio.open_nursery() as nursery:
            conn = Client(
                stream,
                name=client or "client",
                max_message_bytes=max_message_bytes,
                delivered=delivered,
            )
            if client is not None:
                await conn.send_raw(hello_frame_body(client, token or "", ack=True))
            conn.start(nursery, acks=client is not None)
            try:
                yield conn
            finally:
                # What the application got must not come again: acknowledge it first.
                with trio.move_on_after(ACK_FLUSH_TIMEOUT) as flush:
                    flush.shield = True
                    await conn.finish_acks()
                nursery.cancel_scope.cancel()
                if sessions is not None and isinstance(stream, TlsStream):
                    assert context is not None
                    sessions.remember(host, port, context, stream)
    except BaseExceptionGroup as group:
        # The reader task never raises, so a group holds the caller's own exception:
        # hand it back as raised (callers catch RequestTimeout, not a group of one).
        raise sole_exception(group) from None
