"""What a client reads from the server: a :class:`Reply` parsed from an envelope, the ids
of the durable replies already handed over (:class:`DeliveredIds`), the approval
vocabulary read off a reply, and the client's errors."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from lxml import etree
from pydantic_xml import BaseXmlModel

from agentserver.core.envelope import MESSAGE
from agentserver.core.errors import AgentServerError, InputRefused
from agentserver.core.listener import to_element
from agentserver.core.namespaces import ENVELOPE_NS
from agentserver.core.payloads import model_from_tree
from agentserver.core.xmlsafe import SafeParser
from agentserver.primitives.approval import NS, REQUEST_TAG, ApprovalRequest
from agentserver.primitives.core import HUH_TAG, SYSTEM_ERROR_TAG, primitive_text

_E = f"{{{ENVELOPE_NS}}}"


class ClientError(AgentServerError):
    """Base of the client's errors."""


class ConnectionClosed(ClientError):
    """The server closed the connection (or it broke)."""


class AuthenticationRefused(ConnectionClosed):
    """The server refused the connection's hello (or the lack of one): it declares
    clients, and this connection named none, or a wrong token (the server's canned
    ``<huh>`` ``Authentication required.``, then the close)."""


class RequestTimeout(ClientError):
    """No reply on the request's thread within the timeout."""


class ProtocolError(ClientError):
    """The server sent something that is not a valid framed envelope."""


class TlsHandshakeError(ConnectionClosed):
    """The TLS handshake failed: the server's certificate is not trusted or not for this
    host name, the server refused ours, or the server does not speak TLS."""


@dataclass(frozen=True, slots=True)
class Reply:
    """One envelope from the server."""

    from_id: str
    to: str | None
    thread: str
    payload: etree._Element
    raw: bytes
    #: The ``reply-id`` of a durable reply (on a connection that asked for acks), else None.
    id: int | None = None

    @property
    def is_huh(self) -> bool:
        return self.payload.tag == HUH_TAG

    @property
    def is_system_error(self) -> bool:
        return self.payload.tag == SYSTEM_ERROR_TAG

    @property
    def is_error(self) -> bool:
        """True for ``<huh>`` and ``<SystemError>``."""
        return self.is_huh or self.is_system_error

    @property
    def error_text(self) -> str | None:
        """The canned text of a ``<huh>`` / the message of a ``<SystemError>``; else None."""
        return primitive_text(self.payload)

    @property
    def payload_xml(self) -> str:
        return etree.tostring(self.payload, encoding="unicode")


def parse_reply(data: bytes, parser: SafeParser) -> Reply:
    """An envelope from the server. Raises :class:`ProtocolError`."""
    try:
        root = parser.parse(data)
    except InputRefused as exc:
        raise ProtocolError(f"unparsable reply: {exc}") from None
    if root.tag != MESSAGE or len(root) != 2:
        raise ProtocolError("reply is not an envelope")
    meta, payload = root[0], root[1]
    reply_id = root.get("reply-id")
    if reply_id is not None and not reply_id.isdigit():
        raise ProtocolError(f"reply-id {reply_id[:32]!r} is not a number")
    return Reply(
        (meta.findtext(_E + "from") or "").strip(),
        (meta.findtext(_E + "to") or "").strip() or None,
        (meta.findtext(_E + "thread") or "").strip(),
        payload,
        data,
        int(reply_id) if reply_id is not None else None,
    )


class DeliveredIds:
    """The ids of the durable replies handed to the application (the most recent
    ``capacity``). Share one between the connections of a client so that a reply sent
    again after a reconnect (its acknowledgement was lost) is dropped."""

    def __init__(self, capacity: int = 65536) -> None:
        self._order: collections.deque[int] = collections.deque()
        self._ids: set[int] = set()
        self._capacity = capacity

    def __contains__(self, reply_id: int) -> bool:
        return reply_id in self._ids

    def add(self, reply_id: int) -> None:
        if reply_id in self._ids:
            return
        self._ids.add(reply_id)
        self._order.append(reply_id)
        while len(self._order) > self._capacity:
            self._ids.discard(self._order.popleft())


def payload_element(payload: BaseXmlModel | etree._Element | bytes | str) -> etree._Element:
    """A payload as an element. Bytes and str are parsed with the hardened parser."""
    if isinstance(payload, str):
        payload = payload.encode("utf-8")
    if isinstance(payload, bytes):
        return SafeParser().parse(payload.strip())
    return to_element(payload)


def approval_request(reply: Reply) -> dict[str, str] | None:
    """The fields of an ``<approval-request>`` (request, agent, thread, target, rule,
    timeout, payload), or None if ``reply`` is something else (docs/agents.md)."""
    if reply.payload.tag != REQUEST_TAG:
        return None
    model = model_from_tree(ApprovalRequest, reply.payload)
    return {k: str(v) for k, v in model.model_dump().items()}


def approval_ack_status(reply: Reply) -> str | None:
    """The status of an ``<approval-ack>`` (applied, duplicate, unknown, not-yours)."""
    if reply.payload.tag != f"{{{NS}}}approval-ack":
        return None
    return reply.payload.get("status")
