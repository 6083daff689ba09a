"""``/v1/webhooks``: the webhooks declared and made at run time, their delivery state;
made, deleted and enabled again by operators (docs/webhooks.md)."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserver.agents.edge.hooksign import SecretError
from agentserver.agents.edge.webhooks import WebhookExists, WebhookNotFound, Webhooks
from agentserver.agents.profile.webhooks import (
    DURATIONS,
    WebhookConfigError,
    WebhookSpec,
    webhook_duration,
)
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import problem

#: The most bytes of a ``POST /v1/webhooks`` body.
MAX_BODY = 16384

#: The JSON fields of the durations: seconds, or a duration as boot.xml writes it ("24h").
_DURATIONS = {attr.replace("-", "_"): field for attr, field in DURATIONS.items()}


#: What a bad ``POST /v1/webhooks`` body raises (a 400 problem naming it).
REFUSED = (ValueError, TypeError, KeyError, OverflowError, WebhookConfigError, SecretError)


class WebhookRoutes:
    """The routes of one app over the server's :class:`Webhooks` (None: no agents)."""

    def __init__(self, ctx: HttpContext, gate: Gate) -> None:
        self.ctx = ctx
        self.gate = gate

    async def _hooks(self, request: Request) -> Webhooks | Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        if not self.gate.sees_all(identity):
            # The same answer whatever the request names (docs/security.md).
            self.gate.refuse(identity, request)
            return problem(403, "forbidden", "Only an operator may see and change webhooks.")
        if self.ctx.webhooks is None:
            return problem(404, "no-webhooks", "Webhooks need the agents' store (no agent).")
        return self.ctx.webhooks

    async def list(self, request: Request) -> Response:
        hooks = await self._hooks(request)
        if isinstance(hooks, Response):
            return hooks
        return JSONResponse({"webhooks": await hooks.status()})

    async def create(self, request: Request) -> Response:
        hooks = await self._hooks(request)
        if isinstance(hooks, Response):
            return hooks
        raw = await request.body()
        if len(raw) > MAX_BODY:
            return problem(413, "too-large", f"A webhook is at most {MAX_BODY} bytes of JSON.")
        try:
            spec = spec_from_json(json.loads(raw))
            made = await hooks.create(spec)
        except REFUSED as exc:
            return problem(400, "bad-request", f"Not a valid webhook: {exc}")
        except WebhookExists:
            return problem(409, "conflict", f"A webhook named {spec.name!r} exists already.")
        body = {**made.public(), "secret": made.secret}
        return JSONResponse(body, 201, headers={"Location": f"/v1/webhooks/{made.name}"})

    async def one(self, request: Request) -> Response:
        hooks = await self._hooks(request)
        if isinstance(hooks, Response):
            return hooks
        name = request.path_params["name"]
        for entry in await hooks.status():
            if entry["name"] == name:
                try:
                    limit = int(request.query_params.get("limit", "50"))
                except ValueError:
                    return problem(400, "bad-request", "limit is an integer.")
                entry["deliveries"] = await hooks.deliveries(name, limit)
                return JSONResponse(entry)
        return problem(404, "not-found", f"No webhook named {name!r}.")

    async def delete(self, request: Request) -> Response:
        hooks = await self._hooks(request)
        if isinstance(hooks, Response):
            return hooks
        name = request.path_params["name"]
        spec = hooks.spec(name)
        if spec is not None and not spec.runtime:
            return problem(409, "conflict", f"Webhook {name!r} is declared in boot.xml.")
        try:
            await hooks.delete(name)
        except WebhookNotFound:
            return problem(404, "not-found", f"No webhook named {name!r}.")
        return Response(status_code=204)

    async def enable(self, request: Request) -> Response:
        hooks = await self._hooks(request)
        if isinstance(hooks, Response):
            return hooks
        name = request.path_params["name"]
        try:
            n = await hooks.enable(name)
        except WebhookNotFound:
            return problem(404, "not-found", f"No webhook named {name!r}.")
        return JSONResponse({"name": name, "enabled": True, "requeued": n})


def spec_from_json(doc: Any) -> WebhookSpec:
    """A webhook from ``POST /v1/webhooks``'s JSON (checked by :meth:`Webhooks.create`)."""
    if not isinstance(doc, dict):
        raise ValueError("the body is a JSON object")
    unknown = set(doc) - {"name", "url", "events", "agent", "secret", "concurrency", *_DURATIONS}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    events = doc.get("events", [])
    if isinstance(events, str):
        events = events.split()
    if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
        raise ValueError("events is a list of event names")
    kw: dict[str, Any] = {
        field: webhook_duration(doc[key], key) for key, field in _DURATIONS.items() if key in doc
    }
    if "concurrency" in doc:
        kw["concurrency"] = int(doc["concurrency"])
    for key in ("name", "url"):
        if not isinstance(doc.get(key), str):
            raise ValueError(f"{key} is a string")
    agent = doc.get("agent")
    if agent is not None and not isinstance(agent, str):
        raise ValueError("agent is a string")
    secret = doc.get("secret", "")
    if not isinstance(secret, str):
        raise ValueError("secret is a string (whsec_ + base64)")
    return WebhookSpec(
        name=doc["name"],
        url=doc["url"],
        events=tuple(dict.fromkeys(events)),
        secret=secret,
        agent=agent,
        **kw,
    )
