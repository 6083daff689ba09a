"""A TLS stream of our own: ``ssl.SSLObject`` over two ``ssl.MemoryBIO`` s, on the socket.

:class:`TlsStream` is a ``trio.abc.Stream`` (the hello, the writer task and the client use
it as they would ``trio.SSLStream``) and, besides, a synchronous non-blocking handle like
the plaintext connection's duplicate socket: :meth:`TlsStream.recv` decrypts whatever the
socket has without waiting, :meth:`TlsStream.send` encrypts and makes one non-blocking
``send``. So the server connection's direct read and batched direct write apply under TLS
as in plaintext (docs/security.md, "Cost"): no lock, no extra scheduler round per read or
write, one record and one syscall for the replies to one read.

Ciphertext the socket does not take is kept here (:attr:`TlsStream.owes`) and sent first
by the next :meth:`send_all` (the connection's writer), so records never interleave:
nothing written is ever encrypted twice or dropped.

Atomic: every synchronous method (recv, send) either completes or raises before changing
anything visible to the peer. Bounded: what one :meth:`recv` returns is what the socket
had (at most ``RECEIVE_SIZE`` bytes of ciphertext per call, decrypted); unsent ciphertext
is what the caller wrote and the socket has not taken yet. Cancelling :meth:`send_all`
leaves the unsent ciphertext kept, the stream usable. The handshake is not bounded here:
the caller bounds it (the server by ``read_timeout``).

Renegotiation is refused (``OP_NO_RENEGOTIATION`` on the contexts of
:mod:`agentserver.net.tls`; TLS 1.3 has none). A ``close_notify`` from the peer is the end
of input (``b""``); an end of TCP without it is a broken connection (a truncation).
:meth:`aclose` sends ours before closing the socket.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Mapping
from typing import Any, Literal, overload

import trio

#: Bytes of ciphertext read from the socket at once.
RECEIVE_SIZE = 64 * 1024
_NO_SIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


class TlsTruncated(ssl.SSLEOFError):
    """The peer closed the TCP connection without a ``close_notify``."""


class TlsStream(trio.abc.Stream):
    """TLS on ``transport`` (a connected ``trio.SocketStream``), server or client side.
    Call :meth:`do_handshake` first. ``session``: a client's session to resume (see
    :class:`agentserver.net.connect.TlsSessions`); ignored if it is from another context.

    Owns a duplicate of the socket's descriptor for its synchronous reads and writes;
    :meth:`aclose` (or :meth:`discard`, after a failed handshake) closes it and the
    transport."""

    def __init__(
        self,
        transport: trio.SocketStream,
        context: ssl.SSLContext,
        *,
        server_side: bool = False,
        server_hostname: str | None = None,
        session: ssl.SSLSession | None = None,
    ) -> None:
        self.transport = transport
        self._server_side = server_side
        #: trio's socket: waited on for readiness (it tells trio's I/O manager when it
        #: closes), never read or written here.
        self.socket = transport.socket
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(
            self._incoming,
            self._outgoing,
            server_side=server_side,
            server_hostname=server_hostname,
            session=session,
        )
        self._raw = socket.socket(fileno=os.dup(transport.socket.fileno()))
        self._raw.setblocking(False)
        #: Ciphertext written and not yet taken by the socket.
        self._unsent = b""
        #: Plaintext decrypted beyond what receive_some's caller asked for.
        self._left = b""
        self._handshaken = False
        self._eof = False
        self._closed = False

    # -- what the handshake said ---------------------------------------------------------

    @overload
    def getpeercert(self, binary_form: Literal[False] = False) -> Mapping[str, Any] | None: ...

    @overload
    def getpeercert(self, binary_form: Literal[True]) -> bytes | None: ...

    def getpeercert(self, binary_form: bool = False) -> Mapping[str, Any] | bytes | None:
        """As ``ssl.SSLObject.getpeercert``: the decoded certificate, or its DER bytes."""
        return self._ssl.getpeercert(binary_form)

    @property
    def session(self) -> ssl.SSLSession | None:
        """The session to resume on the next connection (a client's; TLS 1.3 tickets come
        after the handshake, so it is usable once something was read)."""
        return self._ssl.session

    @property
    def session_reused(self) -> bool:
        """True if the handshake resumed a session (no certificate exchanged)."""
        return self._ssl.session_reused

    def version(self) -> str | None:
        return self._ssl.version()

    @property
    def owes(self) -> bool:
        """True while ciphertext written waits for the socket (the next :meth:`send_all`
        sends it first)."""
        return bool(self._unsent)

    # -- the handshake -------------------------------------------------------------------

    async def do_handshake(self) -> None:
        """Run the handshake. Raises trio.BrokenResourceError (its ``__cause__`` the
        ``ssl.SSLError``, or None if the peer closed) when it fails. Unbounded: the caller
        sets the deadline. Cancellable (the stream is then unusable: discard it)."""
        # A server has nothing to say before the client's hello: wait for it first (OpenSSL
        # called on an empty buffer only raises SSLWantReadError, an exception per
        # connection for nothing).
        need_input = self._server_side
        while True:
            if need_input:
                try:
                    data = await self._receive_raw()
                except OSError as exc:
                    raise trio.BrokenResourceError(str(exc)) from exc
                if not data:
                    raise trio.BrokenResourceError("the peer closed the connection")
                self._incoming.write(data)
            try:
                self._ssl.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                done = False
            except ssl.SSLError as exc:
                self._take_output()
                self._send_unsent_nowait()  # the alert, if the socket takes it
                raise trio.BrokenResourceError(str(exc)) from exc
            self._take_output()
            await self._send_unsent()
            if done:
                break
            need_input = True
        self._handshaken = True

    # -- synchronous, non-blocking: the connection's direct handle -----------------------

    def recv(self, bufsize: int = RECEIVE_SIZE) -> bytes:
        """The plaintext the socket has now, decrypted (possibly more than ``bufsize``:
        whole records); b"" once the peer's ``close_notify`` came. Raises BlockingIOError
        if nothing can be returned without waiting, an OSError (``ssl.SSLError``,
        :class:`TlsTruncated`) if the connection broke."""
        if self._left:  # what receive_some could not return
            data, self._left = self._left, b""
            return data
        data = self._decrypt()
        while not data and not self._eof:
            raw = self._raw.recv(RECEIVE_SIZE)  # BlockingIOError: nothing there
            if not raw:
                raise TlsTruncated("the peer closed the connection without close_notify")
            self._incoming.write(raw)
            data = self._decrypt()
        return data

    def send(self, data: bytes, flags: int = 0) -> int:
        """Encrypt ``data`` and make one non-blocking ``send`` of everything unsent. Always
        takes all of ``data`` (returns its length): what the socket did not take is kept
        (:attr:`owes`) for the next :meth:`send_all`. Never raises for the socket (a
        broken one is found by the next send_all or recv); raises ``ssl.SSLError`` (an
        OSError), having taken nothing, if the TLS session has failed."""
        self._ssl.write(data)
        self._take_output()
        self._send_unsent_nowait()
        return len(data)

    def _decrypt(self) -> bytes:
        """Every byte of plaintext the records already received hold."""
        chunks = []
        ssl_object, incoming = self._ssl, self._incoming
        # Read only while something is buffered: a read that finds nothing raises, and
        # that exception costs more than the decryption of a small record.
        while incoming.pending or ssl_object.pending():
            try:
                chunk = ssl_object.read(RECEIVE_SIZE)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                self._eof = True
                break
            if not chunk:  # close_notify (CPython returns b"" for it)
                self._eof = True
                break
            chunks.append(chunk)
        if self._outgoing.pending:
            # Post-handshake messages answered (a key update): sent with the next write.
            self._take_output()
            self._send_unsent_nowait()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _take_output(self) -> None:
        if self._outgoing.pending:
            out = self._outgoing.read()
            self._unsent = self._unsent + out if self._unsent else out

    def _send_unsent_nowait(self) -> None:
        if not self._unsent:
            return
        try:
            sent = self._raw.send(self._unsent, _NO_SIGNAL)
        except OSError:  # full, or broken (the next send_all or recv finds out)
            return
        self._unsent = self._unsent[sent:]

    # -- trio.abc.Stream -------------------------------------------------------------------

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """What :meth:`recv` returns, waiting for the socket when it has nothing; at most
        ``max_bytes`` (the rest is returned next). Raises trio.BrokenResourceError if the
        connection broke. A checkpoint."""
        if self._closed:
            raise trio.ClosedResourceError("the TLS stream is closed")
        await trio.lowlevel.checkpoint()
        while True:
            try:
                data = self.recv()
                break
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.socket)
            except OSError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
        if max_bytes is not None and len(data) > max_bytes:
            data, self._left = data[:max_bytes], data[max_bytes:]
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send what is unsent, then ``data``, encrypted. Raises trio.BrokenResourceError
        if the connection broke. Cancelled, the rest stays unsent (kept, in order)."""
        if self._closed:
            raise trio.ClosedResourceError("the TLS stream is closed")
        await trio.lowlevel.checkpoint_if_cancelled()
        if data:
            try:
                self._ssl.write(data)
            except ssl.SSLError as exc:  # the TLS session failed (a bad record read)
                raise trio.BrokenResourceError(str(exc)) from exc
            self._take_output()
        await self._send_unsent()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self.socket)

    async def _send_unsent(self) -> None:
        while self._unsent:
            try:
                sent = self._raw.send(self._unsent, _NO_SIGNAL)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.socket)
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
            self._unsent = self._unsent[sent:]

    async def _receive_raw(self) -> bytes:
        while True:
            try:
                return self._raw.recv(RECEIVE_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.socket)

    def discard(self) -> None:
        """Close the duplicate descriptor (after a failed handshake: the caller closes the
        transport). Idempotent."""
        if not self._closed:
            self._closed = True
            self._raw.close()

    async def aclose(self) -> None:
        """Send what is unsent and a ``close_notify`` (if the handshake was done), then
        close the socket. Unbounded but for the peer's reading: callers bound it. The
        socket is closed whatever happens, cancellation included."""
        if self._closed:
            return
        try:
            if self._handshaken:
                try:
                    self._ssl.unwrap()
                except ssl.SSLError:
                    pass  # SSLWantReadError: the peer's close_notify is not awaited
                self._take_output()
                try:
                    await self._send_unsent()
                except trio.BrokenResourceError:
                    pass
        finally:
            self.discard()
            await self.transport.aclose()
