"""``GET /v1/listeners`` (the listeners a caller may address, with their payloads' XSDs),
``GET /v1/agents``, ``GET /v1/agents/{name}/tasks/{thread}`` and
``POST /v1/agents/{name}/tasks/{thread}/fork``."""

from __future__ import annotations

import json

from lxml import etree
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserver.agents.errors import ForkRefused, TurnPruned
from agentserver.core.threads import new_thread_id
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import problem, pruned_problem, refusal_problem


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
        agents = self.gate.agent_summaries(identity, await view.agent_list(names))
        return JSONResponse({"agents": agents})

    async def task(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        name, thread = request.path_params["name"], request.path_params["thread"]
        view = self.ctx.agents
        found = None
        if view is not None and await self.gate.task_visible(identity, name, thread, request):
            try:
                # A client's own task on the thread (another may have used the same id).
                found = await view.task(name, thread, self.gate.scope(identity))
            except TurnPruned as exc:
                return pruned_problem(exc)
        if found is None:
            return problem(404, "not-found", "Not found.")
        return JSONResponse(found)

    async def fork(self, request: Request) -> Response:
        """A new conversation from the task's Turn up to ``at_step``, continued with
        ``task`` (XML; default: the original task again). 202 with the new thread; the
        answer is kept as for ``POST /v1/messages?wait=false``."""
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        name, thread = request.path_params["name"], request.path_params["thread"]
        forks = self.ctx.forks
        if forks is None or not await self.gate.task_visible(
            identity, name, thread, request, latest=True
        ):
            # Another client's conversation answers as a missing one (docs/security.md).
            return problem(404, "not-found", "Not found.")
        body = await request.body()
        if len(body) > self.ctx.gateway.max_bytes:
            return problem(413, "too-large", "The request is too large.")
        try:
            data = json.loads(body or b"{}")
            at_step = data["at_step"]
            task = data.get("task")
            if type(at_step) is not int or not (task is None or isinstance(task, str)):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            return problem(
                400, "bad-fork", 'The body must be {"at_step": N} with an optional "task": XML.'
            )
        try:
            made = await forks.fork(name, thread, at_step)
        except TurnPruned as exc:
            return pruned_problem(exc)
        except (ForkRefused, KeyError) as exc:
            return problem(404, "not-found", str(exc).strip("'\""))
        new_thread = new_thread_id()
        forks.expect_fork(name, new_thread, made["conversation"])
        payload = (task if task is not None else made["task"]).encode()
        outcome = await self.ctx.gateway.send(
            identity, name, payload, wait=False, thread=new_thread
        )
        if outcome.kind == "refused":
            assert outcome.refusal is not None
            return refusal_problem(outcome.refusal)
        return JSONResponse(
            {
                "thread": new_thread,
                "forked_from": made["origin"],
                "task": f"/v1/agents/{name}/tasks/{new_thread}",
                "replies": f"/v1/threads/{new_thread}",
            },
            202,
            headers={"Location": f"/v1/agents/{name}/tasks/{new_thread}"},
        )
