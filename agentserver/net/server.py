"""The TCP server: framed XML envelopes in, replies pushed out as they are produced.

One task pair per connection: a reader that decodes frames (:mod:`agentserver.core.framing`)
and injects them into the pump through the connection's endpoint, and a writer that takes
every reply that is ready from the endpoint and writes them with one ``send_all``. On a
plaintext connection most replies skip the writer: the reader reads the socket itself
(yielding first, so the next request is usually there: no failed read, no epoll
registration), collects the replies produced while it injects one read's requests and
writes them with one non-blocking ``send`` (see ``_Connection._start_batch``); a reply
produced by another task, for a client with one request at a time, is sent at once by
that task (see ``_Connection._write_now``). Either saves the writer's wake-up and write.

Outcomes (also in docs/wire.md):

- A frame declaring more than ``max_message_bytes`` gets one ``<huh>`` (too large) and the
  connection is closed, before the body is read.
- A frame must arrive completely within ``read_timeout`` seconds of its first byte, else
  the connection is closed (nothing is sent: the peer is not reading a reply either).
- With clients declared, the first frame must be a valid hello (see
  :mod:`agentserver.core.handshake`) within ``hello_timeout``; anything else gets one canned
  ``<huh>`` and the connection is closed. Nothing reaches the pump before that.
- At most ``max_connections`` connections; one more gets a ``<SystemError>`` (routing,
  retry allowed) and is closed.
- At most ``max_inflight`` requests, of at most ``max_inflight_bytes`` bytes in all, per
  connection wait for replies; past that the server stops reading from that connection
  (TCP pushes back). A request stops counting when a reply is written, when it ends
  without one (its handler returned ``None``, or the last hop of its chain ended), or
  after ``inflight_ttl`` seconds. One request is always admitted when none waits.
- Replies wait in a buffer of ``outgoing_buffer`` messages and ``outgoing_buffer_bytes``
  bytes; a client that stops reading is disconnected when it overflows, or when one write
  blocks for ``write_timeout`` seconds.
- On end of input from the client, replies still owed are written for up to
  ``read_timeout`` seconds, then the connection is closed.
- With TLS (boot.xml ``<tls>``, docs/security.md) every connection is wrapped in a
  ``trio.SSLStream`` whose handshake must end within ``read_timeout`` (a plaintext client
  fails it and is closed); replies then always go through the writer (a direct write
  would bypass the encryption). With mutual TLS the client certificate names the client
  and no hello is read.
- Failed hellos are throttled per source address (:mod:`agentserver.core.throttle`).
- A named client's connection is a :class:`~agentserver.agents.named_clients.ClientLink`
  for its durable replies (agents' answers): with ``<hello ack="true">`` they carry a
  ``reply-id`` and the client's core ``<ack>`` frames are consumed here (never reach the
  pump, never count as requests); without, a durable reply counts as received once written
  while the client's input is open.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import os
import socket
import ssl
from typing import Protocol

import trio
from lxml import etree

from agentserver.config.topology import Limits
from agentserver.console.operator import Operator
from agentserver.core.envelope import encode
from agentserver.core.errors import (
    ConfigurationError,
    DeliveryRefused,
    EndpointClosed,
    HuhReason,
    PumpClosed,
    SystemErrorCode,
)
from agentserver.core.framing import FrameDecoder, FrameTooLarge, encode_frame, encode_frames
from agentserver.core.handshake import (
    MAX_HELLO_BYTES,
    AckReader,
    HelloGate,
    Identity,
    Unauthenticated,
)
from agentserver.core.threads import new_thread_id
from agentserver.core.throttle import HelloThrottle
from agentserver.net.tls import CertificateRule, match_certificate
from agentserver.primitives.core import huh, primitive_for
from agentserver.pump.endpoint import Endpoint
from agentserver.pump.pump import SYSTEM, Pump
from agentserver.remote.hub import RunnerHub, RunnerLink

log = logging.getLogger("agentserver.server")

RECEIVE_SIZE = 64 * 1024
#: Replies written with one ``send_all`` at most (bounds one write's size and latency).
MAX_BATCH = 256
#: The reader writes the replies it collects once they reach this many bytes, if not
#: before (bounds the memory they hold outside the endpoint's buffer).
MAX_BATCH_BYTES = 256 * 1024
#: Scheduler rounds a writer waits at most for more of the replies it is owed.
_MAX_GATHER_ROUNDS = 4
#: How long a refused connection gets to take its one refusal.
_REFUSAL_WRITE_TIMEOUT = 1.0
#: How long a connection named by its client certificate is given to send an (optional)
#: hello asking for acknowledgement before it is served without: the client library sends
#: it at once, so only a client that sends nothing waits this long for its kept replies.
CERT_HELLO_WAIT = 1.0


async def _send_refusal(stream: trio.abc.Stream, payload: etree._Element) -> None:
    """Send a connection's one refusal, giving up after a short while or if it is gone."""
    frame = encode_frame(encode(SYSTEM, None, new_thread_id(), payload))
    with trio.move_on_after(_REFUSAL_WRITE_TIMEOUT):
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(frame)


#: Queued to wake a writer that has a carry to send (see _Connection._write_now). Not a
#: reply: a reply is an envelope, never empty.
_WAKE = b""
_NO_SIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


def _direct_handle(stream: trio.abc.Stream) -> socket.socket | None:
    """A plain non-blocking socket object on a duplicate of the stream's descriptor, for
    synchronous writes; None where that is not possible, and always for TLS (bytes
    written on the socket itself would bypass the encryption)."""
    if not isinstance(stream, trio.SocketStream):
        return None
    try:
        direct = socket.socket(fileno=os.dup(stream.socket.fileno()))
        direct.setblocking(False)
    except OSError:
        return None
    return direct


async def _receive_direct(direct: socket.socket, readable: trio.socket.SocketType) -> bytes:
    """What ``direct`` (see :func:`_direct_handle`) has to read: b"" at end of input;
    OSError if the connection broke. Yields first, then reads without waiting when it
    can: by then the client has usually sent its next request (a client waiting for its
    reply sends the next one at once), so the read neither fails nor waits on the I/O
    manager (trio's ``receive_some`` reads at once, fails, registers the socket with
    epoll, waits a round, reads, and yields again). A checkpoint: cancellable."""
    await trio.lowlevel.checkpoint()
    while True:
        try:
            return direct.recv(RECEIVE_SIZE)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(readable)


def _peer_host(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except (OSError, IndexError):
        return "?"


class NamedClients(Protocol):
    """Where a named client's connections meet its durable replies
    (:class:`agentserver.agents.named_clients.NamedClientReplies`)."""

    async def attach(self, link: _Connection) -> None: ...
    async def detach(self, link: _Connection) -> None: ...
    async def received(self, link: _Connection, reply_ids: list[int]) -> None: ...


def format_address(sockname: tuple) -> str:
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Server:
    """Serves one pump on TCP. ``serve`` runs until :meth:`stop_accepting` and until every
    connection has ended (connections end when the pump closes their endpoints)."""

    def __init__(
        self,
        pump: Pump,
        limits: Limits,
        gate: HelloGate,
        *,
        ssl_context: ssl.SSLContext | None = None,
        cert_rules: tuple[CertificateRule, ...] = (),
        allowed: dict[str, frozenset[str] | None] | None = None,
        throttle: HelloThrottle | None = None,
    ) -> None:
        self.pump = pump
        self.limits = limits
        self.gate = gate
        #: TLS on every connection when set (a client certificate is required if the
        #: context asks for one; ``cert_rules`` then say whom it proves).
        self.ssl_context = ssl_context
        self.cert_rules = cert_rules
        #: The listeners each client named by a certificate may address (None: all).
        self.allowed = allowed or {}
        self.throttle = throttle if throttle is not None else HelloThrottle()
        #: Source addresses with a slowed hello waiting (one each; more are refused).
        self._throttled: set[str] = set()
        self._handshaking = 0
        self._accept_scope = trio.CancelScope()
        self._connections: set[_Connection] = set()
        #: The named clients' durable replies (set when agents run): each named
        #: connection is attached to it after the hello and detached when it ends.
        self.named_clients: NamedClients | None = None
        #: Reads the ``<ack>`` frames of connections whose hello asked for acks.
        self.acks = AckReader(limits.max_message_bytes)
        #: The remote listeners and their runners (set when the topology has any): a
        #: runner client's frames go to it, never to the pump (agentserver.remote.hub).
        self.runners: RunnerHub | None = None
        #: Carries out operator commands (stop/cancel; agentserver.console.operator) for the
        #: clients in ``operators`` (and anonymous connections if ``anonymous_operators``).
        self.operator: Operator | None = None
        self.operators: frozenset[str] = frozenset()
        self.anonymous_operators = False
        self.counters = {
            "accepted": 0,
            "refused_busy": 0,
            "unauthenticated": 0,
            "oversize": 0,
            # Replies written and the writes they took (their ratio is the batching).
            "replies": 0,
            "writes": 0,
            # Direct writes the socket took only part of (the writer sent the rest).
            "carried": 0,
            # Replies that went through the endpoint's buffer to the writer (the others
            # were written by the task that produced them, or by the reader together
            # with the other replies to one read).
            "queued": 0,
            # TLS handshakes that failed or stalled (a plaintext client, a bad certificate).
            "tls_failed": 0,
            # Hellos checked late, or refused unchecked, because their address kept failing.
            "throttled": 0,
        }

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[list[tuple]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        addresses = [lst.socket.getsockname() for lst in listeners]
        async with trio.open_nursery() as connections:
            with self._accept_scope:
                task_status.started(addresses)
                await trio.serve_listeners(self._on_stream, listeners, handler_nursery=connections)
            for lst in listeners:
                await lst.aclose()
        log.info("server stopped: %s", self.counters)

    def stop_accepting(self) -> None:
        """Close the listening sockets and stop reading from every connection. Replies
        still owed are written until the pump closes the endpoints."""
        self._accept_scope.cancel()
        for conn in list(self._connections):
            conn.stop_reading()

    async def _on_stream(self, stream: trio.SocketStream) -> None:
        async with stream:
            address = _peer_host(stream)
            busy = len(self._connections) + self._handshaking >= self.limits.max_connections
            wire: trio.abc.Stream = stream
            if self.ssl_context is not None:
                # A busy server still completes a (short) handshake so the refusal can be
                # read; a connection slot is held from the handshake on.
                timeout = _REFUSAL_WRITE_TIMEOUT if busy else self.limits.read_timeout
                self._handshaking += 0 if busy else 1
                try:
                    wire = await self._tls_handshake(stream, address, timeout)
                finally:
                    self._handshaking -= 0 if busy else 1
                if wire is None:
                    return
            try:
                await self._serve(wire, address, busy)
            finally:
                if wire is not stream:
                    with trio.move_on_after(_REFUSAL_WRITE_TIMEOUT):
                        # close_notify; the socket is closed whatever happens.
                        await wire.aclose()

    async def _tls_handshake(
        self, stream: trio.SocketStream, address: str, seconds: float
    ) -> trio.SSLStream | None:
        """The TLS stream once its handshake is done, within ``seconds`` (a stalled one must
        not hold a connection slot); None if it failed (logged, counted)."""
        assert self.ssl_context is not None
        wrapped = trio.SSLStream(stream, self.ssl_context, server_side=True)
        reason = "stalled"
        with trio.move_on_after(seconds):
            try:
                await wrapped.do_handshake()
                return wrapped
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                cause = exc.__cause__
                reason = getattr(cause, "reason", None) or str(cause or exc) or "closed"
        self.counters["tls_failed"] += 1
        log.info("TLS handshake from %s failed: %s", address, reason)
        return None

    async def _serve(self, stream: trio.abc.Stream, address: str, busy: bool) -> None:
        identity: Identity | None = None
        mutual = self.ssl_context is not None and self.ssl_context.verify_mode == ssl.CERT_REQUIRED
        if isinstance(stream, trio.SSLStream) and mutual:
            # The certificate was verified against the client CA: now, whom does it name?
            name = match_certificate(
                self.cert_rules, stream.getpeercert(), stream.getpeercert(binary_form=True)
            )
            if name is None:
                self.counters["unauthenticated"] += 1
                log.info("connection from %s refused: its certificate names no client", address)
                await _send_refusal(stream, huh(HuhReason.UNAUTHENTICATED))
                return
            identity = Identity(name, self.allowed.get(name))
        if busy or len(self._connections) >= self.limits.max_connections:
            self.counters["refused_busy"] += 1
            refusal = DeliveryRefused(SystemErrorCode.ROUTING, retry_allowed=True)
            await _send_refusal(stream, primitive_for(refusal))
            return
        self.counters["accepted"] += 1
        conn = _Connection(self, stream, address, identity)
        self._connections.add(conn)
        try:
            await conn.run()
        except Exception:
            # A bug in one connection's handling must not take the server down.
            log.exception("connection failed; closing it")
        finally:
            self._connections.discard(conn)


class _Connection:
    """One client connection (see the module docstring for the rules it applies)."""

    def __init__(
        self,
        server: Server,
        stream: trio.abc.Stream,
        address: str = "?",
        identity: Identity | None = None,
    ) -> None:
        self.server = server
        self.stream = stream
        #: The peer's host, for hello throttling.
        self.address = address
        #: Set when the TLS client certificate already named the client (its hello, if
        #: any, only asks for acknowledgement).
        self.cert_identity = identity
        self.limits = server.limits
        self.endpoint: Endpoint | None = None
        self._reading = trio.CancelScope()
        # (deadline, size) of each request waiting for a reply, oldest first; bounded by
        # max_inflight, and by max_inflight_bytes on _inflight_bytes, their sum of sizes.
        self._inflight: collections.deque[tuple[float, int]] = collections.deque()
        self._inflight_bytes = 0
        self._room = trio.Event()
        self._early = b""
        #: A second handle on the socket, for the writes that cannot block (_write_now).
        self._direct: socket.socket | None = None
        #: True while the writer waits with nothing queued or half-written.
        self._writer_idle = False
        #: True while the client sends several requests per read: its replies are
        #: batched by the writer rather than written one by one.
        self._pipelining = False
        #: What the socket did not take of a direct write; the writer sends it first.
        self._carry = b""
        #: The replies produced while the reader injects one read's requests, written
        #: together when it is done with them (see _read_loop); None when not collecting.
        self._batch: list[bytes] | None = None
        self._batch_bytes = 0
        # As a ClientLink (named clients only; see agentserver.agents.named_clients):
        self.identity = ""
        self.endpoint_name = ""
        self.acks = False
        self.input_open = True
        #: Durable replies queued on a no-ack link, by id() of their bytes: (bytes, id).
        #: Empty on every other connection, so the write paths only test it.
        self._durable: dict[int, tuple[bytes, int]] = {}
        #: Ids of those written while the client's input was open (counted received).
        self._written: list[int] = []
        #: Set on a runner client's connection: its frames are job replies.
        self.runner: RunnerLink | None = None
        #: May send operator commands (stop, cancel).
        self.is_operator = False

    def stop_reading(self) -> None:
        self._reading.cancel()

    # -- as a ClientLink (named clients) ---------------------------------------------------

    def offer(self, reply_id: int, body: bytes) -> bool:
        """Queue a durable reply (see :class:`NamedClients`); False if it was dropped."""
        endpoint = self.endpoint
        if endpoint is None or endpoint.closed:
            return False
        if not self.acks:
            self._durable[id(body)] = (body, reply_id)
        if endpoint.push(body):
            return True
        self._durable.pop(id(body), None)
        return False

    def take_written(self) -> list[int]:
        written, self._written = self._written, []
        return written

    def _wrote(self, body: bytes) -> None:
        """A reply was written: a durable one on a no-ack link counts as received if the
        client's input is still open (one written after its end of input stays kept)."""
        entry = self._durable.pop(id(body), None)
        if entry is not None and entry[0] is body and self.input_open:
            self._written.append(entry[1])

    async def _acked(self, reply_ids: list[int]) -> None:
        named = self.server.named_clients
        if named is not None and self.identity:
            await named.received(self, reply_ids)

    async def run(self) -> None:
        try:
            identity = await self._handshake()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        if identity is None:
            return
        pump = self.server.pump
        try:
            endpoint = self._open_endpoint(identity)
        except PumpClosed:
            return
        self.endpoint = endpoint
        self._direct = _direct_handle(self.stream)
        if self._direct is not None:
            endpoint.sink = self._write_now
        endpoint.on_chain_end = self._chain_ended
        named = self.server.named_clients if identity.name is not None else None
        self.acks = identity.ack
        server = self.server
        self.is_operator = server.operator is not None and (
            identity.name in server.operators
            if identity.name is not None
            else server.anonymous_operators
        )
        hub = self.server.runners
        if hub is not None and hub.is_runner(identity.name):
            assert identity.name is not None
            self.runner = hub.attach(identity.name, endpoint.name, endpoint.push)
            # Jobs come in bursts (one per request read): the writer batches them into one
            # write; the direct write would cost a send per job.
            endpoint.sink = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer, nursery.cancel_scope)
                if named is not None:
                    assert identity.name is not None
                    self.identity, self.endpoint_name = identity.name, endpoint.name
                    await named.attach(self)
                reason = await self._read_loop()
                if reason == "eof":
                    await self._linger()
                if reason != "stopped":
                    endpoint.close()
        finally:
            if self.runner is not None:
                hub.detach(self.runner)  # its jobs go to other runners (or fail)
            endpoint.sink = None
            endpoint.on_chain_end = None
            if self._direct is not None:
                # Before the stream closes: an open duplicate would keep the socket open.
                self._direct.close()
            endpoint.close()
            if named is not None:
                self.input_open = False
                # Short and synchronous underneath (one SQLite read): hand what this
                # connection did not receive to another, even while being cancelled.
                with trio.CancelScope(shield=True):
                    await named.detach(self)
            log.debug("connection %s closed (pump %s)", endpoint.name, pump.running)

    def _open_endpoint(self, identity: Identity) -> Endpoint:
        pump = self.server.pump
        if not pump.running:
            raise PumpClosed("not running")
        size = {
            "buffer": self.limits.outgoing_buffer,
            "buffer_bytes": self.limits.outgoing_buffer_bytes,
        }
        if identity.name is None:
            return pump.open_endpoint(None, **size)
        try:
            return pump.open_endpoint(identity.name, allowed=identity.allowed, **size)
        except ConfigurationError:
            # The client is connected twice: the second connection gets a suffixed name.
            name = f"{identity.name[:55]}-{new_thread_id()[:8]}"
            return pump.open_endpoint(name, allowed=identity.allowed, **size)

    # -- handshake -----------------------------------------------------------------------

    async def _handshake(self) -> Identity | None:
        if self.cert_identity is not None:
            return await self._certificate_hello(self.cert_identity)
        gate = self.server.gate
        if not gate.required:
            return Identity(None)
        server = self.server
        throttle = server.throttle
        address = self.address
        decoder = FrameDecoder(MAX_HELLO_BYTES)
        frame: bytes | None = None
        with trio.move_on_after(self.limits.hello_timeout):
            try:
                while frame is None:
                    data = await self.stream.receive_some(MAX_HELLO_BYTES + 8)
                    if not data:
                        return None
                    decoder.feed(data)
                    frame = decoder.next_frame()
            except FrameTooLarge:
                frame = None
        # Throttled only once the hello is read: closing on unread input would reset the
        # connection, and the client might never see its refusal.
        delay = throttle.delay(address, trio.current_time())
        if delay > 0:
            server.counters["throttled"] += 1
            if address in server._throttled:
                # One slowed hello per address at a time: more would only hold slots.
                await _send_refusal(self.stream, huh(HuhReason.UNAUTHENTICATED))
                return None
            server._throttled.add(address)
            try:
                await trio.sleep(delay)
            finally:
                server._throttled.discard(address)
        try:
            if frame is None:
                raise Unauthenticated("no hello in time, or an oversize first frame")
            identity = self.server.gate.check(frame)
        except Unauthenticated as exc:
            server.counters["unauthenticated"] += 1
            now = trio.current_time()
            if throttle.failed(address, now):
                log.warning(
                    "%d failed hellos from %s: slowing its hellos down (logged once per burst)",
                    throttle.failures(address, now),
                    address,
                )
            elif throttle.failures(address, now) < throttle.free_failures:
                log.info("connection from %s refused: %s", address, exc)
            # The same canned refusal whatever was wrong (name, token, or frame).
            await _send_refusal(self.stream, huh(HuhReason.UNAUTHENTICATED))
            return None
        throttle.succeeded(address)
        # Frames sent right behind the hello are not lost: the reader starts with them.
        self._early = decoder.take_remainder()
        return identity

    async def _certificate_hello(self, identity: Identity) -> Identity | None:
        """A client named by its certificate may still send a hello first, to ask for
        acknowledgement (its token is not checked: the certificate proved who it is). Waits
        up to ``CERT_HELLO_WAIT`` s for a first frame; one that is not a hello is kept for
        the reader, a hello naming another client is refused."""
        decoder = FrameDecoder(self.limits.max_message_bytes)
        received = b""
        frame: bytes | None = None
        with trio.move_on_after(CERT_HELLO_WAIT):
            try:
                while frame is None:
                    data = await self.stream.receive_some(RECEIVE_SIZE)
                    if not data:
                        break
                    received += data
                    decoder.feed(data)
                    frame = decoder.next_frame()
            except FrameTooLarge:
                frame = None  # the reader refuses it, from the bytes kept below
        if frame is not None:
            try:
                ack = self.server.gate.certificate_hello(frame, identity.name)
            except Unauthenticated as exc:
                self.server.counters["unauthenticated"] += 1
                log.info("connection from %s refused: %s", self.address, exc)
                await _send_refusal(self.stream, huh(HuhReason.UNAUTHENTICATED))
                return None
            if ack is not None:
                self._early = decoder.take_remainder()
                return dataclasses.replace(identity, ack=ack)
        self._early = received
        return identity

    # -- reading -------------------------------------------------------------------------

    async def _read_loop(self) -> str:
        """Read and inject frames. Returns why it stopped: eof, stopped, stalled, idle,
        oversize, closed."""
        limits = self.limits
        decoder = FrameDecoder(limits.max_message_bytes)
        endpoint = self.endpoint
        assert endpoint is not None
        stream = self.stream
        frame_deadline = math.inf
        pending = self._early
        self._early = b""
        acks = self.server.acks if self.acks else None
        runner = self.runner
        runners = self.server.runners
        operator = self.server.operator if self.is_operator else None
        direct = self._direct
        # Readiness is waited for on trio's own socket (which tells trio's I/O manager
        # when it closes), never on the duplicate.
        readable = stream.socket if direct is not None else None
        # The replies to one read's requests are collected and written with one send once
        # they are all injected (answered inline, as a sync listener's are) instead of each
        # going through the endpoint's channel to the writer. Never across a wait: the
        # reader flushes before anything that may wait, so whatever another task produces
        # meanwhile takes the usual way, and nothing is overtaken.
        batching = direct is not None and runner is None
        with self._reading:
            while True:
                if pending:
                    data, pending = pending, b""
                else:
                    if decoder.mid_frame:
                        deadline = frame_deadline
                    elif limits.idle_timeout > 0 and not self._inflight:
                        deadline = trio.current_time() + limits.idle_timeout
                    else:
                        deadline = math.inf
                    try:
                        if deadline == math.inf:
                            # The common case (between frames, no idle timeout): no cancel
                            # scope, which would cost more than the read itself.
                            if direct is not None:
                                data = await _receive_direct(direct, readable)
                            else:
                                data = await stream.receive_some(RECEIVE_SIZE)
                            timed_out = False
                        else:
                            with trio.move_on_at(deadline) as waited:
                                data = await stream.receive_some(RECEIVE_SIZE)
                            timed_out = waited.cancelled_caught
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        self.input_open = False
                        return "closed"
                    if timed_out:
                        reason = "stalled" if decoder.mid_frame else "idle"
                        log.info("connection %s %s: closing", endpoint.name, reason)
                        return reason
                    if not data:
                        self.input_open = False
                        return "eof"
                new_frame = not decoder.mid_frame
                decoder.feed(data)
                now = trio.current_time()
                frames = 0
                if batching:
                    self._start_batch()
                try:
                    while True:
                        try:
                            frame = decoder.next_frame()
                        except FrameTooLarge as exc:
                            self.server.counters["oversize"] += 1
                            log.info("connection %s: %s", endpoint.name, exc)
                            refusal = huh(HuhReason.TOO_LARGE)
                            endpoint.push(encode(SYSTEM, endpoint.name, new_thread_id(), refusal))
                            return "oversize"
                        if frame is None:
                            break
                        # A frame ended, so whatever follows starts a new one (and time spent
                        # waiting for in-flight room below is not the client's stall).
                        new_frame = True
                        if acks is not None:
                            reply_ids = acks.ids(frame)
                            if reply_ids is not None:  # not a request: nothing in flight
                                self._flush()
                                await self._acked(reply_ids)
                                if batching:
                                    self._start_batch()
                                continue
                        if runner is not None:
                            # Job replies and <serve>: not requests, nothing in flight.
                            runners.frame(runner, frame)
                            continue
                        if operator is not None and operator.may_be_command(frame):
                            self._flush()
                            answer = await operator.handle(frame, endpoint.name)
                            if batching:
                                self._start_batch()
                            if answer is not None:  # a command: carried out, not a request
                                endpoint.push(answer)
                                continue
                        frames += 1
                        if frames == 2:
                            self._pipelining = True
                        size = len(frame)
                        if not self._has_room(size):
                            self._flush()  # written replies free room
                            if not self._has_room(size):
                                await self._wait_for_room(size)
                            now = trio.current_time()  # waiting is not the client's stall
                            if batching:
                                self._start_batch()
                        self._inflight.append((now + limits.inflight_ttl, size))
                        self._inflight_bytes += size
                        try:
                            rest = endpoint.send_now(frame)
                            if rest is not None:  # it may wait: write what is collected
                                self._flush()
                                await rest
                                if batching:
                                    self._start_batch()
                        except (PumpClosed, EndpointClosed):
                            return "stopped"
                finally:
                    self._flush()
                if frames == 1:
                    self._pipelining = False
                if new_frame and decoder.mid_frame:
                    frame_deadline = now + limits.read_timeout
        return "stopped"

    def _has_room(self, size: int) -> bool:
        """May a request of ``size`` bytes join those in flight? (One always may when
        none is, however large: the byte bound must not shut out a big request.)"""
        inflight = self._inflight
        return not inflight or (
            len(inflight) < self.limits.max_inflight
            and self._inflight_bytes + size <= self.limits.max_inflight_bytes
        )

    async def _wait_for_room(self, size: int) -> None:
        """Wait until the connection may have one more request, of ``size`` bytes, in
        flight. Cancellable; bounded by ``inflight_ttl`` (old requests stop counting)."""
        inflight = self._inflight
        while not self._has_room(size):
            now = trio.current_time()
            while inflight and inflight[0][0] <= now:
                # Unanswered for inflight_ttl: stop counting it.
                self._inflight_bytes -= inflight.popleft()[1]
            if self._has_room(size):
                break
            self._room = trio.Event()
            with trio.move_on_at(inflight[0][0]):
                await self._room.wait()

    def _replied(self, count: int) -> None:
        # Replies are not matched to requests (a broadcast may answer one request
        # several times): each reply retires the oldest request still counted.
        inflight = self._inflight
        for _ in range(min(count, len(inflight))):
            self._inflight_bytes -= inflight.popleft()[1]
        self._room.set()

    def _chain_ended(self) -> None:
        # A request that ended without a reply frees its slot now, not after inflight_ttl
        # (counted like a reply: requests and replies are not matched, see _replied).
        self._replied(1)

    async def _linger(self) -> None:
        """The client closed its sending side: give owed replies a bounded time to go out."""
        with trio.move_on_after(self.limits.read_timeout):
            while self._inflight and self.endpoint is not None and not self.endpoint.closed:
                self._room = trio.Event()
                await self._room.wait()

    # -- writing -------------------------------------------------------------------------

    def _start_batch(self) -> None:
        """Collect the replies produced from now on, for one write by :meth:`_flush`, if
        nothing is queued for the writer or half-written (they would be overtaken)."""
        if self._writer_idle and not self._carry:
            self._batch = []
            self._batch_bytes = 0

    def _flush(self) -> None:
        """Stop collecting replies, and write those collected with one non-blocking send;
        what the socket does not take is carried over to the writer, which is woken to
        send it before anything else (as :meth:`_write_now` does)."""
        batch = self._batch
        if batch is None:
            return
        self._batch = None
        if not batch:
            return
        assert self._direct is not None
        count = len(batch)
        data = encode_frames(batch) if count > 1 else encode_frame(batch[0])
        try:
            sent = self._direct.send(data, _NO_SIGNAL)
        except OSError:  # full, or broken: the writer's write finds out which
            sent = 0
        self._sent(batch, data, sent)

    def _sent(self, bodies: list[bytes], data: bytes, sent: int) -> None:
        """Account for the replies ``bodies``, framed as ``data``, of which one
        non-blocking send took ``sent`` bytes: the rest is carried over to the writer,
        which is woken to send it before anything else."""
        count = len(bodies)
        self._replied(count)
        if self._durable:
            for body in bodies:
                self._wrote(body)
        counters = self.server.counters
        counters["replies"] += count
        counters["writes"] += 1
        if sent < len(data):
            counters["carried"] += 1
            self._carry = data[sent:]
            self._writer_idle = False
            assert self.endpoint is not None
            self.endpoint.push(_WAKE)  # queued (the writer is no longer idle): wakes it

    def _write_now(self, body: bytes) -> bool:
        """The endpoint's sink: write one reply straight to the socket, from whichever
        task produced it, when that can neither reorder nor block anything. That is when
        the writer waits with nothing queued or half-written, this is the last reply owed
        and the client is not pipelining (else the writer batches replies into one write).
        While the reader collects the replies to what it read (see :meth:`_start_batch`),
        the reply joins them instead.

        True if the reply was written. What the socket did not take is carried over to the
        writer, which is woken to send it before anything else. On False (and on a full
        or broken socket) the reply is queued for the writer as usual. Never blocks: one
        non-blocking ``send``, which costs less than the writer's wake-up and write.
        """
        batch = self._batch
        if batch is not None:
            batch.append(body)
            self._batch_bytes += len(body)
            if len(batch) >= MAX_BATCH or self._batch_bytes >= MAX_BATCH_BYTES:
                self._flush()
                self._start_batch()
            return True
        if not self._writer_idle or self._pipelining or len(self._inflight) > 1:
            # Queued for the writer, which that wakes: later replies must queue behind it.
            self._writer_idle = False
            return False
        frame = encode_frame(body)
        try:
            sent = self._direct.send(frame, _NO_SIGNAL)
        except OSError:  # full (nothing sent) or broken: the writer finds out
            self._writer_idle = False
            return False
        self._sent([body], frame, sent)
        return True

    async def _writer(self, connection_scope: trio.CancelScope) -> None:
        """Write replies as they are produced, batching whatever is ready into one write."""
        endpoint = self.endpoint
        assert endpoint is not None
        stream = self.stream
        write_timeout = self.limits.write_timeout
        # One scope for the connection's life; its deadline is armed only around a write
        # (re-arming a deadline is much cheaper than a new cancel scope per write).
        guard = trio.CancelScope()
        try:
            with guard:
                await self._write_batches(endpoint, stream, guard, write_timeout)
            if guard.cancelled_caught:
                log.info(
                    "connection %s: a write blocked for %ss: disconnecting",
                    endpoint.name,
                    write_timeout,
                )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if endpoint.overflowed:
                log.info("connection %s stopped reading: disconnected", endpoint.name)
            # The connection is over once nothing more can be written: stop the reader.
            connection_scope.cancel()

    @staticmethod
    def _collect(endpoint: Endpoint, batch: list[bytes]) -> int:
        """Add the replies that are ready to ``batch`` (up to MAX_BATCH); how many."""
        added = 0
        while len(batch) < MAX_BATCH:
            try:
                batch.append(endpoint.receive_nowait())
            except (trio.WouldBlock, EndpointClosed):
                break
            added += 1
        return added

    async def _write_batches(
        self,
        endpoint: Endpoint,
        stream: trio.abc.Stream,
        guard: trio.CancelScope,
        write_timeout: float,
    ) -> None:
        """Write replies as they come, batching what is ready; ``guard``'s deadline is
        armed only while a write is in progress."""
        counters = self.server.counters

        async def write(data: bytes) -> None:
            counters["writes"] += 1
            guard.deadline = trio.current_time() + write_timeout
            await stream.send_all(data)
            guard.deadline = math.inf

        while True:
            try:
                try:
                    first = endpoint.receive_nowait()
                except trio.WouldBlock:
                    self._writer_idle = True
                    try:
                        first = await endpoint.receive()
                    finally:
                        self._writer_idle = False
            except EndpointClosed:
                if self._carry:  # the rest of a direct write: the frame must end whole
                    data, self._carry = self._carry, b""
                    await write(data)
                break
            batch = [first]
            self._collect(endpoint, batch)
            # Replies still owed to this client are usually being produced in the same
            # few scheduler rounds: wait for them while they keep coming, so one write
            # carries many (a syscall per reply costs more than the rest of a reply).
            # Nothing owed, or a round that brought nothing: write now.
            for _ in range(_MAX_GATHER_ROUNDS):
                if len(batch) >= MAX_BATCH or len(self._inflight) <= len(batch):
                    break
                await trio.lowlevel.cancel_shielded_checkpoint()
                if not self._collect(endpoint, batch):
                    break
            replies = [body for body in batch if body]  # an empty one is a _WAKE
            data = encode_frames(replies)
            if self._carry:
                data, self._carry = self._carry + data, b""
            self._replied(len(replies))
            counters["replies"] += len(replies)
            counters["queued"] += len(replies)
            await write(data)
            if self._durable:
                for body in replies:
                    self._wrote(body)
                if self._written:
                    await self._written_now()

    async def _written_now(self) -> None:
        named = self.server.named_clients
        written = self.take_written()
        if named is not None and written:
            await named.received(self, written)
