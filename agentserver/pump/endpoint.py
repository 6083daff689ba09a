"""Endpoints: external parties (socket clients, tests, benches) attached to the pump."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

import trio

from agentserver.core.errors import EndpointClosed

if TYPE_CHECKING:
    from agentserver.core.threads import ThreadQuota

log = logging.getLogger("agentserver.endpoint")

#: Default bound on the bytes waiting for one endpoint (see :class:`Endpoint`).
DEFAULT_BUFFER_BYTES = 16 * 1024 * 1024

_Channel = tuple[trio.MemorySendChannel[bytes], trio.MemoryReceiveChannel[bytes]]

#: ``sink(data) -> bool``: see :class:`Endpoint`.
Sink = Callable[[bytes], bool]


class EndpointOwner(Protocol):
    """What an endpoint needs of the pump it is attached to. The Pump satisfies it; it is
    declared here so that the endpoint does not import the pump (which imports it)."""

    def inject(self, data: bytes, endpoint: Endpoint) -> Coroutine[Any, Any, None]:
        """Validate and route one envelope (see ``Pump.inject``)."""
        ...

    def inject_now(self, data: bytes, endpoint: Endpoint) -> Coroutine[Any, Any, None] | None:
        """``inject``'s synchronous part (see ``Pump.inject_now``)."""
        ...

    def detach_endpoint(self, endpoint: Endpoint) -> None:
        """Forget ``endpoint``, which has just closed. Must not block."""
        ...


class Endpoint:
    """One external party. Messages it sends carry its name as ``<from>``, whatever they say.

    Outbound messages (canonical envelope bytes) wait in a buffer of at most ``buffer``
    messages and ``buffer_bytes`` bytes (a message always fits an empty buffer, however
    large). The pump never blocks on an endpoint: if the buffer is full the endpoint is
    closed (a client that stops reading is disconnected rather than allowed to grow
    memory), and further messages for it are dropped and logged.

    Its owner's hooks are given here and kept until :meth:`release`: ``sink(data) -> bool``
    is offered each outbound message before it is buffered; True means it took the message
    (a server writes a reply straight to an idle socket). A sink must not block, and must
    decline whenever buffered messages could then be overtaken. ``on_chain_end()`` is
    called, without blocking, each time a request of this endpoint ends without an answer
    (see :meth:`chain_ended`).
    """

    def __init__(
        self,
        pump: EndpointOwner,
        name: str,
        buffer: int,
        allowed: frozenset[str] | None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        *,
        quota: ThreadQuota | None = None,
        sink: Sink | None = None,
        on_chain_end: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        #: The call chain of this endpoint's own conversation threads.
        self.chain: tuple[str, ...] = (name,)
        #: Listener names this endpoint may address; None means all.
        self.allowed = allowed
        self._pump = pump
        # The outgoing channel is made on first use: an HTTP message's endpoint (one per
        # message) hands every reply to its sink and never needs one, and making a trio
        # channel costs about a third of an echo delivery.
        self._buffer = buffer
        self._out: _Channel | None = None
        self._max_bytes = buffer_bytes
        #: Bytes of the messages waiting in the buffer.
        self.buffered_bytes = 0
        self.closed = False
        # Plain attributes, read once per message (no holder, no wrapper call): push and
        # chain_ended are on the pump's hot path.
        self.sink = sink
        self.overflowed = False
        self.dropped = 0
        #: The share of the thread registry this endpoint's conversations may hold (the
        #: pump's ``max_threads_per_endpoint``); None: unbounded.
        self.quota = quota
        self.on_chain_end = on_chain_end
        #: Requests that ended without an answer.
        self.unanswered = 0
        #: The last conversation thread id of this endpoint found to be a uuid4 (the
        #: pump's fast path checks a new one only).
        self.last_thread = ""

    def send(self, data: bytes) -> Coroutine[Any, Any, None]:
        """Inject one envelope: ``await endpoint.send(data)``. Waits while the target
        listener's queue is full (bounded by the pump's delivery timeout). Raises
        EndpointClosed once closed, PumpClosed when the pump is shutting down."""
        # Returns the pump's coroutine rather than wrapping it in another one: this is
        # the hot path of every inbound message.
        if self.closed:
            raise EndpointClosed(self.name)
        return self._pump.inject(data, self)

    def send_now(self, data: bytes) -> Coroutine[Any, Any, None] | None:
        """Inject one envelope as far as it goes without waiting: None if it was dealt
        with, else a coroutine that does the rest, which must be awaited (see
        :meth:`Pump.inject_now`). Raises like :meth:`send`."""
        if self.closed:
            raise EndpointClosed(self.name)
        return self._pump.inject_now(data, self)

    def _channel(self) -> _Channel:
        out = self._out
        if out is None:
            out = self._out = trio.open_memory_channel[bytes](self._buffer)
            if self.closed:  # closed before anything was buffered: drained already
                out[0].close()
        return out

    async def receive(self) -> bytes:
        """The next outbound envelope. Raises EndpointClosed once closed and drained."""
        try:
            data = await self._channel()[1].receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise EndpointClosed(self.name) from None
        self.buffered_bytes -= len(data)
        return data

    def receive_nowait(self) -> bytes:
        """Like :meth:`receive`, raising ``trio.WouldBlock`` when nothing is waiting."""
        try:
            data = self._channel()[1].receive_nowait()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise EndpointClosed(self.name) from None
        self.buffered_bytes -= len(data)
        return data

    def __aiter__(self) -> Endpoint:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.receive()
        except EndpointClosed:
            raise StopAsyncIteration from None

    def chain_ended(self) -> None:
        """The pump ended one of this endpoint's requests without an answer: its handler
        returned ``None`` (or was released), or the last hop of its chain did (one call per
        hop: a broadcast request ends once per target). A server frees its in-flight slot."""
        self.unanswered += 1
        if self.on_chain_end is not None:
            self.on_chain_end()

    def push(self, data: bytes) -> bool:
        """Queue ``data`` for the endpoint without blocking. False if it was dropped."""
        if self.closed:
            self.dropped += 1
            return False
        if self.sink is not None and self.sink(data):
            return True
        size = len(data)
        if self.buffered_bytes + size <= self._max_bytes or not self.buffered_bytes:
            try:
                self._channel()[0].send_nowait(data)
                self.buffered_bytes += size
                return True
            except trio.WouldBlock:
                pass
        log.warning("endpoint %s stopped reading: closing it", self.name)
        self.overflowed = True
        self.dropped += 1
        self.close()
        return False

    def release(self) -> None:
        """Its owner is done with it: forget the hooks given at creation (no call reaches
        the owner any more, even from a delivery still in flight), then :meth:`close`.
        Synchronous; idempotent."""
        self.sink = None
        self.on_chain_end = None
        self.close()

    def close(self) -> None:
        """Stop accepting and delivering; already-buffered messages can still be received.
        Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._out is not None:
            self._out[0].close()
        self._pump.detach_endpoint(self)
