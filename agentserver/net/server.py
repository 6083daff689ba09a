"""The TCP server: framed XML envelopes in, replies pushed out as they are produced.

This module accepts connections (TLS handshake, connection limit); each is then served by
a :class:`~agentserver.net.connection.Connection`: its hello (:mod:`agentserver.net.hello`),
then a reader that decodes frames and injects them into the pump through the connection's
endpoint, and a writer (:mod:`agentserver.net.writer`) that writes replies as they are
produced, batched, mostly without a task switch on plaintext connections.

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
- With TLS (boot.xml ``<tls>``, docs/security.md) every connection is a
  :class:`~agentserver.net.tlsstream.TlsStream` whose handshake must end within
  ``read_timeout`` (a plaintext client fails it and is closed); it is read and written
  the way a plaintext socket is (direct reads, the replies to one read encrypted together
  and sent with one non-blocking send). Closing sends ``close_notify``; a client's
  ``close_notify`` is its end of input. With mutual TLS the client certificate names the
  client and no hello is read.
- Failed hellos are throttled per source address (:mod:`agentserver.core.throttle`).
- A named client's connection is a :class:`~agentserver.net.roles.ClientLink`
  for its durable replies (agents' answers): with ``<hello ack="true">`` they carry a
  ``reply-id`` and the client's core ``<ack>`` frames are consumed here (never reach the
  pump, never count as requests); without, a durable reply counts as received once written
  while the client's input is open.
"""

from __future__ import annotations

import errno
import logging
import os
import ssl

import trio

from agentserver.core.errors import DeliveryRefused, HuhReason, SystemErrorCode
from agentserver.core.handshake import AckReader, HelloGate, Identity
from agentserver.core.throttle import HelloThrottle
from agentserver.net.connection import Connection, Shared
from agentserver.net.hello import REFUSAL_WRITE_TIMEOUT, HelloDesk, send_refusal
from agentserver.net.limits import Limits
from agentserver.net.roles import NamedClients, OperatorCommands, Runners
from agentserver.net.tls import CertificateRule, match_certificate
from agentserver.net.tlsstream import TlsStream
from agentserver.primitives.core import huh, primitive_for
from agentserver.pump.pump import Pump

log = logging.getLogger("agentserver.server")

#: accept() failures that mean "out of descriptors or memory for now": retried after
#: ACCEPT_RETRY seconds (as trio.serve_listeners does) instead of ending the server.
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY = 0.1


def _peer_host(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except (OSError, IndexError):
        return "?"


def format_address(sockname: tuple) -> str:
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Server:
    """Serves one pump on TCP. ``serve`` runs until :meth:`stop_accepting` and until every
    connection has ended (connections end when the pump closes their endpoints).

    Every collaborator is given here: ``runners`` (the remote listeners' hub, when the
    topology has any), ``operator`` (carries out stop/cancel for the clients named in
    ``operators``, and for anonymous connections if ``anonymous_operators``) and
    ``named_clients`` (the named clients' durable replies, when agents run)."""

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
        runners: Runners | None = None,
        operator: OperatorCommands | None = None,
        operators: frozenset[str] = frozenset(),
        anonymous_operators: bool = False,
        named_clients: NamedClients | None = None,
    ) -> None:
        self.pump = pump
        self.limits = limits
        #: TLS on every connection when set (a client certificate is required if the
        #: context asks for one; ``cert_rules`` then say whom it proves).
        self.ssl_context = ssl_context
        self.cert_rules = cert_rules
        #: The listeners each client named by a certificate may address (None: all).
        self.allowed = allowed or {}
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
        #: Reads and checks the hellos (and throttles the addresses that keep failing).
        self.hello = HelloDesk(gate, limits, self.counters, throttle)
        self._shared = Shared(
            pump,
            limits,
            self.counters,
            self.hello,
            AckReader(limits.max_message_bytes),
            runners=runners,
            operator=operator,
            operators=operators,
            anonymous_operators=anonymous_operators,
            named_clients=named_clients,
        )
        self._handshaking = 0
        self._accept_scope = trio.CancelScope()
        self._connections: set[Connection] = set()

    @property
    def connection_count(self) -> int:
        """Connections being served now (past the TLS handshake and the connection limit)."""
        return len(self._connections)

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[list[tuple]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host``:``port`` (``task_status`` gets the bound addresses) and serve
        every connection until :meth:`stop_accepting` and until each has ended. Cancelling
        it closes every connection at once."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        addresses = [lst.socket.getsockname() for lst in listeners]
        async with trio.open_nursery() as connections:
            with self._accept_scope:
                task_status.started(addresses)
                async with trio.open_nursery() as accepting:
                    for lst in listeners:
                        accepting.start_soon(self._accept, lst, connections)
            for lst in listeners:
                await lst.aclose()
        log.info("server stopped: %s", self.counters)

    def stop_accepting(self) -> None:
        """Close the listening sockets and stop reading from every connection. Replies
        still owed are written until the pump closes the endpoints."""
        self._accept_scope.cancel()
        for conn in list(self._connections):
            conn.stop_reading()

    async def _accept(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        """Accept connections on ``listener`` until cancelled, each served by a task of
        ``connections`` running :meth:`_on_stream` (which closes it). Not
        ``trio.serve_listeners``: its wrapper task closes every stream again with
        ``aclose_forcefully``, whose cancelled checkpoint raises and catches a Cancelled
        per connection; that, and the extra task, was a tenth of the server's CPU for a
        client that connects briefly (docs/performance.md, "Connection setup")."""
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                log.error(
                    "accept returned %s (%s); retrying in %s seconds",
                    errno.errorcode[exc.errno],
                    os.strerror(exc.errno),
                    ACCEPT_RETRY,
                )
                await trio.sleep(ACCEPT_RETRY)
            else:
                connections.start_soon(self._on_stream, stream)

    async def _on_stream(self, stream: trio.SocketStream) -> None:
        """Serve one accepted connection and close it, whatever happens."""
        async with stream:
            address = _peer_host(stream)
            busy = len(self._connections) + self._handshaking >= self.limits.max_connections
            wire: trio.abc.Stream = stream
            if self.ssl_context is not None:
                # A busy server still completes a (short) handshake so the refusal can be
                # read; a connection slot is held from the handshake on.
                timeout = REFUSAL_WRITE_TIMEOUT if busy else self.limits.read_timeout
                self._handshaking += 0 if busy else 1
                try:
                    tls = await self._tls_handshake(stream, address, timeout)
                finally:
                    self._handshaking -= 0 if busy else 1
                if tls is None:
                    return
                wire = tls
            try:
                await self._serve(wire, address, busy)
            finally:
                if wire is not stream:
                    with trio.move_on_after(REFUSAL_WRITE_TIMEOUT):
                        # close_notify; the socket is closed whatever happens.
                        await wire.aclose()

    async def _tls_handshake(
        self, stream: trio.SocketStream, address: str, seconds: float
    ) -> TlsStream | None:
        """The TLS stream once its handshake is done, within ``seconds`` (a stalled one must
        not hold a connection slot); None if it failed (logged, counted; the caller closes
        ``stream``)."""
        assert self.ssl_context is not None
        try:
            wrapped = TlsStream(stream, self.ssl_context, server_side=True)
        except OSError as exc:  # no descriptor left for its handle
            log.info("TLS from %s not started: %s", address, exc)
            return None
        reason = "stalled"
        with trio.move_on_after(seconds):
            try:
                await wrapped.do_handshake()
                return wrapped
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                cause = exc.__cause__
                reason = getattr(cause, "reason", None) or str(cause or exc) or "closed"
        wrapped.discard()
        self.counters["tls_failed"] += 1
        log.info("TLS handshake from %s failed: %s", address, reason)
        return None

    async def _serve(self, stream: trio.abc.Stream, address: str, busy: bool) -> None:
        identity: Identity | None = None
        mutual = self.ssl_context is not None and self.ssl_context.verify_mode == ssl.CERT_REQUIRED
        if isinstance(stream, TlsStream) and mutual:
            # The certificate was verified against the client CA: now, whom does it name?
            name = match_certificate(
                self.cert_rules, stream.getpeercert(), stream.getpeercert(binary_form=True)
            )
            if name is None:
                self.counters["unauthenticated"] += 1
                log.info("connection from %s refused: its certificate names no client", address)
                await send_refusal(stream, huh(HuhReason.UNAUTHENTICATED))
                return
            identity = Identity(name, self.allowed.get(name))
        if busy or len(self._connections) >= self.limits.max_connections:
            self.counters["refused_busy"] += 1
            refusal = DeliveryRefused(SystemErrorCode.ROUTING, retry_allowed=True)
            await send_refusal(stream, primitive_for(refusal))
            return
        self.counters["accepted"] += 1
        conn = Connection(self._shared, stream, address, identity)
        self._connections.add(conn)
        try:
            await conn.run()
        except Exception:
            # A bug in one connection's handling must not take the server down.
            log.exception("connection failed; closing it")
        finally:
            self._connections.discard(conn)
