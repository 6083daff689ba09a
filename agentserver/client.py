"""Talking to a running server from Python: the trio client (docs/wire.md).

    from agentserver.client import open_client

    async with open_client("127.0.0.1", 7340) as client:
        reply = await client.request(Ping(text="hi"), to="echo", timeout=5)

One of the package's face modules (docs/api.md): the names in ``__all__`` are public and
keep their meaning across releases; the modules they come from are internal and may move.
"""

from agentserver.net.client import Client, open_client
from agentserver.net.connect import TlsSessions
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
)

__all__ = [
    "AuthenticationRefused",
    "Client",
    "ClientError",
    "ConnectionClosed",
    "DeliveredIds",
    "ProtocolError",
    "Reply",
    "RequestTimeout",
    "TlsHandshakeError",
    "TlsSessions",
    "approval_ack_status",
    "approval_request",
    "open_client",
]
