"""What the worker needs from the outside world (implemented by the pump and the router).

All three ports are called from the trio thread only. Every method is cancellable: when
the worker's scope is cancelled, the call is abandoned and the store stays consistent
because nothing is committed before the call returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias

from lxml import etree

#: An opaque, JSON-serialisable reference to the caller's thread, produced by the pump for
#: an Enqueue and stored verbatim with the inbox row. The worker never looks inside it.
ReplyRef: TypeAlias = Any

#: The reply reference's key naming the process whose pump holds an anonymous caller's
#: connection, on a store shared by processes. Written at intake and read to answer by the
#: pump edge (agents/edge/bridge.py); read by the PostgreSQL backend to hand the reply to
#: that process (agents/store/pg/callers.py). Stored in the inbox rows: never change it.
PROCESS_KEY = "process"


class ToolPort(Protocol):
    """Forwards the agent's payloads through the pump."""

    async def call(
        self,
        agent: str,
        turn_thread: ReplyRef,
        payload: etree._Element,
        to: str | None,
        *,
        key: str | None = None,
    ) -> str:
        """Forward ``payload`` from ``agent`` to peer ``to`` (``None``: by root tag), with
        the call's idempotency ``key`` (the peer's ``HandlerMetadata.idempotency_key``).

        The pump opens a sub-thread of the Turn's thread (``turn_thread`` is the reply ref
        of the Enqueue) and returns its id. The peer's response, or a ``<huh>`` /
        ``<SystemError>`` that arrives later on that sub-thread, must be handed to
        :meth:`agentserver.agents.runtime.AgentRuntime.report_tool_result` with that id.
        Raises :class:`~agentserver.agents.errors.PumpRefused` carrying the primitive when
        the pump refuses the payload at once. Must return promptly (it forwards, it does
        not wait for the peer).
        """
        ...

    async def self_iterate(
        self, agent: str, turn_thread: ReplyRef, payload: etree._Element
    ) -> None:
        """Send ``payload`` (the agent's own root tag) through the pump as a self-call.

        The pump validates and logs it (``is_self_call=True``) and returns; it must not
        deliver it to the agent's handler as a new Enqueue: the worker continues the same
        Turn with it as the next step. Raises ``PumpRefused`` with the ``<huh>`` when the
        payload fails validation.
        """
        ...


class ReplyPort(Protocol):
    """Sends a Turn's deliverable back to its caller."""

    async def deliver(
        self, reply_ref: ReplyRef, payload: etree._Element, *, failed: bool, turn_id: str
    ) -> None:
        """Send ``payload`` to the caller on the thread of the Enqueue (``reply_ref``).

        Called at least once per Turn (again after a crash between sending and recording
        the send), so ``turn_id`` is given for de-duplication. ``failed`` marks a
        failure/stop/watchdog deliverable. If the caller is a named client that is away,
        the pump keeps the reply with ``AgentStore.record_client_reply``. Raising leaves
        the reply pending; it is retried by the watchdog.
        """
        ...


Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True, slots=True)
class LLMMessage:
    role: Role
    content: str


@dataclass(frozen=True, slots=True)
class LLMRequest:
    agent: str
    model: str
    messages: Sequence[LLMMessage]
    max_tokens: int | None = None
    #: The agent's reply grammar (GBNF) for a backend that constrains decoding, or None.
    grammar: str | None = None


@dataclass(frozen=True, slots=True)
class LLMUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    #: True: the provider reported no usage (these are estimates).
    estimated: bool = field(default=False, compare=False)


@dataclass(frozen=True, slots=True)
class LLMCompletion:
    content: str
    usage: LLMUsage = field(default_factory=LLMUsage)
    cost: float = 0.0
    model: str = ""
    backend: str = ""


class LLMPort(Protocol):
    """One model completion. Raise ``LLMUnavailable`` when none can be had.

    A port may also offer ``stream(request)``: an async context manager yielding an async
    iterator of text chunks followed by one :class:`LLMCompletion`; the worker then
    publishes each chunk as it arrives (``agentserver.agents.edge.llm_adapter.RouterLLM`` does).
    """

    async def complete(self, request: LLMRequest) -> LLMCompletion: ...
