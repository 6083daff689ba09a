"""Our listeners and agents as an MCP server (official ``mcp`` SDK, low-level ``Server``):
the tools ``<expose-mcp>`` chooses, served over streamable HTTP at ``/mcp`` by the HTTP
API (:func:`mcp_asgi`) and over stdio by ``agentserver mcp``.

Each exposed listener is one tool per payload type it accepts (named as the listener, or
``listener-payload`` when it accepts several); its input schema is derived from the
payload's XSD (:mod:`agentserver.core.xsd_jsonschema`). A call sends the payload to the
listener through a :class:`Sender` (the HTTP gateway, or the socket client of
``agentserver mcp``) and answers with the reply: an agent's answer as its text, any other
reply as its XML; a ``<huh>``, a ``<SystemError>`` or ``status="failed"`` is ``isError``.
While the reply is awaited the client gets a progress notification every
:data:`PROGRESS_EVERY` seconds (when its request asked for progress). Cancelling the MCP
request cancels the wait; the message already sent runs on (an agent's Turn is durable).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio
from lxml import etree

from agentserver.core.handshake import Identity
from agentserver.core.namespaces import CORE_NS
from agentserver.core.xsd_jsonschema import ArgumentsRefused, ToolInput
from agentserver.http import mcp_tasks
from agentserver.http.mcp_tasks import TurnDoor

log = logging.getLogger("agentserver.mcp")

#: Seconds between progress notifications while a call waits for its reply.
PROGRESS_EVERY = 1.0
#: The ASGI scope key the HTTP gate puts the caller's identity under.
IDENTITY_KEY = "agentserver.identity"


class SendFailed(Exception):
    """The message could not be sent, or no reply came (the text is for the client)."""


class Sender(Protocol):
    """Sends one payload to a listener and returns the first reply's payload."""

    async def __call__(
        self, listener: str, payload: etree._Element, identity: Identity | None
    ) -> etree._Element: ...


@dataclass(frozen=True, slots=True)
class ExposedTool:
    """One tool: the listener it calls and the payload type's input."""

    name: str
    listener: str
    description: str
    input: ToolInput
    #: The listener is an agent: its answer's text is the result.
    agent: bool = False


def result_text(payload: etree._Element, agent: bool) -> tuple[str, bool]:
    """The tool result's text and whether it is an error, from a reply payload."""
    tag = payload.tag if isinstance(payload.tag, str) else ""
    failed = tag.startswith(f"{{{CORE_NS}}}") or payload.get("status") == "failed"
    if agent or tag.startswith(f"{{{CORE_NS}}}"):
        text = "\n".join(t.strip() for t in payload.itertext() if t.strip())
        if text:
            return text, failed
    return etree.tostring(payload, encoding="unicode"), failed


def build_server(
    tools: Sequence[ExposedTool],
    send: Sender,
    *,
    name: str,
    version: str,
    may_see: Callable[[Identity, str], bool] | None = None,
    turns: TurnDoor | None = None,
) -> Any:
    """The SDK's low-level ``Server`` offering ``tools``; with ``may_see``, an HTTP
    caller (its identity in the request's scope) sees and calls only the listeners it
    may address. With ``turns`` (``/mcp`` with a store), an agent's tool runs on its
    durable Turn: a task for a client of the Tasks extension, ``input_required`` for a
    pending approval (:mod:`agentserver.http.mcp_tasks`)."""
    import mcp_types as types
    from mcp.server.lowlevel import Server

    by_name = {t.name: t for t in tools}

    def identity_of(ctx: Any) -> Identity | None:
        request = getattr(ctx, "request", None)
        scope = getattr(request, "scope", None)
        return scope.get(IDENTITY_KEY) if isinstance(scope, dict) else None

    def visible(ctx: Any, tool: ExposedTool) -> bool:
        identity = identity_of(ctx)
        return may_see is None or identity is None or may_see(identity, tool.listener)

    async def list_tools(ctx: Any, params: Any) -> Any:
        return types.ListToolsResult(
            tools=[
                types.Tool(name=t.name, description=t.description, input_schema=t.input.schema)
                for t in tools
                if visible(ctx, t)
            ]
        )

    def failed(text: str) -> Any:
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)], is_error=True
        )

    def agent_text(payload: etree._Element) -> tuple[str, bool]:
        return result_text(payload, True)

    async def call_tool(ctx: Any, params: Any) -> Any:
        tool = by_name.get(params.name)
        if tool is None or not visible(ctx, tool):
            return failed(f"unknown tool {params.name!r}")
        identity = identity_of(ctx)
        durable = turns is not None and tool.agent and identity is not None
        if params.request_state is not None and not durable:
            return failed(f"the tool {tool.name!r} asks for no input: call it without requestState")
        payload = None
        if params.request_state is None:
            try:
                payload = tool.input.element(dict(params.arguments or {}))
            except ArgumentsRefused as exc:
                return failed(str(exc))
        token = _progress_token(ctx)

        async def answer() -> Any:
            # Errors become failed results here, inside the nursery, so that none reaches
            # the client wrapped in an exception group.
            try:
                if durable:
                    assert turns is not None and identity is not None
                    return await mcp_tasks.call(
                        ctx, params, turns, identity, tool.listener, payload, agent_text
                    )
                assert payload is not None
                reply = await send(tool.listener, payload, identity)
            except (SendFailed, mcp_tasks.CallRefused) as exc:
                return failed(str(exc))
            text, is_error = result_text(reply, tool.agent)
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=text)], is_error=is_error
            )

        if token is None:
            return await answer()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_report_progress, ctx, token, tool.listener)
            outcome = await answer()
            nursery.cancel_scope.cancel()
        return outcome

    server = Server(name, version=version, on_list_tools=list_tools, on_call_tool=call_tool)
    if turns is not None:
        mcp_tasks.install(server, turns, identity_of, agent_text)
    return server


def _progress_token(ctx: Any) -> Any:
    meta = getattr(ctx, "meta", None)
    if isinstance(meta, dict):
        return meta.get("progress_token", meta.get("progressToken"))
    return getattr(meta, "progress_token", None)


async def _report_progress(ctx: Any, token: Any, listener: str) -> None:
    """A progress notification every PROGRESS_EVERY seconds until cancelled."""
    ticks = 0
    while True:
        await trio.sleep(PROGRESS_EVERY)
        ticks += 1
        try:
            await ctx.session.send_progress_notification(
                token,
                float(ticks),
                message=f"{listener} working ({ticks * PROGRESS_EVERY:g} s)",
                related_request_id=str(ctx.request_id) if ctx.request_id is not None else None,
            )
        except Exception as exc:  # a client gone: the call itself ends soon
            log.debug("MCP progress to %s failed: %s", listener, exc)
            return


class McpHttp:
    """``/mcp``: the SDK's streamable-HTTP session manager (stateless: each request is
    complete in itself) behind the HTTP API's authentication. :meth:`running` must be
    entered while the HTTP API serves.

    ``loopback``: the API listens on a loopback address, where anonymous callers may be
    served; the SDK's DNS-rebinding protection then refuses a request whose ``Host`` (or
    ``Origin``) is not a loopback name, so a web page cannot reach the tools through a
    name it made resolve to 127.0.0.1."""

    def __init__(self, server: Any, *, loopback: bool) -> None:
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
        from mcp.server.transport_security import TransportSecuritySettings

        security = None
        if loopback:
            security = TransportSecuritySettings(
                enable_dns_rebinding_protection=True,
                allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
                allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
            )
        self.manager = StreamableHTTPSessionManager(
            app=server, stateless=True, security_settings=security
        )

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with self.manager.run():
            yield

    async def handle(self, scope: Any, receive: Any, send: Any, identity: Identity) -> None:
        scope = dict(scope)
        scope[IDENTITY_KEY] = identity
        await self.manager.handle_request(scope, receive, send)


async def serve_stdio(server: Any) -> None:
    """Serve ``server`` on this process's standard input and output until the input
    ends (the client closed it)."""
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


class GatewaySender:
    """Sends through the HTTP API's gateway as the calling client (``/mcp``): the same
    validation, routing, ``may-address`` and ``wait-timeout`` as ``POST /v1/messages``."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway

    async def __call__(
        self, listener: str, payload: etree._Element, identity: Identity | None
    ) -> etree._Element:
        from agentserver.core.xmlsafe import SafeParser
        from agentserver.net.reply import parse_reply

        assert identity is not None  # /mcp authenticates every request first
        outcome = await self.gateway.send(identity, listener, etree.tostring(payload), wait=True)
        if outcome.kind == "reply":
            return parse_reply(outcome.reply, SafeParser()).payload
        if outcome.kind == "refused":
            raise SendFailed(f"refused: {outcome.refusal}")
        if outcome.kind == "timeout":
            raise SendFailed(f"no reply in time (thread {outcome.thread})")
        raise SendFailed(f"{listener} ended without answering")
