"""One client connection of the TCP server: its hello, then a reader and a writer task.

The reader decodes frames (:mod:`agentserver.core.framing`) and injects them into the pump
through the connection's endpoint; the writer (:mod:`agentserver.net.writer`) writes the
replies. On a plaintext or TLS connection the reader reads the socket itself (yielding
first, so the next request is usually there: no failed read, no epoll registration); a
TLS connection's :class:`~agentserver.net.tlsstream.TlsStream` decrypts what it reads. The
rules it applies are listed in :mod:`agentserver.net.server`.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
from dataclasses import dataclass

import trio

from agentserver.core.envelope import encode
from agentserver.core.errors import ConfigurationError, EndpointClosed, HuhReason, PumpClosed
from agentserver.core.framing import FrameDecoder, FrameTooLarge
from agentserver.core.handshake import AckReader, Identity
from agentserver.core.threads import new_thread_id
from agentserver.net.hello import RECEIVE_SIZE, HelloDesk
from agentserver.net.inflight import Inflight
from agentserver.net.limits import Limits
from agentserver.net.roles import NamedClients, OperatorCommands, Runners
from agentserver.net.tlsstream import TlsStream
from agentserver.net.writer import DirectHandle, ReplyWriter, direct_handle
from agentserver.primitives.core import huh
from agentserver.pump.endpoint import Endpoint, Sink
from agentserver.pump.pump import SYSTEM, Pump

# The server's logger: a connection is the server's work.
log = logging.getLogger("agentserver.server")


async def _receive_direct(direct: DirectHandle, readable: trio.socket.SocketType) -> bytes:
    """What ``direct`` (a :func:`~agentserver.net.writer.direct_handle`) has to read: b""
    at end of input; OSError if the connection broke. Yields first, then reads without
    waiting when it can: by then the client has usually sent its next request (a client
    waiting for its reply sends the next one at once), so the read neither fails nor waits
    on the I/O manager (trio's ``receive_some`` reads at once, fails, registers the socket
    with epoll, waits a round, reads, and yields again). A checkpoint: cancellable."""
    await trio.lowlevel.checkpoint()
    while True:
        try:
            return direct.recv(RECEIVE_SIZE)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(readable)


def _trio_socket(stream: trio.abc.Stream) -> trio.socket.SocketType | None:
    """trio's own socket under ``stream`` (a plain or a TLS connection), else None."""
    if isinstance(stream, trio.SocketStream | TlsStream):
        return stream.socket
    return None


@dataclass(frozen=True, slots=True)
class Shared:
    """What every connection of one server shares (built once by the server)."""

    pump: Pump
    limits: Limits
    #: The server's counters (each connection adds to them).
    counters: dict[str, int]
    hello: HelloDesk
    #: Reads the ``<ack>`` frames of connections whose hello asked for acks.
    acks: AckReader
    #: A runner client's frames go to it, never to the pump (None: no remote listeners).
    runners: Runners | None = None
    #: Carries out operator commands for the clients in ``operators`` (and anonymous
    #: connections if ``anonymous_operators``); None: no one may.
    operator: OperatorCommands | None = None
    operators: frozenset[str] = frozenset()
    anonymous_operators: bool = False
    #: The named clients' durable replies (when agents run): each named connection is
    #: attached to it after the hello and detached when it ends.
    named_clients: NamedClients | None = None


class Connection:
    """One client connection (see :mod:`agentserver.net.server` for the rules it applies).
    :meth:`run` serves it until it ends; ``shared`` is its server's :class:`Shared`."""

    def __init__(
        self,
        shared: Shared,
        stream: trio.abc.Stream,
        address: str = "?",
        identity: Identity | None = None,
    ) -> None:
        self.shared = shared
        self.stream = stream
        #: The peer's host, for hello throttling.
        self.address = address
        #: Set when the TLS client certificate already named the client (its hello, if
        #: any, only asks for acknowledgement).
        self.cert_identity = identity
        self.limits = shared.limits
        self.endpoint: Endpoint | None = None
        self._reading = trio.CancelScope()
        self.inflight = Inflight(shared.limits)
        #: What was read behind the hello: the reader starts with it.
        self._early = b""
        #: A second handle on the socket: read without trio's I/O manager, and written by
        #: the writer's non-blocking sends.
        self._direct: DirectHandle | None = None
        #: Made with the endpoint, once the hello is done.
        self._out: ReplyWriter | None = None
        # As a ClientLink (named clients only; see agentserver.agents.edge.named_clients):
        self.identity = ""
        self.endpoint_name = ""
        self.acks = False
        self.input_open = True
        #: Set on a runner client's connection: its frames are job replies.
        self.runner: object | None = None
        #: May send operator commands (stop, cancel) on every task.
        self.is_operator = False
        #: The declared client this connection is (None: anonymous): a non-operator
        #: client's commands reach only its own tasks (agentserver/core/access.py).
        self.client: str | None = None

    def stop_reading(self) -> None:
        """Read no more from the client (shutdown); replies still owed are written."""
        self._reading.cancel()

    # -- as a ClientLink (named clients) ---------------------------------------------------

    def offer(self, reply_id: int, body: bytes) -> bool:
        """Queue a durable reply (see :class:`~agentserver.net.roles.NamedClients`); False
        if it was dropped. On a no-ack link its receipt has committed already (the reply
        is out of the store), so once queued it is written even if her end of input is
        read meanwhile (she reads until the server closes); once that was read, none is
        queued (False: the caller keeps it again for her next connection)."""
        endpoint = self.endpoint
        if endpoint is None or self._out is None or endpoint.closed:
            return False
        if not self.acks and not self.input_open:
            return False
        return endpoint.push(body)

    async def _acked(self, reply_ids: list[int]) -> None:
        named = self.shared.named_clients
        if named is not None and self.identity:
            await named.received(self, reply_ids)

    async def run(self) -> None:
        """Serve the connection until it ends: the hello, then the reader and the writer
        (see the module docstring). Cancelling it ends the connection (its named-client
        hand-over still runs, shielded: one short store read)."""
        shared = self.shared
        try:
            identity, self._early = await shared.hello.identify(
                self.stream, self.address, self.cert_identity
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        if identity is None:
            return
        pump = shared.pump
        hub = shared.runners
        is_runner = hub is not None and hub.is_runner(identity.name)
        direct = direct_handle(self.stream)
        try:
            out = ReplyWriter(
                lambda sink: self._open_endpoint(identity, sink),
                self.stream,
                direct,
                self.inflight,
                shared.counters,
                self.limits.write_timeout,
                # Jobs come in bursts (one per request read): the writer batches them into
                # one write; the direct write would cost a send per job.
                direct_writes=not is_runner,
            )
        except BaseException as exc:
            if isinstance(direct, socket.socket):
                direct.close()
            if isinstance(exc, PumpClosed):
                return
            raise
        self._direct, self._out = direct, out
        endpoint = self.endpoint = out.endpoint
        named = shared.named_clients if identity.name is not None else None
        self.acks = identity.ack
        self.client = identity.name
        self.is_operator = shared.operator is not None and (
            identity.name in shared.operators
            if identity.name is not None
            else shared.anonymous_operators
        )
        if is_runner:
            assert hub is not None and identity.name is not None
            self.runner = hub.attach(identity.name, endpoint.name, endpoint.push)
        # What the writer cancels when nothing more can be written: the reading side only.
        # Once that is over (the usual end: the client closed, the endpoint was closed
        # here), cancelling it costs nothing, where cancelling the nursery would throw a
        # Cancelled into this task waiting for the writer, on every connection.
        serving = trio.CancelScope()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(out.run, serving)
                with serving:
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
                assert hub is not None
                hub.detach(self.runner)  # its jobs go to other runners (or fail)
            endpoint.release()
            if isinstance(direct, socket.socket):
                # Before the stream closes: an open duplicate would keep the socket open
                # (a TLS stream, its own direct handle, is closed by its owner).
                direct.close()
            if named is not None:
                self.input_open = False
                # Short and synchronous underneath (one SQLite read): hand what this
                # connection did not receive to another, even while being cancelled.
                with trio.CancelScope(shield=True):
                    await named.detach(self)
            log.debug("connection %s closed (pump %s)", endpoint.name, pump.running)

    def _open_endpoint(self, identity: Identity, sink: Sink | None) -> Endpoint:
        pump = self.shared.pump
        if not pump.running:
            raise PumpClosed("not running")
        open_endpoint = functools.partial(
            pump.open_endpoint,
            buffer=self.limits.outgoing_buffer,
            buffer_bytes=self.limits.outgoing_buffer_bytes,
            sink=sink,
            on_chain_end=self._chain_ended,
        )
        if identity.name is None:
            return open_endpoint(None)
        try:
            return open_endpoint(identity.name, allowed=identity.allowed)
        except ConfigurationError:
            # The client is connected twice: the second connection gets a suffixed name.
            name = f"{identity.name[:55]}-{new_thread_id()[:8]}"
            return open_endpoint(name, allowed=identity.allowed)

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
        acks = self.shared.acks if self.acks else None
        runner = self.runner
        runners = self.shared.runners
        # Operators' commands reach every task; a declared client's only its own (the
        # operator object applies the authorization rule).
        operator = self.shared.operator if self.is_operator or self.client is not None else None
        is_operator, client = self.is_operator, self.client
        direct = self._direct
        # Readiness is waited for on trio's own socket (which tells trio's I/O manager
        # when it closes), never on the duplicate.
        readable = _trio_socket(stream) if direct is not None else None
        receive_direct = (
            functools.partial(_receive_direct, direct, readable)
            if direct is not None and readable is not None
            else None
        )
        # The replies to one read's requests are collected and written with one send once
        # they are all injected (answered inline, as a sync listener's are) instead of each
        # going through the endpoint's channel to the writer. Never across a wait: the
        # reader flushes before anything that may wait, so whatever another task produces
        # meanwhile takes the usual way, and nothing is overtaken.
        batching = direct is not None and runner is None
        inflight = self.inflight
        out = self._out
        assert out is not None
        data: bytes | bytearray  # what one read got (trio's streams may give a bytearray)
        with self._reading:
            while True:
                if pending:
                    data, pending = pending, b""
                else:
                    if decoder.mid_frame:
                        deadline = frame_deadline
                    elif limits.idle_timeout > 0 and not inflight.requests:
                        deadline = trio.current_time() + limits.idle_timeout
                    else:
                        deadline = math.inf
                    try:
                        if deadline == math.inf:
                            # The common case (between frames, no idle timeout): no cancel
                            # scope, which would cost more than the read itself.
                            if receive_direct is not None:
                                data = await receive_direct()
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
                    out.start_batch()
                try:
                    while True:
                        try:
                            frame = decoder.next_frame()
                        except FrameTooLarge as exc:
                            self.shared.counters["oversize"] += 1
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
                                out.flush()
                                await self._acked(reply_ids)
                                if batching:
                                    out.start_batch()
                                continue
                        if runner is not None:
                            # Job replies and <serve>: not requests, nothing in flight.
                            assert runners is not None
                            runners.frame(runner, frame)
                            continue
                        if operator is not None and operator.may_be_command(frame):
                            out.flush()
                            answer = await operator.handle(
                                frame, endpoint.name, client, operator=is_operator
                            )
                            if batching:
                                out.start_batch()
                            if answer is not None:  # a command: carried out, not a request
                                endpoint.push(answer)
                                continue
                        frames += 1
                        if frames == 2:
                            out.pipelining(True)
                        size = len(frame)
                        if not inflight.has_room(size):
                            out.flush()  # written replies free room
                            if not inflight.has_room(size):
                                await inflight.wait_for_room(size)
                            now = trio.current_time()  # waiting is not the client's stall
                            if batching:
                                out.start_batch()
                        inflight.add(now, size)
                        try:
                            rest = endpoint.send_now(frame)
                            if rest is not None:  # it may wait: write what is collected
                                out.flush()
                                await rest
                                if batching:
                                    out.start_batch()
                        except (PumpClosed, EndpointClosed):
                            return "stopped"
                finally:
                    out.flush()
                if frames == 1:
                    out.pipelining(False)
                if new_frame and decoder.mid_frame:
                    frame_deadline = now + limits.read_timeout
        return "stopped"

    def _chain_ended(self) -> None:
        # A request that ended without a reply frees its slot now, not after inflight_ttl
        # (counted like a reply: requests and replies are not matched, see Inflight).
        self.inflight.replied(1)

    async def _linger(self) -> None:
        """The client closed its sending side: give owed replies a bounded time to go out."""

        def owed() -> bool:
            endpoint = self.endpoint
            return bool(self.inflight.requests) and endpoint is not None and not endpoint.closed

        if not owed():  # the usual case: no cancel scope (with its deadline) to set up
            return
        with trio.move_on_after(self.limits.read_timeout):
            while owed():
                await self.inflight.wait_reply()
