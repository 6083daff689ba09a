"""The system primitives, in the core namespace. Only the pump emits them.

``schemas/core.xsd`` is generated from these models (``python -m agentserver.core.schemas_export``);
a test keeps the checked-in file identical to the generated one.
"""

from __future__ import annotations

import base64
import datetime
from typing import TYPE_CHECKING, Annotated, Literal

from lxml import etree
from pydantic_xml import BaseXmlModel, attr, element

from agentserver.core.errors import (
    DeliveryRefused,
    HuhReason,
    InputRefused,
    Refusal,
    SystemErrorCode,
)
from agentserver.core.namespaces import CORE_NS
from agentserver.core.payloads import model_tree
from agentserver.core.xsdgen import XsdType

#: ``original-attempt`` carries at most this many of the received bytes (before base64).
ORIGINAL_ATTEMPT_MAX_BYTES = 4096

_NSMAP = {"": CORE_NS}
HUH_TAG = f"{{{CORE_NS}}}huh"
SYSTEM_ERROR_TAG = f"{{{CORE_NS}}}SystemError"
if TYPE_CHECKING:
    # Built from the enums at run time (pydantic checks, the XSD enumerates them); to the
    # checker, the text the enums' values are.
    HuhText = str
    ErrorCode = str
else:
    HuhText = Literal[tuple(r.value for r in HuhReason)]
    ErrorCode = Literal[tuple(c.value for c in SystemErrorCode)]
Base64 = Annotated[str, XsdType("xs:base64Binary")]


class Huh(BaseXmlModel, tag="huh", nsmap=_NSMAP):
    """Canned validation error: the text is one of :class:`HuhReason`, never validator output.

    ``detail`` (the logged reason) is present only from a server run with
    ``--explain-refusals`` (development, loopback only)."""

    error: HuhText = element()
    original_attempt: Base64 = element(tag="original-attempt")
    detail: str | None = element(default=None)


class SystemErrorPayload(BaseXmlModel, tag="SystemError", nsmap=_NSMAP):
    """Routing, validation or timeout failure; the sender's thread stays alive."""

    code: ErrorCode = element()
    message: str = element()
    retry_allowed: bool = element(tag="retry-allowed")


class Boot(BaseXmlModel, tag="boot", nsmap=_NSMAP):
    """Injected once at start to the system boot listener on the root thread."""

    organism: str = element()
    timestamp: str = element()
    listener_count: int = element(tag="listener-count")


class Hello(BaseXmlModel, tag="hello", nsmap=_NSMAP):
    """Connection handshake; consumed by the server, never routed. ``ack="true"`` asks for
    reply acknowledgement: durable replies then carry ``reply-id`` and stay kept until
    the client acknowledges them with :class:`Ack` (docs/wire.md)."""

    client: str = element()
    token: str = element()
    ack: bool | None = attr(default=None)


class Ack(BaseXmlModel, tag="ack", nsmap=_NSMAP):
    """A client's acknowledgement of durable replies, by ``reply-id``; consumed by the
    server on a connection whose hello asked for acks, never routed."""

    ids: list[int] = element(tag="id", default_factory=list)


class Serve(BaseXmlModel, tag="serve", nsmap=_NSMAP):
    """A runner's announcement (docs/wire.md, "Runners"): from now on send me the jobs of
    remote listener ``listener``, at most ``concurrency`` at a time. Consumed by the
    server, never routed."""

    listener: str = attr()
    concurrency: int = attr(default=1)


class Started(BaseXmlModel, tag="started", nsmap=_NSMAP):
    """A runner's optional report, on a job's thread, that it has begun the job."""


class Done(BaseXmlModel, tag="done", nsmap=_NSMAP):
    """A runner's end of a job without an answer to the caller (after its forwards, if
    any): the in-process handler's ``None``."""


class Failed(BaseXmlModel, tag="failed", nsmap=_NSMAP):
    """A runner's report that a job failed (its handler raised): the caller gets what an
    in-process handler's exception gives, unless an idempotent listener retries it."""


class Cancel(BaseXmlModel, tag="cancel", nsmap=_NSMAP):
    """The server's notice to a runner, on a job's thread (no attributes): abandon this
    job; any result it still sends is ignored. From an operator (``agentserver cancel``):
    cancel agent ``agent``'s task sent on ``thread`` (queued: skipped; running: stopped)."""

    agent: str | None = attr(default=None)
    thread: str | None = attr(default=None)


class Stop(BaseXmlModel, tag="stop", nsmap=_NSMAP):
    """An operator's command (``agentserver stop``): end agent ``agent``'s active Turn
    (only if it is the task sent on ``thread``, when given) with a failed answer."""

    agent: str = attr()
    thread: str | None = attr(default=None)


class Outcome(BaseXmlModel, tag="outcome", nsmap=_NSMAP):
    """The server's answer to an operator command: how many tasks it ended."""

    command: str = attr()
    agent: str = attr()
    count: int = attr()


CORE_MODELS: tuple[type[BaseXmlModel], ...] = (
    Huh,
    SystemErrorPayload,
    Boot,
    Hello,
    Ack,
    Serve,
    Started,
    Done,
    Failed,
    Cancel,
    Stop,
    Outcome,
)


def boot_primitive(organism: str, listener_count: int) -> Boot:
    """The boot primitive, stamped now (ISO-8601 UTC, with ``Z``)."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return Boot(
        organism=organism, timestamp=now.replace("+00:00", "Z"), listener_count=listener_count
    )


def huh(reason: HuhReason, original: bytes = b"", detail: str | None = None) -> etree._Element:
    attempt = base64.b64encode(original[:ORIGINAL_ATTEMPT_MAX_BYTES]).decode("ascii")
    return model_tree(
        Huh(error=reason.value, original_attempt=attempt, detail=detail or None),
        exclude_none=True,
    )


def system_error(code: SystemErrorCode, *, retry_allowed: bool) -> etree._Element:
    return model_tree(
        SystemErrorPayload(code=code.value, message=code.message, retry_allowed=retry_allowed)
    )


def primitive_text(element: etree._Element) -> str | None:
    """The canned text of a ``<huh>``, the message of a ``<SystemError>``; None for any
    other element."""
    if element.tag == HUH_TAG:
        return element.findtext(f"{{{CORE_NS}}}error")
    if element.tag == SYSTEM_ERROR_TAG:
        return element.findtext(f"{{{CORE_NS}}}message")
    return None


def primitive_for(
    refusal: Refusal, original: bytes = b"", *, explain: bool = False
) -> etree._Element:
    """The single mapping from a refusal to the primitive its sender receives. With
    ``explain`` (``run --explain-refusals``) a ``<huh>`` carries the logged reason too."""
    if isinstance(refusal, InputRefused):
        return huh(refusal.reason, original, refusal.detail if explain else None)
    if isinstance(refusal, DeliveryRefused):
        return system_error(refusal.code, retry_allowed=refusal.retry_allowed)
    raise TypeError(f"no primitive for {type(refusal).__name__}")
