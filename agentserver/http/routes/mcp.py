"""``/mcp``: the exposed listeners as an MCP server over streamable HTTP (docs/mcp.md),
behind the same authentication as every other route."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import problem


class McpRoute:
    """An ASGI app (Starlette hands it the raw request: the SDK answers with its own
    streams)."""

    def __init__(self, ctx: HttpContext, gate: Gate) -> None:
        self.ctx = ctx
        self.gate = gate

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.ctx.mcp is None:
            await problem(404, "not-found", "Not found.")(scope, receive, send)
            return
        identity = await self.gate.identify(Request(scope, receive))
        if isinstance(identity, Response):
            await identity(scope, receive, send)
            return
        await self.ctx.mcp.handle(scope, receive, send, identity)
