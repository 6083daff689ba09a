"""The writing half of a server connection: replies out, batched, in order.

A writer task takes every reply that is ready from the connection's endpoint and writes
them with one ``send_all``. On a plaintext connection most replies skip it: the reader
collects the replies produced while it injects one read's requests and writes them with
one non-blocking ``send`` (:meth:`ReplyWriter.start_batch`, :meth:`ReplyWriter.flush`); a
reply produced by another task, for a client with one request at a time, is sent at once
by that task (:meth:`ReplyWriter.write_now`). Either saves the writer's wake-up and write.
Whatever a non-blocking send does not take is carried over to the writer, which sends it
before anything else, so replies never overtake one another. A TLS connection's
:class:`~agentserver.net.tlsstream.TlsStream` is its own direct handle: it encrypts what
it is given at once and keeps the ciphertext the socket did not take (``owes``), which the
writer's next ``send_all`` sends first.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Callable
from typing import Protocol

import trio

from agentserver.core.errors import EndpointClosed
from agentserver.core.framing import encode_frame, encode_frames
from agentserver.net.inflight import Inflight
from agentserver.net.tlsstream import TlsStream
from agentserver.pump.endpoint import Endpoint, Sink

# The server's logger: writing replies is the server's work.
log = logging.getLogger("agentserver.server")

#: Replies written with one ``send_all`` at most (bounds one write's size and latency).
MAX_BATCH = 256
#: The reader writes the replies it collects once they reach this many bytes, if not
#: before (bounds the memory they hold outside the endpoint's buffer).
MAX_BATCH_BYTES = 256 * 1024
#: Scheduler rounds a writer waits at most for more of the replies it is owed.
_MAX_GATHER_ROUNDS = 4
#: Queued to wake a writer that has a carry to send (see ReplyWriter.write_now). Not a
#: reply: a reply is an envelope, never empty.
_WAKE = b""
_NO_SIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


class DirectHandle(Protocol):
    """What the reader and the writer use for synchronous, non-blocking reads and writes:
    a plain socket (a duplicate of a plaintext connection's) or a :class:`TlsStream`."""

    def recv(self, bufsize: int, /) -> bytes: ...

    def send(self, data: bytes, flags: int = 0, /) -> int: ...


def direct_handle(stream: trio.abc.Stream) -> DirectHandle | None:
    """A plain non-blocking socket object on a duplicate of the stream's descriptor, for
    synchronous reads and writes; the stream itself for a :class:`TlsStream` (which
    encrypts what it sends); None where neither is possible. The caller closes a socket
    it got before the stream (an open duplicate would keep the socket open)."""
    if isinstance(stream, TlsStream):
        return stream
    if not isinstance(stream, trio.SocketStream):
        return None
    try:
        direct = socket.socket(fileno=os.dup(stream.socket.fileno()))
        direct.setblocking(False)
    except OSError:
        return None
    return direct


class ReplyWriter:
    """Writes one connection's replies (see the module docstring). ``direct``: the
    connection's :func:`direct_handle` (None: every reply goes through :meth:`run`).

    The writer opens the connection's endpoint (:attr:`endpoint`) with
    ``open_endpoint(sink)``, last in its constructor: the endpoint's sink is the writer's
    :meth:`write_now` when there is a direct handle and ``direct_writes``, else None. What
    ``open_endpoint`` raises (PumpClosed) propagates; the caller then closes ``direct``."""

    def __init__(
        self,
        open_endpoint: Callable[[Sink | None], Endpoint],
        stream: trio.abc.Stream,
        direct: DirectHandle | None,
        inflight: Inflight,
        counters: dict[str, int],
        write_timeout: float,
        *,
        direct_writes: bool = True,
    ) -> None:
        self._stream = stream
        #: A second handle on the socket, for the writes that cannot block (write_now).
        self._direct = direct
        #: The TLS stream when ``direct`` is one: its unsent ciphertext is a carry too.
        self._tls = direct if isinstance(direct, TlsStream) else None
        self.inflight = inflight
        self._counters = counters
        self._write_timeout = write_timeout
        #: True while the writer waits with nothing queued or half-written.
        self._writer_idle = False
        #: True while the client sends several requests per read: its replies are
        #: batched by the writer rather than written one by one.
        self._pipelining = False
        #: What the socket did not take of a direct write; the writer sends it first.
        self._carry = b""
        #: The replies produced while the reader injects one read's requests, written
        #: together when it is done with them (see start_batch); None when not collecting.
        self._batch: list[bytes] | None = None
        self._batch_bytes = 0
        # Last: the endpoint may call write_now as soon as it exists.
        sink = self.write_now if direct is not None and direct_writes else None
        #: The connection's endpoint (made by ``open_endpoint``).
        self.endpoint = open_endpoint(sink)

    def pipelining(self, on: bool) -> None:
        """The client sends several requests per read (``on``), or one at a time again:
        while it does, replies are batched by the writer rather than written one by one."""
        self._pipelining = on

    # -- writing -------------------------------------------------------------------------

    def start_batch(self) -> None:
        """Collect the replies produced from now on, for one write by :meth:`flush`, if
        nothing is queued for the writer or half-written (they would be overtaken)."""
        if self._writer_idle and not self._carry and not (self._tls and self._tls.owes):
            self._batch = []
            self._batch_bytes = 0

    def flush(self) -> None:
        """Stop collecting replies, and write those collected with one non-blocking send;
        what the socket does not take is carried over to the writer, which is woken to
        send it before anything else (as :meth:`write_now` does)."""
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
        self.inflight.replied(count)
        counters = self._counters
        counters["replies"] += count
        counters["writes"] += 1
        if sent < len(data) or (self._tls is not None and self._tls.owes):
            counters["carried"] += 1
            self._carry = data[sent:]  # b"" for TLS: the stream keeps its ciphertext
            self._writer_idle = False
            self.endpoint.push(_WAKE)  # queued (the writer is no longer idle): wakes it

    def write_now(self, body: bytes) -> bool:
        """The endpoint's sink: write one reply straight to the socket, from whichever
        task produced it, when that can neither reorder nor block anything. That is when
        the writer waits with nothing queued or half-written, this is the last reply owed
        and the client is not pipelining (else the writer batches replies into one write).
        While the reader collects the replies to what it read (see :meth:`start_batch`),
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
                self.flush()
                self.start_batch()
            return True
        if not self._writer_idle or self._pipelining or len(self.inflight.requests) > 1:
            # Queued for the writer, which that wakes: later replies must queue behind it.
            self._writer_idle = False
            return False
        frame = encode_frame(body)
        assert self._direct is not None  # the sink is only set with a direct handle
        try:
            sent = self._direct.send(frame, _NO_SIGNAL)
        except OSError:  # full (nothing sent) or broken: the writer finds out
            self._writer_idle = False
            return False
        self._sent([body], frame, sent)
        return True

    async def run(self, connection_scope: trio.CancelScope) -> None:
        """Write replies as they are produced, batching whatever is ready into one write,
        until the endpoint is closed and drained; then (or when a write fails, or blocks
        for ``write_timeout``) cancel ``connection_scope``: nothing more can be written."""
        endpoint = self.endpoint
        stream = self._stream
        write_timeout = self._write_timeout
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
        counters = self._counters

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
                # The rest of a direct write: the frame must end whole.
                if self._carry or (self._tls is not None and self._tls.owes):
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
                if len(batch) >= MAX_BATCH or len(self.inflight.requests) <= len(batch):
                    break
                await trio.lowlevel.cancel_shielded_checkpoint()
                if not self._collect(endpoint, batch):
                    break
            replies = [body for body in batch if body]  # an empty one is a _WAKE
            data = encode_frames(replies)
            if self._carry:
                data, self._carry = self._carry + data, b""
            self.inflight.replied(len(replies))
            counters["replies"] += len(replies)
            counters["queued"] += len(replies)
            # Even with nothing new: an empty write sends what a TLS stream still owes
            # (ciphertext a direct send left behind, the reason the writer was woken).
            await write(data)
