"""Typed errors. Refusals map to system primitives in exactly one place:
:func:`agentserver.primitives.core.primitive_for`. Nothing else builds a ``<huh>`` or
``<SystemError>`` from an exception."""

from __future__ import annotations

import enum


class HuhReason(enum.Enum):
    """The fixed set of canned ``<huh>`` texts.

    The single source of these texts, which clients match on: ``schemas/core.xsd`` is
    generated from this enum and a test holds ``docs/protocol.md`` and ``docs/wire.md`` to it.
    The texts are deliberately abstract: an unknown root tag, a payload failing its XSD and
    an unknown or unauthorised ``to`` all read ``INVALID_PAYLOAD`` so that a sender cannot
    probe the topology.
    """

    MALFORMED = "Message could not be parsed."
    TOO_LARGE = "Message exceeds the maximum size."
    INVALID_ENVELOPE = "Envelope is not valid."
    INVALID_PAYLOAD = "Invalid payload structure."
    RESERVED_NAMESPACE = "Payload uses a reserved namespace."
    HANDLER_FAILED = "The request could not be completed."
    UNAUTHENTICATED = "Authentication required."
    INVALID_MULTITASK = "The multitask attribute must be enqueue, reject, interrupt or rollback."


class SystemErrorCode(enum.Enum):
    """``<SystemError>`` codes with their generic, non-revealing messages.

    Like :class:`HuhReason`, these are the single source of the codes and messages:
    ``schemas/core.xsd`` is generated from them and a test holds ``docs/protocol.md`` and
    ``docs/wire.md`` to them. (A ``validation`` code was dropped: nothing emitted it; a
    payload failing its XSD is ``<huh>`` ``INVALID_PAYLOAD``.)
    """

    ROUTING = "routing"
    TIMEOUT = "timeout"

    @property
    def message(self) -> str:
        return _SYSTEM_ERROR_TEXT[self]


_SYSTEM_ERROR_TEXT = {
    SystemErrorCode.ROUTING: "Message could not be delivered. Please verify your target and try again.",
    SystemErrorCode.TIMEOUT: "The request did not complete in time.",
}


class AgentServerError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigurationError(AgentServerError):
    """A listener, payload type or topology is declared wrongly (raised at registration)."""


class CannotListen(AgentServerError):
    """The server cannot bind the address boot.xml's ``<element>`` (``listen`` or
    ``http``) gives it, e.g. the port is in use: said before anything announces a start."""

    def __init__(self, element: str, address: str, cause: OSError) -> None:
        reason = cause.strerror or str(cause)
        if cause.errno is not None:
            reason = f"{reason} (errno {cause.errno})"
        super().__init__(f"cannot listen on <{element}> {address}: {reason}")
        self.element = element
        self.address = address


class SchemaDerivationError(ConfigurationError):
    """A pydantic-xml model uses a construct that has no XSD equivalent we support."""


class Refusal(AgentServerError):
    """A message is refused; the pump answers its sender with a primitive."""


class InputRefused(Refusal):
    """Answered with ``<huh>`` carrying ``reason``'s canned text."""

    def __init__(
        self, reason: HuhReason, detail: str = "", *, payload_tag: str | None = None
    ) -> None:
        # ``detail`` is for the local log only; it never reaches the wire.
        super().__init__(f"{reason.name}: {detail}" if detail else reason.name)
        self.reason = reason
        self.detail = detail
        #: The payload's root tag when the refusal is that no listener takes it (its
        #: namespace missing or wrong): the pump's log then names what the listeners take.
        self.payload_tag = payload_tag


class DeliveryRefused(Refusal):
    """Answered with ``<SystemError>``; the sender's thread stays alive."""

    def __init__(self, code: SystemErrorCode, *, retry_allowed: bool, detail: str = "") -> None:
        super().__init__(f"{code.value}: {detail}" if detail else code.value)
        self.code = code
        self.retry_allowed = retry_allowed
        self.detail = detail


class PumpClosed(AgentServerError):
    """The pump is shutting down and accepts no new messages."""


class EndpointClosed(AgentServerError):
    """The endpoint was closed (by its owner, or because it stopped reading)."""


def sole_exception(group: BaseExceptionGroup) -> BaseException:
    """The one exception a group of one (nested or not) holds; else the group itself."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


class IllegalTransition(AgentServerError):
    """A state machine was asked for a transition its table does not contain."""

    def __init__(self, machine: str, state: str, event: str) -> None:
        super().__init__(f"{machine}: no transition from {state!r} on {event!r}")
        self.machine = machine
        self.state = state
        self.event = event
