"""What a user declares: listeners, their handlers, and what handlers return."""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias

from lxml import etree
from pydantic_xml import BaseXmlModel

from agentserver.core.errors import ConfigurationError
from agentserver.core.payloads import model_tree

NAME_RE = re.compile(r"^[a-z0-9_-]{1,64}$")
#: Names the pump keeps for itself.
RESERVED_NAMES = frozenset({"system"})

Payload: TypeAlias = BaseXmlModel | etree._Element


def to_element(payload: object) -> etree._Element:
    """A :data:`Payload` as an element (a model is serialised). Raises TypeError."""
    if isinstance(payload, BaseXmlModel):
        return model_tree(payload, exclude_none=True)
    if isinstance(payload, etree._Element):
        return payload
    raise TypeError(
        f"payload must be a pydantic-xml model or an lxml element, not {type(payload).__name__}"
    )


# Not frozen: a frozen dataclass's __init__ costs twice as much, and one is built per
# handler call. The pump reads it once and never keeps it.
@dataclass(slots=True)
class HandlerResponse:
    """What a handler asks the pump to emit.

    - ``HandlerResponse(payload, to="peer")``: forward to a peer (must be in ``peers``).
    - ``HandlerResponse(payload)``: routed by the payload's root tag; the listener's own
      root tag means self-iteration.
    - ``HandlerResponse.respond(payload)``: answer the caller; this thread and every thread
      below it are terminated.
    """

    payload: Payload
    to: str | None = None
    is_response: bool = False

    @classmethod
    def respond(cls, payload: Payload) -> HandlerResponse:
        return cls(payload, None, True)


HandlerResult: TypeAlias = HandlerResponse | Sequence[HandlerResponse] | None


class HandlerMetadata(NamedTuple):
    """Context of one delivery. Only the pump constructs it (immutable, cheap to build)."""

    #: The thread this listener works on (its own hop).
    thread_id: str
    #: Who sent this message (a listener name, a client identity, or ``system``).
    from_id: str
    own_name: str
    #: True when the payload is this listener's own root tag emitted by itself.
    is_self_call: bool
    usage_instructions: str
    #: For a response from a peer: the sub-thread (the call) it arrived on; else None.
    response_thread: str | None = None
    #: The call chain of ``thread_id``, for logs; never route on it.
    chain: tuple[str, ...] = ()
    #: This step's idempotency key: the same on every attempt of one call (a retry after
    #: a step-timeout, a lost runner, a server restart), different for every distinct
    #: call. An agent's tool call carries the key its Turn recorded for it; any other
    #: delivery's key is its hop (``thread_id``). Dedupe side effects on it
    #: (docs/guide.md, "Side effects once: dedupe by key").
    idempotency_key: str = ""


Handler: TypeAlias = Callable[[Any, HandlerMetadata], Awaitable[HandlerResult]]

#: A listener's tuning when neither its code nor boot.xml sets it.
DEFAULT_CONCURRENCY = 8
DEFAULT_TIMEOUT = 30.0
DEFAULT_QUEUE_SIZE = 64


@dataclass(frozen=True, slots=True)
class Listener:
    """A named handler for one or more payload types.

    ``concurrency`` bounds how many deliveries run the handler at once; ``queue_size``
    bounds how many wait (a full queue pushes back on the sender). ``timeout`` bounds one
    handler call, in seconds. ``raw=True`` hands the handler the validated lxml element
    instead of a model instance (faster; the element must not be kept after returning).

    ``sync=True`` (needs ``raw``) declares the handler a plain function that returns at
    once: it never awaits, blocks or keeps anything. A client's request to it is then
    handled in the task that injects it, with no queue, worker or thread record (see
    docs/architecture.md, "The synchronous fast path"); ``timeout``, ``concurrency`` and
    ``queue_size`` apply only to its other deliveries (from listeners), which go through
    its queue as usual.

    ``addressed_only`` (a subset of ``payload_types``) are the types the listener takes
    only when a message names it (``to``) or answers its own call: it does not claim
    their root tags, so several listeners may take the same one, and a message that
    names no listener goes to the one that does claim it (docs/protocol.md, "Routing").
    The agents use it for the approval decision every governed agent takes
    (docs/agents.md, "Human approval").
    """

    name: str
    payload_types: tuple[type[BaseXmlModel], ...]
    handler: Handler
    peers: tuple[str, ...] = ()
    responses: tuple[type[BaseXmlModel], ...] = ()
    agent: bool = False
    broadcast: bool = False
    concurrency: int = DEFAULT_CONCURRENCY
    timeout: float = DEFAULT_TIMEOUT
    queue_size: int = DEFAULT_QUEUE_SIZE
    raw: bool = False
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    sync: bool = False
    addressed_only: tuple[type[BaseXmlModel], ...] = ()

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name) or self.name in RESERVED_NAMES:
            raise ConfigurationError(
                f"listener name {self.name!r}: use 1-64 of [a-z0-9_-] (dots are reserved "
                "for chains; 'system' is reserved)"
            )
        if not self.payload_types:
            raise ConfigurationError(f"listener {self.name!r} accepts no payload type")
        if isinstance(self.payload_types, type):
            raise ConfigurationError(f"listener {self.name!r}: payload_types must be a tuple")
        if any(m not in self.payload_types for m in self.addressed_only):
            raise ConfigurationError(
                f"listener {self.name!r}: addressed_only must be among its payload_types"
            )
        for peer in self.peers:
            if not NAME_RE.match(peer):
                raise ConfigurationError(f"listener {self.name!r}: bad peer name {peer!r}")
        if self.concurrency < 1 or self.queue_size < 1:
            raise ConfigurationError(f"listener {self.name!r}: concurrency and queue_size >= 1")
        if not self.timeout > 0:
            raise ConfigurationError(f"listener {self.name!r}: timeout must be positive")
        if self.sync and not self.raw:
            raise ConfigurationError(f"listener {self.name!r}: a sync handler must be raw")
        if self.sync and _is_async(self.handler):
            raise ConfigurationError(
                f"listener {self.name!r}: sync=True needs a plain function, not a coroutine one"
            )


def _is_async(handler: Callable[..., Any]) -> bool:
    call = handler if inspect.isfunction(handler) else getattr(handler, "__call__", handler)  # noqa: B004
    return inspect.iscoroutinefunction(inspect.unwrap(call))
