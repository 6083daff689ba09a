"""The A2A routes (docs/a2a.md): the server's Agent Card at
``/.well-known/agent-card.json``, each exposed agent's at
``/a2a/agents/{name}/agent-card.json``, and the JSON-RPC endpoints ``/a2a`` (every
exposed agent, picked by skill) and ``/a2a/agents/{name}`` (that agent alone).

The endpoints are the SDK's own JSON-RPC dispatcher (``A2A-Version`` checked, errors with
the A2A codes, SSE for the streaming methods; it runs on anyio, so under trio) behind the
HTTP API's authentication and size limit; it calls :class:`A2aHandler`. The cards are
public when clients are declared (they say how to authenticate), else served to
loopback callers only, as everything else."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserver.http.a2a.scope import AGENT, BASE_URL, IDENTITY
from agentserver.http.a2a.versions import HEADER, VERSION_NOT_SUPPORTED, refusal
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import problem

_SCOPE_KEY = "agentserver.a2a"


def _dispatcher(handler: Any) -> Any:
    """The SDK's JSON-RPC dispatcher calling ``handler``, whose call contexts carry what
    the route found (imported here: the SDK is the optional ``a2a`` extra)."""
    from a2a.server.routes.common import DefaultServerCallContextBuilder
    from a2a.server.routes.jsonrpc_dispatcher import JsonRpcDispatcher

    class Contexts(DefaultServerCallContextBuilder):
        def build(self, request: Request) -> Any:
            context = super().build(request)
            context.state.update(request.scope.get(_SCOPE_KEY, {}))
            return context

    # The 0.3 method names (message/send, tasks/get, ...) are served beside 1.0's by the
    # SDK's own adapter, on the same handler: the same tasks either way.
    return JsonRpcDispatcher(handler, context_builder=Contexts(), enable_v0_3_compat=True)


def _card_json(card: Any) -> JSONResponse:
    from a2a.server.request_handlers.response_helpers import agent_card_to_dict

    return JSONResponse(agent_card_to_dict(card))


def _version_refusal(body: bytes, header: str | None) -> Response | None:
    """VersionNotSupported for a request whose ``A2A-Version`` does not fit its method
    (:func:`agentserver.http.a2a.versions.refusal`); None: the dispatcher answers (a body
    that is not a JSON-RPC request included: it says why)."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    why = refusal(request.get("method"), header)
    if why is None:
        return None
    ident = request.get("id")
    if isinstance(ident, bool) or not isinstance(ident, str | int):
        ident = None
    return JSONResponse(
        {"jsonrpc": "2.0", "id": ident, "error": {"code": VERSION_NOT_SUPPORTED, "message": why}}
    )


class A2aRoutes:
    """The A2A routes of one app (404 while ``<expose-a2a>`` is absent)."""

    def __init__(self, ctx: HttpContext, gate: Gate) -> None:
        self.ctx = ctx
        self.gate = gate
        #: :class:`agentserver.http.a2a.handler.A2aHandler`, or None.
        self.handler: Any = ctx.a2a
        self.dispatcher = _dispatcher(self.handler) if self.handler is not None else None

    def _base_url(self, request: Request) -> str:
        assert self.handler is not None
        return self.handler.deps.public_url or str(request.base_url).rstrip("/")

    async def _may_read_card(self, request: Request) -> Response | None:
        if self.handler is None:
            return problem(404, "not-found", "Not found.")
        if self.ctx.auth.required:
            return None
        identity = await self.gate.identify(request)
        return identity if isinstance(identity, Response) else None

    async def card(self, request: Request) -> Response:
        refused = await self._may_read_card(request)
        if refused is not None:
            return refused
        assert self.handler is not None
        deps = self.handler.deps
        from agentserver.http.a2a.card import server_card

        return _card_json(server_card(deps.facts, self._base_url(request), deps.skills))

    async def agent_card(self, request: Request) -> Response:
        refused = await self._may_read_card(request)
        if refused is not None:
            return refused
        assert self.handler is not None
        skill = self.handler.by_name.get(request.path_params["name"])
        if skill is None:
            return problem(404, "not-found", "Not found.")
        from agentserver.http.a2a.card import agent_card

        return _card_json(agent_card(self.handler.deps.facts, self._base_url(request), skill))

    async def rpc(self, request: Request) -> Response:
        if self.dispatcher is None or self.handler is None:
            return problem(404, "not-found", "Not found.")
        name = request.path_params.get("name")
        if name is not None and name not in self.handler.by_name:
            return problem(404, "not-found", "Not found.")
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        body = await request.body()  # kept by Starlette: the dispatcher reads it again
        if len(body) > self.ctx.gateway.max_bytes:
            return problem(413, "too-large", "The request is too large.")
        refused = _version_refusal(body, request.headers.get(HEADER))
        if refused is not None:
            return refused
        state: dict[str, Any] = {IDENTITY: identity, BASE_URL: self._base_url(request)}
        if name is not None:
            state[AGENT] = name
        request.scope[_SCOPE_KEY] = state
        return await self.dispatcher.handle_requests(request)
