"""``/healthz``, ``/readyz``, ``/metrics``, ``/v1/status`` and ``/v1/steps`` (the remote
listeners' step log)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserver.agents.governance.budgets import near_limit
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import problem
from agentserver.http.routes.budgets import row_json
from agentserver.http.routes.events import EventRoutes

#: What ``/v1/status`` shows of each webhook (its URL and settings: ``/v1/webhooks``).
STATUS_FIELDS = (
    "name",
    "agent",
    "pending",
    "delivered",
    "expired",
    "failures",
    "failing",
    "failing_since",
    "last_ok_at",
    "last_error",
    "disabled",
    "disabled_at",
)


class StatusRoutes:
    """The health, metrics and status routes of one app. ``events``: the app's event
    routes (the status counts their open streams)."""

    def __init__(self, ctx: HttpContext, gate: Gate, events: EventRoutes) -> None:
        self.ctx = ctx
        self.gate = gate
        self.events = events

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readiness(self) -> dict[str, Any]:
        ctx = self.ctx
        checks: dict[str, bool | None] = {"pump": ctx.pump.running, "store": None, "llm": None}
        if ctx.agents is not None:
            checks["store"] = await ctx.agents.reachable()
            if ctx.backends is not None:
                backends = ctx.backends().values()
                checks["llm"] = any(
                    b.get("skipped") is None
                    and b.get("breaker") != "open"
                    and not b.get("cooling_for")
                    for b in backends
                )
            else:
                checks["llm"] = False
        ready = all(v is not False for v in checks.values())
        return {"ready": ready, "checks": checks}

    async def readyz(self, request: Request) -> Response:
        body = await self.readiness()
        return JSONResponse(body, 200 if body["ready"] else 503)

    async def metrics(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        return Response(generate_latest(self.ctx.registry), media_type=CONTENT_TYPE_LATEST)

    async def status_document(self) -> dict[str, Any]:
        ctx = self.ctx
        pump = ctx.pump
        stats = pump.stats()
        # The per-listener part of stats, typed (the same figures: nothing awaits between).
        per_listener = pump.roster.queue_stats()
        listeners = [
            {
                "name": lst.name,
                "agent": lst.agent,
                "queue": per_listener["queues"].get(lst.name, 0),
                "waiting": per_listener["waiting"].get(lst.name, 0),
                "handled": per_listener["handled"].get(lst.name, 0),
            }
            for lst in pump.listeners
        ]
        view = ctx.agents
        hooks = ctx.webhooks
        return {
            "organism": ctx.organism,
            "version": ctx.version,
            "ready": await self.readiness(),
            "pump": {k: v for k, v in stats.items() if k not in ("queues", "waiting", "handled")},
            "listeners": listeners,
            "agents": await view.agent_list() if view is not None else [],
            "backends": ctx.backends() if ctx.backends is not None else {},
            "connections": {
                **ctx.transports(),
                "http_pending": ctx.gateway.active,
                "http_kept_threads": len(ctx.gateway.pending),
                "sse_streams": self.events.streams,
            },
            "http": {**ctx.counters, **ctx.gateway.counters},
            "webhooks": [
                {k: w[k] for k in STATUS_FIELDS}
                for w in (await hooks.status() if hooks is not None and hooks.specs() else [])
            ],
            # the spend budgets at 80 % or more of a limit (docs/budgets.md)
            "budgets_near_limit": (
                [row_json(r) for r in near_limit(await ctx.budgets.rows())]
                if ctx.budgets is not None
                else []
            ),
        }

    async def steps(self, request: Request) -> Response:
        """The remote listeners' step log, oldest first: ``?listener=``, ``?step=``,
        ``?after=SEQ`` (page on from the last row's ``seq``), ``?limit=`` (1-1000)."""
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        q = request.query_params
        try:
            after, limit = int(q.get("after", "0")), int(q.get("limit", "100"))
        except ValueError:
            return problem(400, "bad-request", "after and limit are integers.")
        log_ = self.ctx.steps
        listener = q.get("listener") or None
        if log_ is None or (listener is not None and not self.gate.may_see(identity, listener)):
            return JSONResponse({"durable": False, "steps": []})
        rows = await log_.rows(
            step=q.get("step") or None, listener=listener, after=after, limit=limit
        )
        return JSONResponse(
            {
                "durable": log_.durable,
                "steps": [r.as_dict() for r in rows if self.gate.may_see(identity, r.listener)],
            }
        )

    async def status(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        doc = await self.status_document()
        doc["agents"] = self.gate.agent_summaries(identity, doc["agents"])
        return JSONResponse(doc)
