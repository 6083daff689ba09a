"""What the worker needs from the outside world (implemented by the pump and the router).

All three ports are called from the trio thread only. Every method is cancellable: when
the worker's scope is cancelled, the call is abandoned and the store stays consistent
because nothing is committed before the call returns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, NotRequired, Protocol, TypedDict, cast

from lxml import etree


class ReplyRef(TypedDict):
    """The reference to a task's caller, made at intake (the pump edge's hold of the
    caller's hop, agents/edge/bridge.py; a schedule's run, agents/turn/scheduler.py) and
    stored as JSON with the inbox row (``reply_ref``): a plain dict, so the stored form is
    the JSON object of these keys, as before it had a type. Every key is stored in rows:
    never rename one. Read back with :func:`reply_ref_from_json`."""

    #: The hop thread the task arrived on (the pump's held hop).
    hop: str
    #: The caller's own thread (what its answer is sent on).
    caller_thread: str
    #: The hop's chain of endpoints, the caller's before the agent's.
    chain: list[str]
    #: The named client whose connection sent the task (her identity).
    client: NotRequired[str]
    #: The named client an authenticated HTTP message was sent by (rows.SPEAKS_FOR).
    speaks_for: NotRequired[str]
    #: The process holding an anonymous caller's connection (:data:`PROCESS_KEY`).
    process: NotRequired[str]
    #: The W3C ``traceparent`` of the intake's span: the Turn joins that trace.
    traceparent: NotRequired[str]
    #: The schedule a run belongs to (turn/scheduler.py's SCHEDULE_KEY), and its tick.
    schedule: NotRequired[str]
    tick: NotRequired[float]


#: The reply reference's key naming the process whose pump holds an anonymous caller's
#: connection, on a store shared by processes. Written at intake and read to answer by the
#: pump edge (agents/edge/bridge.py); read by the PostgreSQL backend to hand the reply to
#: that process (agents/store/pg/callers.py). Stored in the inbox rows: never change it.
PROCESS_KEY: Final = "process"


def reply_ref_from_json(text: str) -> ReplyRef:
    """A stored reply reference (``reply_ref`` JSON) as the typed value: the one edge
    where the store's JSON becomes a :class:`ReplyRef`. Taken as stored, unchecked: the
    worker carries it to the ports without looking inside, and the readers of one key
    (``client_of``, the bridge) still check what they read, since a row may come from a
    caller of the store other than intake (the tests' fakes store any JSON). Raises
    ValueError (json's) when ``text`` is not JSON."""
    return cast(ReplyRef, json.loads(text))


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
        thread: str | None = None,
    ) -> str:
        """Forward ``payload`` from ``agent`` to peer ``to`` (``None``: by root tag), with
        the call's idempotency ``key`` (the peer's ``HandlerMetadata.idempotency_key``).

        The pump opens a sub-thread of the Turn's thread (``turn_thread`` is the reply ref
        of the Enqueue) and returns its id: ``thread`` when given (the worker draws it
        first, so that the Turn's waiting set is written before the call goes out). The peer's response, or a ``<huh>`` /
        ``<SystemError>`` that arrives later on that sub-thread, must be handed to
        :meth:`agentserver.agents.runtime.AgentRuntime.report_tool_result` with that id.
        Raises :class:`~agentserver.agents.errors.PumpRefused` carrying the primitive when
        the pump refuses the payload at once. Must return promptly (it forwards, it does
        not wait for the peer).
        """
        ...

    def check_call(self, agent: str, payload: etree._Element, to: str | None) -> None:
        """Check a call as :meth:`call` would send it (a valid payload, exactly one peer
        that takes it), sending nothing: raises ``PumpRefused`` as the send would. The
        worker checks a step's calls before it writes the step, then sends them; a send
        can still be refused after that only for room (a full queue or registry)."""
        ...

    def check_task(self, agent: str, payload: etree._Element) -> None:
        """Check that ``agent`` takes ``payload`` as a task now (its type is one of the
        agent's, and valid), sending nothing: raises ``PumpRefused``. A task queued by a
        process serving another version of the agent is checked again before it starts
        (docs/deploy.md)."""
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
        the pump keeps the reply with ``replies.record_client_reply`` (agents/store/sql/replies.py). Raising leaves
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
