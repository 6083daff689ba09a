"""The connection handshake, sans I/O.

When boot.xml declares clients, the first frame of every connection must be an envelope
whose payload is the core ``<hello>`` (client name and token)::

    <message xmlns="https://xml-pipeline.org/ns/envelope/v1">
      <meta><from>alice</from><thread>…</thread></meta>
      <hello xmlns="https://xml-pipeline.org/ns/core/v1"><client>alice</client><token>…</token></hello>
    </message>

The server consumes it (it never reaches the pump). Anything else, or a wrong token, is
:class:`Unauthenticated`; the server then sends one canned ``<huh>`` and closes.

``<hello ack="true">`` negotiates reply acknowledgement (docs/wire.md): durable replies
then carry ``reply-id`` and the client acknowledges them with a core ``<ack>``, read by
:class:`AckReader`.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from lxml import etree

from agentserver.core.envelope import MESSAGE, build_envelope, load_envelope_schema
from agentserver.core.errors import AgentServerError, InputRefused
from agentserver.core.namespaces import CORE_NS
from agentserver.core.payloads import PayloadType, model_tree
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser
from agentserver.primitives.core import Ack, Hello

#: A hello needs little room; before authentication frames are capped at this size.
MAX_HELLO_BYTES = 4096
HELLO_TAG = f"{{{CORE_NS}}}hello"
ACK_TAG = f"{{{CORE_NS}}}ack"
#: A frame can only be an acknowledgement if it names the core namespace.
CORE_NS_BYTES = CORE_NS.encode("ascii")
#: Reply ids one ``<ack>`` may carry (more are refused like any core payload).
MAX_ACK_IDS = 1024


class Unauthenticated(AgentServerError):
    """The first frame is not a valid hello with a known client and its token.
    The reason is for the local log only."""


@dataclass(frozen=True, slots=True)
class Credential:
    """A declared client: its token (None if its variable is unset: it cannot connect)
    and the listeners it may address (None: all)."""

    token: str | None
    allowed: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a connection is, once the handshake (if any) is done."""

    name: str | None
    allowed: frozenset[str] | None = None
    #: The hello asked for reply acknowledgement.
    ack: bool = False


class HelloGate:
    """Checks hello frames against the declared clients. Not thread-safe (owns a parser)."""

    def __init__(self, clients: Mapping[str, Credential]) -> None:
        self._clients = dict(clients)
        self._parser = SafeParser(MAX_HELLO_BYTES)
        self._envelope = load_envelope_schema()
        self._hello = PayloadType.from_model(Hello)

    @property
    def required(self) -> bool:
        return bool(self._clients)

    def check(self, frame: bytes) -> Identity:
        """The identity a hello frame proves. Raises :class:`Unauthenticated`."""
        try:
            root = self._parser.parse(frame)
        except InputRefused as exc:
            raise Unauthenticated(f"unparsable first frame: {exc}") from None
        if root.tag != MESSAGE or not self._envelope.validate(root):
            raise Unauthenticated("first frame is not an envelope")
        payload = root[1]
        if payload.tag != HELLO_TAG or not self._hello.is_valid(payload):
            raise Unauthenticated(f"first frame carries {payload.tag!s}, not a hello")
        # Read the fields directly: an empty <token/> is schema-valid but has no text.
        name = (payload.findtext(f"{{{CORE_NS}}}client") or "").strip()
        given = (payload.findtext(f"{{{CORE_NS}}}token") or "").encode("utf-8")
        credential = self._clients.get(name)
        expected = credential.token if credential is not None else None
        # Compare even for unknown names so timing does not reveal which names exist.
        good = hmac.compare_digest(given, (expected or "\x00" * 32).encode("utf-8"))
        if credential is None or not expected or not good:
            raise Unauthenticated(f"bad credentials for client {name[:64]!r}")
        return Identity(name, credential.allowed, payload.get("ack") in ("true", "1"))

    def certificate_hello(self, frame: bytes, name: str | None) -> bool | None:
        """For a connection whose client certificate already named client ``name``: None
        if ``frame`` is not a hello (it is a request), else whether the hello asks for
        acknowledgement. Its token is not checked. Raises :class:`Unauthenticated` for a
        hello naming another client."""
        try:
            root = self._parser.parse(frame)
        except InputRefused:
            return None
        if root.tag != MESSAGE or len(root) < 2 or root[1].tag != HELLO_TAG:
            return None
        payload = root[1]
        if not self._envelope.validate(root) or not self._hello.is_valid(payload):
            raise Unauthenticated("a malformed hello after a client certificate")
        claimed = (payload.findtext(f"{{{CORE_NS}}}client") or "").strip()
        if claimed != name:
            raise Unauthenticated(f"hello names {claimed[:64]!r}, the certificate {name!r}")
        return payload.get("ack") in ("true", "1")


class AckReader:
    """Recognises a client's ``<ack>`` frame. Not thread-safe (owns a parser)."""

    def __init__(self, max_bytes: int) -> None:
        self._parser = SafeParser(max_bytes)
        self._envelope = load_envelope_schema()
        self._ack = PayloadType.from_model(Ack)

    def ids(self, frame: bytes) -> list[int] | None:
        """The reply ids a frame acknowledges, or None if it is not a valid ``<ack>``
        envelope (then it goes to the pump like any frame, which refuses it)."""
        if CORE_NS_BYTES not in frame:
            return None
        try:
            root = self._parser.parse(frame)
        except InputRefused:
            return None
        if root.tag != MESSAGE or not self._envelope.validate(root):
            return None
        payload = root[1]
        if payload.tag != ACK_TAG or not self._ack.is_valid(payload):
            return None
        ids = [int(el.text or "") for el in payload]  # schema-valid: each an integer
        return ids if len(ids) <= MAX_ACK_IDS else None


def hello_frame_body(client: str, token: str, *, ack: bool = False) -> bytes:
    """The envelope a client sends first (see the module docstring)."""
    payload = model_tree(Hello(client=client, token=token, ack=ack or None), exclude_none=True)
    return etree.tostring(build_envelope(client, None, new_thread_id(), payload))


def ack_frame_body(client: str, ids: list[int]) -> bytes:
    """The envelope that acknowledges the durable replies ``ids``."""
    payload = model_tree(Ack(ids=ids))
    return etree.tostring(build_envelope(client, None, new_thread_id(), payload))
