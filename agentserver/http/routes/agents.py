"""``GET /v1/listeners`` (the listeners a caller may address, with their payloads' XSDs),
``GET /v1/agents`` and ``GET /v1/agents/{name}/tasks/{thread}``."""

from __future__ import annotations

from lxml import etree
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import problem


class AgentRoutes:
    """The listener and agent routes of one app."""

    def __init__(self, ctx: HttpContext, gate: Gate) -> None:
        self.ctx = ctx
        self.gate = gate

    async def listeners(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        pump = self.ctx.pump
        out = []
        for listener in pump.listeners:
            if not self.gate.may_see(identity, listener.name):
                continue
            types = []
            for model in listener.payload_types:
                ptype = next((p for p in pump.payloads if p.model is model), None)
                if ptype is None or ptype.namespace.startswith("https://xml-pipeline.org/ns/"):
                    continue  # core primitives: only the pump sends them
                types.append(
                    {
                        "root": ptype.tag,
                        "xsd": etree.tostring(ptype.schema_doc, encoding="unicode"),
                    }
                )
            if types:
                out.append(
                    {
                        "name": listener.name,
                        "description": listener.description,
                        "agent": listener.agent,
                        "payloads": types,
                    }
                )
        return JSONResponse({"listeners": out})

    async def agents(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        view = self.ctx.agents
        if view is None:
            return JSONResponse({"agents": []})
        names = [n for n in view.agents if self.gate.may_see(identity, n)]
        return JSONResponse({"agents": await view.agent_list(names)})

    async def task(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        name = request.path_params["name"]
        view = self.ctx.agents
        found = None
        if view is not None and name in view.agents and self.gate.may_see(identity, name):
            found = await view.task(name, request.path_params["thread"])
        if found is None:
            return problem(404, "not-found", "Not found.")
        return JSONResponse(found)
