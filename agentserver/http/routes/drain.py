"""``POST /v1/drain`` and ``GET /v1/drain``: drain this process (docs/deploy.md,
"Deploying with Turns in flight"), an operator's only."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import problem


class DrainRoutes:
    def __init__(self, ctx: HttpContext, gate: Gate) -> None:
        self.ctx = ctx
        self.gate = gate

    async def _operator(self, request: Request) -> Response | None:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        if not self.gate.sees_all(identity):
            self.gate.refuse(identity, request)
            return problem(403, "forbidden", "Only an operator may drain the server.")
        if self.ctx.drain is None:
            return problem(409, "no-drain", "This server cannot be drained over HTTP.")
        return None

    async def start(self, request: Request) -> Response:
        """Begin the drain: 202 with its state (a second call: the same drain's)."""
        refused = await self._operator(request)
        if refused is not None:
            return refused
        assert self.ctx.drain is not None
        return JSONResponse(self.ctx.drain.start(), status_code=202)

    async def state(self, request: Request) -> Response:
        refused = await self._operator(request)
        if refused is not None:
            return refused
        assert self.ctx.drain is not None
        return JSONResponse(self.ctx.drain.state())
