"""The hello phase of a server connection: who is connecting, before anything reaches the
pump (docs/wire.md, docs/security.md).

With clients declared, the first frame must be a valid hello (see
:mod:`agentserver.core.handshake`) within ``hello_timeout``; anything else gets one canned
``<huh>`` and the connection is closed. Failed hellos are throttled per source address
(:mod:`agentserver.core.throttle`): a slowed hello holds its connection for the delay, and
an address has at most one slowed hello waiting (more are refused at once). A client named
by its TLS certificate may still send a hello, only to ask for acknowledgement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import trio
from lxml import etree

from agentserver.core.envelope import encode
from agentserver.core.errors import HuhReason
from agentserver.core.framing import FrameDecoder, FrameTooLarge, encode_frame
from agentserver.core.handshake import MAX_HELLO_BYTES, HelloGate, Identity, Unauthenticated
from agentserver.core.threads import new_thread_id
from agentserver.core.throttle import HelloThrottle
from agentserver.net.limits import Limits
from agentserver.primitives.core import huh
from agentserver.pump.pump import SYSTEM

# The server's logger: the hello is part of serving a connection.
log = logging.getLogger("agentserver.server")

#: Bytes read from a socket at once.
RECEIVE_SIZE = 64 * 1024
#: How long a refused connection gets to take its one refusal.
REFUSAL_WRITE_TIMEOUT = 1.0
#: How long a connection named by its client certificate is given to send an (optional)
#: hello asking for acknowledgement before it is served without: the client library sends
#: it at once, so only a client that sends nothing waits this long for its kept replies.
CERT_HELLO_WAIT = 1.0


async def send_refusal(stream: trio.abc.Stream, payload: etree._Element) -> None:
    """Send a connection's one refusal, giving up after a short while or if it is gone."""
    frame = encode_frame(encode(SYSTEM, None, new_thread_id(), payload))
    with trio.move_on_after(REFUSAL_WRITE_TIMEOUT):
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(frame)


class HelloDesk:
    """Reads and checks the hellos of one server's connections. ``counters`` is the
    server's (``unauthenticated`` and ``throttled`` are counted here)."""

    def __init__(
        self,
        gate: HelloGate,
        limits: Limits,
        counters: dict[str, int],
        throttle: HelloThrottle | None = None,
    ) -> None:
        self.gate = gate
        self.limits = limits
        self.counters = counters
        self.throttle = throttle if throttle is not None else HelloThrottle()
        #: Source addresses with a slowed hello waiting (one each; more are refused).
        self._throttled: set[str] = set()

    @property
    def throttled(self) -> frozenset[str]:
        """The source addresses whose slowed hello is waiting now."""
        return frozenset(self._throttled)

    async def identify(
        self, stream: trio.abc.Stream, address: str, cert_identity: Identity | None
    ) -> tuple[Identity | None, bytes]:
        """Who the connection is, and the bytes read behind its hello (the reader starts
        with them); None if it was refused (its refusal sent). Bounded by
        ``hello_timeout`` plus the throttle's delay (``CERT_HELLO_WAIT`` with a
        certificate); cancellable. Raises trio.BrokenResourceError /
        trio.ClosedResourceError if the connection broke."""
        if cert_identity is not None:
            return await self._certificate_hello(stream, address, cert_identity)
        if not self.gate.required:
            return Identity(None), b""
        throttle = self.throttle
        decoder = FrameDecoder(MAX_HELLO_BYTES)
        frame: bytes | None = None
        with trio.move_on_after(self.limits.hello_timeout):
            try:
                while frame is None:
                    data = await stream.receive_some(MAX_HELLO_BYTES + 8)
                    if not data:
                        return None, b""
                    decoder.feed(data)
                    frame = decoder.next_frame()
            except FrameTooLarge:
                frame = None
        # Throttled only once the hello is read: closing on unread input would reset the
        # connection, and the client might never see its refusal.
        delay = throttle.delay(address, trio.current_time())
        if delay > 0:
            self.counters["throttled"] += 1
            if address in self._throttled:
                # One slowed hello per address at a time: more would only hold slots.
                await send_refusal(stream, huh(HuhReason.UNAUTHENTICATED))
                return None, b""
            self._throttled.add(address)
            try:
                await trio.sleep(delay)
            finally:
                self._throttled.discard(address)
        try:
            if frame is None:
                raise Unauthenticated("no hello in time, or an oversize first frame")
            identity = self.gate.check(frame)
        except Unauthenticated as exc:
            self.counters["unauthenticated"] += 1
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
            await send_refusal(stream, huh(HuhReason.UNAUTHENTICATED))
            return None, b""
        throttle.succeeded(address)
        # Frames sent right behind the hello are not lost: the reader starts with them.
        return identity, decoder.take_remainder()

    async def _certificate_hello(
        self, stream: trio.abc.Stream, address: str, identity: Identity
    ) -> tuple[Identity | None, bytes]:
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
                    data = await stream.receive_some(RECEIVE_SIZE)
                    if not data:
                        break
                    received += data
                    decoder.feed(data)
                    frame = decoder.next_frame()
            except FrameTooLarge:
                frame = None  # the reader refuses it, from the bytes kept below
        if frame is not None:
            try:
                ack = self.gate.certificate_hello(frame, identity.name)
            except Unauthenticated as exc:
                self.counters["unauthenticated"] += 1
                log.info("connection from %s refused: %s", address, exc)
                await send_refusal(stream, huh(HuhReason.UNAUTHENTICATED))
                return None, b""
            if ack is not None:
                return dataclasses.replace(identity, ack=ack), decoder.take_remainder()
        return identity, received
