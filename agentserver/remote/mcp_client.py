"""MCP servers' tools served as listeners: the connections (official ``mcp`` SDK, stdio
subprocess or streamable HTTP, under trio through anyio), their supervision, and the
pump handler of each tool listener.

One :class:`McpConnection` per ``<mcp>``: a task connects, lists the tools, then watches
the session (a ping every :data:`PING_INTERVAL` seconds, or sooner when a call saw the
transport fail). A server that dies or cannot be reached is reconnected with exponential
backoff (:data:`BACKOFF_FIRST` doubling up to :data:`BACKOFF_MAX` seconds); meanwhile its
tools' calls fail at once with a ``<SystemError>`` (routing, retry allowed). A
``notifications/tools/list_changed`` makes it list the tools again and log what changed
(the listeners stay those of boot.xml: a tool that is gone answers a failed result, a new
one is served after a restart).

A call is bounded by its listener's ``timeout`` (the pump cancels the handler); the SDK
sends ``notifications/cancelled`` for a request its caller abandons, so the MCP server
stops the work too. Connecting and listing are bounded by ``<mcp connect-timeout>``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import trio
from lxml import etree

from agentserver.core.errors import DeliveryRefused, SystemErrorCode
from agentserver.core.jsonschema_xsd import ArgumentError, ToolShape
from agentserver.core.listener import HandlerMetadata, HandlerResponse, HandlerResult
from agentserver.primitives.mcp import McpResult
from agentserver.remote.mcp_spec import McpServerSpec, ToolInfo
from agentserver.steps.retry import backoff

log = logging.getLogger("agentserver.mcp")

#: Seconds between pings of an idle connection (a dead server is noticed within this).
PING_INTERVAL = 5.0
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
#: Pages of tools/list read at most (a server that pages forever is cut off).
MAX_PAGES = 100


class McpConnectError(Exception):
    """An MCP server could not be reached or listed (``check`` and ``run`` report it)."""


@contextlib.asynccontextmanager
async def open_session(
    spec: McpServerSpec, *, message_handler: Any = None, tasks: bool = False
) -> AsyncIterator[Any]:
    """A connected SDK ``Client`` with ``spec``'s server, at whichever revision it speaks
    (the SDK's automatic mode: ``server/discover`` at 2026-07-28, falling back to the
    ``initialize`` handshake of 2025-11-25 and older); closed on exit, a stdio server's
    process stopped then. ``tasks``: it declares the Tasks extension
    (:mod:`agentserver.remote.mcp_tasks`), so a tool call answered with a task handle is
    followed to the task's result. Raises whatever the transport raises."""
    # Imported here: the SDK is large, and only topologies with <mcp> need it.
    try:
        from mcp import Client
    except ImportError:
        raise McpConnectError(
            "the MCP SDK is not installed (pip install 'agentserver[mcp]')"
        ) from None
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    from agentserver.remote.mcp_tasks import TasksExtension

    async with contextlib.AsyncExitStack() as stack:
        if spec.url is not None:
            http = await stack.enter_async_context(
                create_mcp_http_client(headers=dict(spec.headers))
            )
            transport = streamable_http_client(spec.url, http_client=http)
        else:
            assert spec.command is not None  # the loader checked one of url/command
            params = StdioServerParameters(
                command=spec.command,
                args=list(spec.args),
                env=dict(spec.env) or None,
                cwd=spec.cwd,
            )
            transport = stdio_client(params, errlog=sys.stderr)
        client = await stack.enter_async_context(
            Client(
                transport,
                mode="auto",
                message_handler=message_handler,
                # Tool lists are read when we ask; the SDK's response cache would hide
                # a relist after notifications/tools/list_changed.
                cache=None,
                extensions=[TasksExtension()] if tasks else None,
            )
        )
        yield client


async def list_tools(session: Any) -> tuple[ToolInfo, ...]:
    """Every tool the session's server lists (following its pages, at most MAX_PAGES)."""
    tools: list[ToolInfo] = []
    cursor = None
    for _ in range(MAX_PAGES):
        page = await session.list_tools(cursor=cursor)
        tools.extend(ToolInfo.from_mcp(t) for t in page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    return tuple(tools)


async def discover(spec: McpServerSpec) -> tuple[ToolInfo, ...]:
    """Connect to ``spec``'s server, list its tools and disconnect, within
    ``spec.connect_timeout``. Raises :class:`McpConnectError`."""
    try:
        with trio.fail_after(spec.connect_timeout):
            async with open_session(spec) as session:
                return await list_tools(session)
    except trio.TooSlowError:
        raise McpConnectError(f"no tool list within {spec.connect_timeout:g} s") from None
    except Exception as exc:
        raise McpConnectError(_describe(exc)) from None


def discover_blocking(spec: McpServerSpec) -> tuple[ToolInfo, ...]:
    """:func:`discover` from synchronous code (the boot loader), in a thread of its own so
    it works whether or not the caller runs in trio. Raises :class:`McpConnectError`."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(trio.run(discover, spec))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)

    worker = threading.Thread(target=run, name=f"mcp-discover-{spec.name}", daemon=True)
    worker.start()
    worker.join(spec.connect_timeout + 10)
    if not outcome:
        raise McpConnectError(f"no tool list within {spec.connect_timeout:g} s")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _is_modern(session: Any) -> bool:
    """The connection speaks a revision of 2026-07-28 or later (stateless, discovered)."""
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS

    return session.protocol_version in MODERN_PROTOCOL_VERSIONS


def _describe(exc: BaseException) -> str:
    """One line for an exception, unwrapping the task groups' exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def result_of(listener: str, result: Any) -> McpResult:
    """A ``CallToolResult`` as the tool listener's answer: each text content a ``<text>``
    (other content described in one line), the structured content as JSON."""
    texts: list[str] = []
    for block in result.content or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            texts.append(block.text)
        elif kind == "resource":
            inner = block.resource
            texts.append(getattr(inner, "text", None) or f"[resource {inner.uri}]")
        elif kind == "resource_link":
            texts.append(f"[resource {block.uri}]")
        else:
            texts.append(f"[{kind} {getattr(block, 'mime_type', '')}]".replace(" ]", "]"))
    structured = None
    if result.structured_content is not None:
        structured = json.dumps(result.structured_content, ensure_ascii=False)
    return McpResult(
        status="failed" if result.is_error else "ok",
        tool=listener,
        text=texts,
        structured=structured,
    )


class McpConnection:
    """One MCP server, kept connected by :meth:`run` (see the module doc)."""

    def __init__(self, spec: McpServerSpec, tools: Sequence[ToolInfo]) -> None:
        self.spec = spec
        #: The tools as last listed, by name.
        self.tools: dict[str, ToolInfo] = {t.name: t for t in tools}
        self.session: Any = None
        #: Times the server was (re)connected, and restarts after a failure.
        self.connects = 0
        self.restarts = 0
        self._broken = trio.Event()
        self._relist = trio.Event()

    @property
    def up(self) -> bool:
        return self.session is not None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect and stay connected until cancelled. ``started`` once the first attempt
        (bounded by ``connect_timeout``) succeeded or failed. On cancel the session closes and a
        stdio server's process is stopped."""
        delay = BACKOFF_FIRST
        started = False
        while True:
            try:
                # Connecting and listing are bounded; a connected session is not.
                with trio.CancelScope(
                    deadline=trio.current_time() + self.spec.connect_timeout
                ) as bound:
                    async with open_session(
                        self.spec, message_handler=self._on_message, tasks=True
                    ) as session:
                        self._update(await list_tools(session))
                        bound.deadline = math.inf
                        self.session = session
                        self.connects += 1
                        delay = BACKOFF_FIRST
                        log.info(
                            "MCP server %s connected (%d tools, protocol %s)",
                            self.spec.name,
                            len(self.tools),
                            session.protocol_version,
                        )
                        if not started:
                            started = True
                            task_status.started()
                        try:
                            await self._watch(session)
                        finally:
                            self.session = None
                if bound.cancelled_caught:
                    log.warning(
                        "MCP server %s: no tool list within %gs",
                        self.spec.name,
                        self.spec.connect_timeout,
                    )
            except Exception as exc:
                log.warning("MCP server %s failed: %s", self.spec.name, _describe(exc))
            if not started:
                started = True
                task_status.started()
            self.restarts += 1
            log.warning("MCP server %s: reconnecting in %.1fs", self.spec.name, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)

    async def _watch(self, session: Any) -> None:
        """Return once the session looks dead (a failed liveness check, or a call saw it
        fail); list the tools again when the server says they changed. At 2026-07-28 the
        liveness check is ``server/discover`` (``ping`` is gone) and the change comes on a
        ``subscriptions/listen`` stream; before, ``ping`` and the session's notification."""
        self._broken = trio.Event()
        modern = _is_modern(session)
        async with trio.open_nursery() as outer:
            if modern:
                outer.start_soon(self._listen, session)
            while True:
                with trio.move_on_after(PING_INTERVAL):
                    async with trio.open_nursery() as nursery:

                        async def wake(event: trio.Event) -> None:
                            await event.wait()
                            nursery.cancel_scope.cancel()

                        nursery.start_soon(wake, self._broken)
                        nursery.start_soon(wake, self._relist)
                if self._broken.is_set():
                    break
                try:
                    with trio.fail_after(self.spec.connect_timeout):
                        if self._relist.is_set():
                            self._relist = trio.Event()
                            self._update(await list_tools(session))
                        elif modern:
                            await session.session.discover()
                        else:
                            await session.send_ping()
                except Exception as exc:
                    log.warning(
                        "MCP server %s stopped answering: %s", self.spec.name, _describe(exc)
                    )
                    break
            outer.cancel_scope.cancel()

    async def _listen(self, session: Any) -> None:
        """The tools' changes from a 2026-07-28 server (``subscriptions/listen``); a server
        that does not offer them is only logged (its tools are then those of the load)."""
        try:
            async with session.listen(tools_list_changed=True) as subscription:
                async for _event in subscription:
                    self._relist.set()
        except Exception as exc:
            log.info("MCP server %s: no tool-change stream: %s", self.spec.name, _describe(exc))

    async def _on_message(self, message: Any) -> None:
        if getattr(message, "method", None) == "notifications/tools/list_changed":
            self._relist.set()
        elif isinstance(message, Exception):
            log.debug("MCP server %s transport: %s", self.spec.name, _describe(message))
        await trio.lowlevel.checkpoint()

    def _update(self, tools: Sequence[ToolInfo]) -> None:
        """Take the tool list the server sent, logging what changed since the last one."""
        new = {t.name: t for t in tools}
        old = self.tools
        added = sorted(set(new) - set(old))
        removed = sorted(set(old) - set(new))
        changed = sorted(n for n in set(new) & set(old) if new[n] != old[n])
        allow = self.spec.allow
        if allow is not None:
            added = [n for n in added if n in allow]
        if added or removed or changed:
            log.warning(
                "MCP server %s: tools changed: added %s, removed %s, changed %s (the "
                "listeners are boot.xml's: added tools are served after a restart, removed "
                "ones answer a failed result)",
                self.spec.name,
                added or "none",
                removed or "none",
                changed or "none",
            )
        self.tools = new

    async def call_with_retries(
        self, tool: str, arguments: Mapping[str, Any], listener: str
    ) -> McpResult:
        """:meth:`call`; for an ``idempotent`` server, a failed or timed-out attempt
        (each bounded by ``timeout``; cancelled on the MCP side) is retried up to
        ``retries`` times, ``backoff(n)`` apart (a result, even a failed one, is final)."""
        if not self.spec.idempotent:
            return await self.call(tool, arguments, listener)
        return await _retrying(self, tool, arguments, listener)

    async def call(self, tool: str, arguments: Mapping[str, Any], listener: str) -> McpResult:
        """Call ``tool``. Raises DeliveryRefused (a ``<SystemError>`` for the caller) while
        the server is down or when the transport fails under the call; cancelling the
        caller cancels the request on the MCP server."""
        session = self.session
        if session is None:
            raise DeliveryRefused(
                SystemErrorCode.ROUTING,
                retry_allowed=True,
                detail=f"MCP server {self.spec.name} is not connected",
            )
        if tool not in self.tools:
            return McpResult(
                status="failed",
                tool=listener,
                text=[f"the MCP server {self.spec.name} no longer offers the tool {tool!r}"],
            )
        try:
            result = await session.call_tool(tool, dict(arguments))
        except Exception as exc:
            from mcp import MCPError

            if isinstance(exc, MCPError) and self.session is session and _is_protocol_error(exc):
                # The server answered with a JSON-RPC error (unknown tool, bad arguments):
                # a failed result the model can read, not a dead server.
                return McpResult(status="failed", tool=listener, text=[str(exc)])
            self._broken.set()
            raise DeliveryRefused(
                SystemErrorCode.ROUTING,
                retry_allowed=True,
                detail=f"MCP server {self.spec.name}: {_describe(exc)}",
            ) from None
        return result_of(listener, result)


async def _retrying(
    connection: McpConnection, tool: str, arguments: Mapping[str, Any], listener: str
) -> McpResult:
    spec = connection.spec
    attempts = 1 + spec.retries
    for attempt in range(1, attempts + 1):
        try:
            with trio.fail_after(spec.timeout):
                return await connection.call(tool, arguments, listener)
        except trio.TooSlowError:
            failure = DeliveryRefused(
                SystemErrorCode.TIMEOUT, retry_allowed=True, detail=f"{listener}: timed out"
            )
        except DeliveryRefused as exc:
            failure = exc
        if attempt == attempts:
            raise failure
        delay = backoff(attempt)
        log.warning(
            "%s: attempt %d failed (%s); retrying in %gs", listener, attempt, failure, delay
        )
        await trio.sleep(delay)
    raise AssertionError("unreachable")


def _is_protocol_error(exc: Any) -> bool:
    """A JSON-RPC error the server answered (parse error, invalid request, unknown method,
    invalid params, internal error), as opposed to the transport failing (the SDK's own
    connection-closed and timeout codes)."""
    code = getattr(getattr(exc, "error", None), "code", None)
    if code is None:
        code = getattr(exc, "code", None)
    return isinstance(code, int) and code in (-32602, -32601, -32600, -32603, -32700)


class McpHub:
    """Every ``<mcp>`` server of a topology, kept connected while :meth:`run` runs, and
    the pump handlers of their tool listeners."""

    def __init__(self, servers: Sequence[McpServerSpec]) -> None:
        self.connections = {s.name: McpConnection(s, s.tools) for s in servers}

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[McpHub]:
        """:meth:`run` in a nursery of its own for the block's duration (cancelled at its
        end: sessions closed, stdio servers stopped)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.run)
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every connection until cancelled; ``started`` once each made its first
        attempt (each at most its ``connect-timeout``)."""
        async with trio.open_nursery() as nursery:
            for connection in self.connections.values():
                await nursery.start(connection.run)
            task_status.started()

    def handler_for(
        self, server: str, tool: str, listener: str, shape: ToolShape
    ) -> Callable[[etree._Element, HandlerMetadata], Awaitable[HandlerResult]]:
        """The pump handler of tool listener ``listener`` (raw: it takes the validated
        element, turns it into the tool's JSON arguments and answers the result)."""
        connection = self.connections[server]

        async def mcp_tool(payload: etree._Element, meta: HandlerMetadata) -> HandlerResult:
            try:
                arguments = shape.to_json(payload)
            except (ArgumentError, ValueError) as exc:
                result = McpResult(status="failed", tool=listener, text=[str(exc)])
            else:
                result = await connection.call_with_retries(tool, arguments, listener)
            return HandlerResponse.respond(result)

        mcp_tool.__qualname__ = f"mcp:{listener}"
        return mcp_tool
