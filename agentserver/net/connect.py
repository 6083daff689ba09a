"""Opening a client's connection: TCP, and TLS over it when asked (the context built
from ca/cert/key, the handshake's failure explained, a session resumed on reconnection:
:class:`TlsSessions`)."""

from __future__ import annotations

import os
import ssl

import trio

from agentserver.net.reply import TlsHandshakeError
from agentserver.net.tlsstream import TlsStream

PathLike = str | os.PathLike[str]


def tls_context(
    tls: bool | ssl.SSLContext,
    *,
    ca: PathLike | None = None,
    cert: PathLike | None = None,
    key: PathLike | None = None,
    sessions: TlsSessions | None = None,
) -> ssl.SSLContext | None:
    """The client's TLS context, or None for plaintext. ``ca``, ``cert`` or ``key`` turn
    TLS on by themselves; a ready context is used as is (and excludes them). With
    ``sessions``, the context it built for the same files before (so that its sessions
    resume)."""
    if isinstance(tls, ssl.SSLContext):
        if ca is not None or cert is not None or key is not None:
            raise ValueError("pass ca/cert/key or an SSLContext, not both")
        return tls
    if not tls and ca is None and cert is None and key is None:
        return None
    if sessions is not None:
        return sessions.context(ca=ca, cert=cert, key=key)
    from agentserver.net.tls import client_context

    return client_context(ca=ca, cert=cert, key=key)


class TlsSessions:
    """What a client remembers between its connections so that a reconnection resumes
    its TLS session (TLS 1.3 tickets: no certificates exchanged or verified, no
    signature): the context built for each ``ca``/``cert``/``key`` (a session resumes
    only with the context it was made with) and the last session per server.

    Give the same one to every :func:`~agentserver.net.client.open_client` (or
    :func:`connect_stream`) of a client. Bounded: one context per distinct
    ``ca``/``cert``/``key`` and one session per (host, port, context) used. Not shared
    across processes (``ssl`` cannot serialize a session)."""

    def __init__(self) -> None:
        self._contexts: dict[tuple[str | None, str | None, str | None], ssl.SSLContext] = {}
        self._sessions: dict[tuple[str, int, int], ssl.SSLSession] = {}
        #: Connections that resumed a session, and those that did a full handshake.
        self.resumed = 0
        self.full = 0

    def context(
        self, *, ca: PathLike | None, cert: PathLike | None, key: PathLike | None
    ) -> ssl.SSLContext:
        """The context for these files, built once (see :func:`tls_context`)."""
        paths = tuple(None if p is None else os.fspath(p) for p in (ca, cert, key))
        found = self._contexts.get(paths)  # type: ignore[arg-type]
        if found is None:
            from agentserver.net.tls import client_context

            found = self._contexts[paths] = client_context(ca=ca, cert=cert, key=key)  # type: ignore[index]
        return found

    def session(self, host: str, port: int, context: ssl.SSLContext) -> ssl.SSLSession | None:
        """The session to resume with ``host:port`` over ``context``, if one was kept."""
        return self._sessions.get((host, port, id(context)))

    def remember(self, host: str, port: int, context: ssl.SSLContext, stream: TlsStream) -> None:
        """Keep ``stream``'s session for the next connection, if it carries a ticket."""
        session = stream.session
        key = (host, port, id(context))
        if session is not None and session.has_ticket:
            self._sessions[key] = session
        if stream.session_reused:
            self.resumed += 1
        else:
            self.full += 1


def handshake_failure(host: str, port: int, exc: BaseException) -> TlsHandshakeError:
    """The error to raise for a failed TLS handshake, saying what most likely went wrong."""
    cause = exc.__cause__
    if isinstance(cause, ssl.SSLCertVerificationError):
        detail = cause.verify_message or str(cause)
        return TlsHandshakeError(
            f"TLS to {host}:{port}: the server's certificate is not accepted ({detail}); "
            "is the CA that signed it given (ca=, --ca, $AGENTSERVER_CA)?"
        )
    if isinstance(cause, ssl.SSLError):
        return TlsHandshakeError(f"TLS to {host}:{port} failed: {cause.reason or cause}")
    return TlsHandshakeError(
        f"TLS to {host}:{port} failed: the server closed the connection during the handshake "
        "(it may not speak TLS, or refused our certificate)"
    )


async def connect_stream(
    host: str,
    port: int,
    context: ssl.SSLContext | None,
    server_hostname: str | None,
    *,
    sessions: TlsSessions | None = None,
) -> trio.abc.Stream:
    """A TCP stream to ``host:port``, wrapped in a :class:`TlsStream` (handshake done)
    when ``context`` is given, resuming the session ``sessions`` kept for that server if
    any (the caller hands the stream back with ``sessions.remember`` when done). Raises
    :class:`TlsHandshakeError` when the handshake fails; the TCP stream is closed on any
    failure or cancellation."""
    tcp = await trio.open_tcp_stream(host, port)
    if context is None:
        return tcp
    session = sessions.session(host, port, context) if sessions is not None else None
    try:
        stream = TlsStream(tcp, context, server_hostname=server_hostname or host, session=session)
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    try:
        await stream.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        stream.discard()
        await tcp.aclose()
        raise handshake_failure(host, port, exc) from None
    except BaseException:
        stream.discard()
        await trio.aclose_forcefully(tcp)
        raise
    return stream
