"""An agent offered as an MCP tool, on its durable Turn (docs/mcp.md, "Tasks and
approvals"): the 2026-07-28 Tasks extension (``io.modelcontextprotocol/tasks``) and
``input_required`` for a pending approval, built on the SDK's low-level ``Server`` hooks
(``add_request_handler`` for ``tasks/get``, ``tasks/update`` and ``tasks/cancel``; its
``extensions`` map for the capability ``server/discover`` advertises).

A call to an agent's tool sends its payload on a new thread and reads what becomes of it
from the store (``views.task_answer``, the view every door reads), never from
the request: so the thread is the handle that outlives the request, the process and a
restart.

- **A task** (a 2026-07-28 client that declares the extension on its call): the answer
  is a ``CreateTaskResult`` (``resultType: "task"``) whose ``taskId`` is the thread,
  once the store knows the task; ``tasks/get`` reads the Turn's state (any process on
  the store answers it, after a restart too); a pending approval of the Turn is
  ``input_required`` with one elicitation, answered with ``tasks/update``; ``tasks/cancel``
  is our operator's cancel (the Turn stops).
- **A plain call** at 2026-07-28: the request waits for the answer; a pending approval
  ends it with an ``InputRequiredResult`` whose ``requestState`` is the thread, and the
  client's retry (carrying the answer) decides the approval and waits on.
- **At 2025-11-25** (no ``input_required`` there): the request waits for the answer, as
  the approval is decided elsewhere (the console, the HTTP API).

The approval's answer is an elicitation's: ``accept`` with ``{"grant": true|false,
"reason": "..."}``, ``decline`` (refused), ``cancel`` (left pending). It is sent as an
:class:`ApprovalDecision` from the caller, through the gateway, so the approval rule
(who may decide) is the one every other door applies.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import trio
from lxml import etree

from agentserver.agents.errors import TurnPruned
from agentserver.agents.store.base import StoreCalls
from agentserver.agents.store.sql import governance, views
from agentserver.core.access import AccessRule
from agentserver.core.envelope import build_envelope
from agentserver.core.handshake import Identity
from agentserver.core.namespaces import CORE_NS
from agentserver.core.payloads import model_xml
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser
from agentserver.http.sendonce import until_found
from agentserver.net.roles import OperatorCommands
from agentserver.primitives.approval import NS as APPROVAL_NS
from agentserver.primitives.approval import ApprovalDecision

log = logging.getLogger("agentserver.mcp")

#: The extension's identifier (SEP-2663).
TASKS = "io.modelcontextprotocol/tasks"
#: Seconds between two reads of a waited-on task's state, at first and at most.
POLL_MIN = 0.05
POLL_MAX = 1.0
#: The ``pollIntervalMs`` a task suggests.
POLL_INTERVAL_MS = 1000
#: Seconds a new task waits for the store to know it before its handle is answered
#: (the extension's "durably created" rule).
DURABLE_WAIT = 10.0
#: An approval's input-request key: this prefix and the approval request's id (unique
#: over the task's life, as the extension requires).
KEY_PREFIX = "approval-"
#: The form an approval's elicitation asks for.
APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "grant": {"type": "boolean", "description": "true to allow the call, false to refuse it"},
        "reason": {"type": "string", "description": "why (kept with the decision)"},
    },
    "required": ["grant"],
}
_ACK = f"{{{APPROVAL_NS}}}approval-ack"
_ENDED = frozenset({"completed", "failed", "cancelled"})


class Gateway(Protocol):
    """The HTTP gateway (:class:`agentserver.http.gateway.HttpGateway`)."""

    async def send(
        self,
        identity: Identity,
        to: str | None,
        body: bytes,
        *,
        wait: bool,
        thread: str | None = None,
    ) -> Any: ...


@dataclass(frozen=True, slots=True)
class TurnDoor:
    """What the agents' tools work with, passed in by the composition root."""

    store: StoreCalls
    gateway: Gateway
    may_see: Callable[[Identity, str], bool]
    #: Seconds a plain call waits for its answer (the HTTP API's ``wait-timeout``).
    wait_timeout: float
    operator: OperatorCommands | None = None
    #: The authorization rule: an operator sees and acts on every task; None: only the
    #: task's sender.
    access: AccessRule | None = None


class TaskNotFound(Exception):
    """No task of this id that the caller may see (the text is for the client)."""


class CallRefused(Exception):
    """A call, an answer or a cancel that cannot be carried out (the text is for the
    client: a failed tool result, or the extension's invalid-params error)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One read of a task: its view (``task_answer``) and its pending approval."""

    thread: str
    view: dict[str, Any]
    asks: Any = None

    @property
    def status(self) -> str:
        """The extension's status."""
        view = self.view
        if view.get("status") in ("stopped", "skipped"):
            return "cancelled"
        if view.get("answer") is not None:
            return "completed"
        if self.asks is not None:
            return "input_required"
        return "working"


def declares_tasks(ctx: Any) -> bool:
    """The request's client declared the Tasks extension (2026-07-28: per request)."""
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS

    if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return False
    capabilities = getattr(ctx.session, "client_capabilities", None)
    extensions = getattr(capabilities, "extensions", None) or {}
    return TASKS in extensions


def modern(ctx: Any) -> bool:
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS

    return ctx.protocol_version in MODERN_PROTOCOL_VERSIONS


async def read(door: TurnDoor, thread: str) -> Snapshot | None:
    """The task on ``thread`` now (None: none, or pruned)."""
    try:
        view = await door.store.read(views.task_answer, thread)
    except TurnPruned:
        return None
    if view is None or view.get("pruned"):
        return None
    asks = None
    if view.get("answer") is None and view.get("turn") is not None:
        for pending in await door.store.read(governance.pending_approvals, None):
            if pending.agent_turn_id == view["turn"]:
                asks = pending
                break
    return Snapshot(thread, view, asks)


async def owned(
    door: TurnDoor, identity: Identity, thread: str, method: str, agent: str | None = None
) -> Snapshot:
    """The task on ``thread`` if ``identity`` sent it (or is an operator) and may still
    see its agent (``agent``: and it is that agent's). Raises TaskNotFound otherwise, as
    for a missing one."""
    snap = await read(door, thread) if 0 < len(thread) <= 128 else None
    if snap is None:
        raise TaskNotFound(f"no task {thread!r}")
    view = snap.view
    sender = view.get("sender")
    if door.access is not None:
        mine = door.access.allows(identity.name, sender, door="mcp", route=method)
    else:
        mine = sender == identity.name
    if (
        not mine
        or not door.may_see(identity, view["agent"])
        or (agent is not None and view["agent"] != agent)
    ):
        raise TaskNotFound(f"no task {thread!r}")
    return snap


async def send(door: TurnDoor, identity: Identity, listener: str, payload: etree._Element) -> str:
    """Send ``payload`` to ``listener`` on a new thread; the thread. Raises CallRefused
    (its text for the client) when the gateway refuses it."""
    thread = new_thread_id()
    outcome = await door.gateway.send(
        identity, listener, etree.tostring(payload), wait=False, thread=thread
    )
    if outcome.kind == "refused":
        raise CallRefused(f"refused: {outcome.refusal}")
    return thread


async def until_known(door: TurnDoor, thread: str) -> Snapshot | None:
    """The task once the store knows it (bounded by DURABLE_WAIT; None if it never
    does)."""
    return await until_found(
        lambda: read(door, thread), DURABLE_WAIT, first=POLL_MIN, longest=POLL_MAX
    )


async def wait(door: TurnDoor, thread: str, *, stop_asking: bool) -> Snapshot | None:
    """Read the task until it ended (or, with ``stop_asking``, waits for an approval),
    within the door's ``wait_timeout``; the last read (None: never seen)."""
    delay = POLL_MIN
    snap = None
    with trio.move_on_after(door.wait_timeout):
        while True:
            fresh = await read(door, thread)
            if fresh is not None:
                changed = snap is None or fresh.status != snap.status
                snap = fresh
                if snap.status in _ENDED or (stop_asking and snap.status == "input_required"):
                    return snap
                if changed:
                    delay = POLL_MIN
            await trio.sleep(delay)
            delay = min(delay * 2, POLL_MAX)
    return snap


def _iso(stamp: Any) -> str:
    if not isinstance(stamp, int | float):
        stamp = 0.0
    moment = datetime.datetime.fromtimestamp(float(stamp), tz=datetime.UTC)
    return moment.isoformat().replace("+00:00", "Z")


def asks_text(asks: Any) -> str:
    """What an approval waits for, in a sentence (the elicitation's message)."""
    return (
        f"{asks.agent_id} waits for {asks.approver} to approve a call to {asks.target} "
        f"(rule {asks.rule}, approval request {asks.request_id}): {asks.payload}"
    )


def input_requests(snap: Snapshot) -> dict[str, Any]:
    """The task's outstanding input requests: one elicitation per pending approval."""
    import mcp_types as types

    if snap.asks is None:
        return {}
    request = types.ElicitRequest(
        params=types.ElicitRequestFormParams(
            message=asks_text(snap.asks), requested_schema=APPROVAL_SCHEMA
        )
    )
    return {KEY_PREFIX + snap.asks.request_id: request}


def call_result(snap: Snapshot, text_of: Callable[[etree._Element], tuple[str, bool]]) -> Any:
    """The ``CallToolResult`` of an ended task: its answer's text (``text_of``), an error
    for a failed or cancelled one."""
    import mcp_types as types

    view = snap.view
    answer = view.get("answer")
    if answer is None:
        text, failed = f"the task ended ({view.get('status')}) without an answer", True
    else:
        try:
            text, failed = text_of(SafeParser().parse(answer.encode()))
        except Exception:  # an answer that is not XML: its text as it is
            text, failed = answer, False
        failed = failed or bool(view.get("answer_failed"))
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)], is_error=failed
    )


def detailed(
    snap: Snapshot, text_of: Callable[[etree._Element], tuple[str, bool]]
) -> dict[str, Any]:
    """The extension's ``DetailedTask`` of a snapshot (``tasks/get``, and the seed of a
    ``CreateTaskResult``)."""
    view = snap.view
    status = snap.status
    out: dict[str, Any] = {
        "taskId": snap.thread,
        "status": status,
        "createdAt": _iso(view.get("created_at")),
        "lastUpdatedAt": _iso(view.get("finished_at") or view.get("created_at")),
        "ttlMs": None,
        "pollIntervalMs": POLL_INTERVAL_MS,
    }
    if status == "input_required":
        out["statusMessage"] = asks_text(snap.asks)
        out["inputRequests"] = {
            key: request.model_dump(by_alias=True, mode="json", exclude_none=True)
            for key, request in input_requests(snap).items()
        }
    elif status == "completed":
        out["result"] = call_result(snap, text_of).model_dump(
            by_alias=True, mode="json", exclude_none=True
        )
    elif status == "cancelled":
        out["statusMessage"] = view.get("error") or "cancelled"
    return out


def _answer(response: Any) -> tuple[bool, str] | None:
    """(grant, reason) from an elicitation's answer; None: no decision (``cancel``, or
    not an elicitation's answer)."""
    if hasattr(response, "model_dump"):
        response = response.model_dump(by_alias=True, mode="json", exclude_none=True)
    if not isinstance(response, Mapping):
        return None
    action = response.get("action")
    content = response.get("content") or {}
    reason = str(content.get("reason", "") if isinstance(content, Mapping) else "")[:2000]
    if action == "decline":
        return False, reason or "declined"
    if action != "accept" or not isinstance(content, Mapping):
        return None
    grant = content.get("grant")
    if not isinstance(grant, bool):
        return None
    return grant, reason


async def decide(
    door: TurnDoor, identity: Identity, snap: Snapshot, responses: Mapping[str, Any] | None
) -> bool:
    """Decide the task's pending approval from ``responses`` (keys not outstanding are
    ignored, as the extension says); whether a decision was applied. Raises CallRefused
    (its text for the client) when the answer is malformed or the decision was refused
    (the caller may not decide it)."""
    if snap.asks is None or not responses:
        return False
    key = KEY_PREFIX + snap.asks.request_id
    if key not in responses:
        return False
    answer = _answer(responses[key])
    if answer is None:
        action = getattr(responses[key], "action", None)
        if action is None and isinstance(responses[key], Mapping):
            action = responses[key].get("action")
        if action == "cancel":
            return False
        raise CallRefused(
            f'answer {key} with an elicitation result: action "accept" and content '
            '{"grant": true|false, "reason": "..."}, or action "decline"'
        )
    grant, reason = answer
    decision = ApprovalDecision(request=snap.asks.request_id, grant=grant, reason=reason)
    outcome = await door.gateway.send(identity, snap.view["agent"], model_xml(decision), wait=True)
    status = None
    if outcome.kind == "reply":
        root = SafeParser().parse(outcome.reply)
        if len(root) > 1 and root[1].tag == _ACK:
            status = root[1].get("status")
    if status not in ("applied", "duplicate"):
        raise CallRefused(
            f"the decision on approval request {snap.asks.request_id} was not applied: "
            f"{status or 'no answer'}"
        )
    return True


async def cancel(door: TurnDoor, identity: Identity, snap: Snapshot) -> None:
    """Our operator's cancel of the task's Turn (a queued task skipped, a running one
    stopped, on whichever process runs it). Raises CallRefused without operator commands."""
    if snap.status in _ENDED:
        return
    if door.operator is None:
        raise CallRefused("no operator commands on this server")
    command = etree.Element(f"{{{CORE_NS}}}cancel", nsmap={None: CORE_NS})
    command.set("agent", snap.view["agent"])
    command.set("thread", snap.thread)
    sender = identity.name or "mcp"
    frame = etree.tostring(build_envelope(sender, None, new_thread_id(), command))
    await door.operator.handle(frame, sender)


def install(
    server: Any,
    door: TurnDoor,
    identity_of: Callable[[Any], Identity | None],
    text_of: Callable[[etree._Element], tuple[str, bool]],
) -> None:
    """Serve the extension's methods on the SDK's low-level ``server`` and advertise it
    (``server/discover``'s capabilities)."""
    from mcp import MCPError
    from mcp_types import INVALID_PARAMS, METHOD_NOT_FOUND, MISSING_REQUIRED_CLIENT_CAPABILITY
    from mcp_types import RequestParams as Base
    from pydantic import ConfigDict, Field

    class TaskParams(Base):
        model_config = ConfigDict(populate_by_name=True, extra="allow")
        task_id: str = Field(alias="taskId")

    class UpdateParams(TaskParams):
        input_responses: dict[str, Any] = Field(default_factory=dict, alias="inputResponses")

    def caller(ctx: Any, method: str) -> Identity:
        if not modern(ctx):
            raise MCPError(METHOD_NOT_FOUND, f"{method} is of the 2026-07-28 Tasks extension")
        if not declares_tasks(ctx):
            raise MCPError(
                MISSING_REQUIRED_CLIENT_CAPABILITY,
                "Missing required client capability",
                {"requiredCapabilities": {"extensions": {TASKS: {}}}},
            )
        identity = identity_of(ctx)
        if identity is None:  # /mcp authenticates every request first
            raise MCPError(INVALID_PARAMS, "unauthenticated")
        return identity

    async def lookup(ctx: Any, params: Any, method: str) -> tuple[Identity, Snapshot]:
        identity = caller(ctx, method)
        try:
            return identity, await owned(door, identity, params.task_id, method)
        except TaskNotFound as exc:
            raise MCPError(INVALID_PARAMS, f"Failed to retrieve task: {exc}") from None

    async def get(ctx: Any, params: Any) -> dict[str, Any]:
        _, snap = await lookup(ctx, params, "tasks/get")
        return {"resultType": "complete", **detailed(snap, text_of)}

    async def update(ctx: Any, params: Any) -> dict[str, Any]:
        identity, snap = await lookup(ctx, params, "tasks/update")
        try:
            await decide(door, identity, snap, params.input_responses)
        except CallRefused as exc:
            raise MCPError(INVALID_PARAMS, str(exc)) from None
        return {"resultType": "complete"}

    async def cancel_task(ctx: Any, params: Any) -> dict[str, Any]:
        identity, snap = await lookup(ctx, params, "tasks/cancel")
        try:
            await cancel(door, identity, snap)
        except CallRefused as exc:
            raise MCPError(INVALID_PARAMS, str(exc)) from None
        return {"resultType": "complete"}

    server.add_request_handler("tasks/get", TaskParams, get)
    server.add_request_handler("tasks/update", UpdateParams, update)
    server.add_request_handler("tasks/cancel", TaskParams, cancel_task)
    server.extensions[TASKS] = {}


async def call(
    ctx: Any,
    params: Any,
    door: TurnDoor,
    identity: Identity,
    listener: str,
    payload: etree._Element | None,
    text_of: Callable[[etree._Element], tuple[str, bool]],
) -> Any:
    """``tools/call`` on an agent's tool (see the module doc): a ``CallToolResult``, an
    ``InputRequiredResult`` or a ``CreateTaskResult``. ``payload`` None: a retry (its
    ``requestState`` the thread). Raises CallRefused (its text a failed result)."""
    import mcp_types as types

    snap: Snapshot | None
    if params.request_state is not None:
        try:
            snap = await owned(door, identity, params.request_state, "tools/call", listener)
        except TaskNotFound:
            raise CallRefused("requestState names no task of this tool") from None
        await decide(door, identity, snap, params.input_responses)
        thread = snap.thread
    else:
        assert payload is not None
        thread = await send(door, identity, listener, payload)
        if declares_tasks(ctx):
            snap = await until_known(door, thread)
            if snap is None:
                raise CallRefused(f"the task on thread {thread} was not recorded in time")
            log.info("MCP task %s: %s for %s", thread, listener, identity.name or "anonymous")
            return {"resultType": "task", **detailed(snap, text_of)}
    asking = modern(ctx)
    snap = await wait(door, thread, stop_asking=asking)
    if snap is not None and snap.status in _ENDED:
        return call_result(snap, text_of)
    if snap is not None and asking and snap.status == "input_required":
        return types.InputRequiredResult(input_requests=input_requests(snap), request_state=thread)
    raise CallRefused(f"no answer in time (thread {thread})")
