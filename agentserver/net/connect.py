"""Opening a client's connection: TCP, and TLS over it when asked (the context built
from ca/cert/key, the handshake's failure explained)."""

from __future__ import annotations

import os
import ssl

import trio

from agentserver.net.reply import TlsHandshakeError

PathLike = str | os.PathLike[str]


def tls_context(
    tls: bool | ssl.SSLContext,
    *,
    ca: PathLike | None = None,
    cert: PathLike | None = None,
    key: PathLike | None = None,
) -> ssl.SSLContext | None:
    """The client's TLS context, or None for plaintext. ``ca``, ``cert`` or ``key`` turn
    TLS on by themselves; a ready context is used as is (and excludes them)."""
    if isinstance(tls, ssl.SSLContext):
        if ca is not None or cert is not None or key is not None:
            raise ValueError("pass ca/cert/key or an SSLContext, not both")
        return tls
    if not tls and ca is None and cert is None and key is None:
        return None
    from agentserver.net.tls import client_context

    return client_context(ca=ca, cert=cert, key=key)


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
    host: str, port: int, context: ssl.SSLContext | None, server_hostname: str | None
) -> trio.abc.Stream:
    """A TCP stream to ``host:port``, wrapped in TLS (handshake done) when ``context`` is
    given. Raises :class:`TlsHandshakeError` when the handshake fails; the TCP stream is
    closed on any failure or cancellation."""
    tcp = await trio.open_tcp_stream(host, port)
    if context is None:
        return tcp
    stream = trio.SSLStream(tcp, context, server_hostname=server_hostname or host)
    try:
        await stream.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        await tcp.aclose()
        raise handshake_failure(host, port, exc) from None
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    return stream
