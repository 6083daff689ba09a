"""The Starlette app of the HTTP API (reference: docs/http-api.md).

Runs on trio (Starlette runs on anyio; Hypercorn's trio worker drives it). Every route
but ``/healthz`` and ``/readyz`` authenticates the caller (:mod:`agentserver.http.gate`);
every error is an RFC 9457 problem (:mod:`agentserver.http.problems`). The routes live in
:mod:`agentserver.http.routes`, one module per resource; this module assembles them.
"""

from __future__ import annotations

import logging
import sqlite3

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentserver.agents.errors import StoreError
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import problem
from agentserver.http.query_tokens import RefuseQueryTokens
from agentserver.http.routes.a2a import A2aRoutes
from agentserver.http.routes.agents import AgentRoutes
from agentserver.http.routes.budgets import BudgetRoutes
from agentserver.http.routes.events import SSE_BUFFER, SSE_KEEPALIVE, EventRoutes
from agentserver.http.routes.mcp import McpRoute
from agentserver.http.routes.messages import THREAD_HEADER, XML, MessageRoutes
from agentserver.http.routes.schedules import ScheduleRoutes
from agentserver.http.routes.status import StatusRoutes
from agentserver.http.routes.webhooks import WebhookRoutes
from agentserver.http.ui.app import ui_routes

__all__ = [
    "SSE_BUFFER",
    "SSE_KEEPALIVE",
    "THREAD_HEADER",
    "XML",
    "HttpContext",
    "build_app",
]

log = logging.getLogger("agentserver.http")


def build_app(ctx: HttpContext) -> Starlette:
    gate = Gate(ctx)
    messages = MessageRoutes(ctx, gate)
    agents = AgentRoutes(ctx, gate)
    events = EventRoutes(ctx, gate)
    status = StatusRoutes(ctx, gate, events)
    hooks = WebhookRoutes(ctx, gate)
    budgets = BudgetRoutes(ctx, gate)
    schedules = ScheduleRoutes(ctx, gate)
    a2a = A2aRoutes(ctx, gate)
    return Starlette(
        routes=[
            Route("/healthz", status.healthz),
            Route("/readyz", status.readyz),
            Route("/metrics", status.metrics),
            Route("/v1/messages", messages.post_message, methods=["POST"]),
            Route("/v1/threads/{thread}", messages.thread),
            Route("/v1/listeners", agents.listeners),
            Route("/v1/agents", agents.agents),
            Route("/v1/agents/{name}/tasks/{thread}", agents.task),
            Route("/v1/agents/{name}/tasks/{thread}/fork", agents.fork, methods=["POST"]),
            Route("/v1/events", events.events),
            Route("/v1/schedules", schedules.collection, methods=["GET", "POST"]),
            Route("/v1/schedules/{name}", schedules.one, methods=["GET", "DELETE"]),
            Route("/v1/schedules/{name}/{action}", schedules.action, methods=["POST"]),
            Route("/v1/status", status.status),
            Route("/v1/steps", status.steps),
            Route("/v1/webhooks", hooks.list),
            Route("/v1/webhooks", hooks.create, methods=["POST"]),
            Route("/v1/webhooks/{name}", hooks.one),
            Route("/v1/webhooks/{name}", hooks.delete, methods=["DELETE"]),
            Route("/v1/webhooks/{name}/enable", hooks.enable, methods=["POST"]),
            Route("/v1/budgets", budgets.list),
            Route("/v1/budgets/{name}", budgets.one),
            Route("/v1/budgets/{name}", budgets.put, methods=["PUT"]),
            Route("/v1/budgets/{name}/reset", budgets.reset, methods=["POST"]),
            *ui_routes(ctx, gate, events, status),
            Route("/mcp", McpRoute(ctx, gate), methods=["GET", "POST", "DELETE"]),
            Route("/.well-known/agent-card.json", a2a.card),
            Route("/a2a", a2a.rpc, methods=["POST"]),
            Route("/a2a/agents/{name}", a2a.rpc, methods=["POST"]),
            Route("/a2a/agents/{name}/agent-card.json", a2a.agent_card),
        ],
        # Every door, the unauthenticated ones too: a token in a URL is refused.
        middleware=[Middleware(RefuseQueryTokens, auth=ctx.auth, counters=ctx.counters)],
        exception_handlers={
            404: _not_found,
            405: _not_allowed,
            StoreError: _store_unavailable,
            sqlite3.Error: _store_unavailable,
        },
    )


async def _not_found(request: Request, exc: Exception) -> Response:
    return problem(404, "not-found", "Not found.")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return problem(405, "method-not-allowed", "Method not allowed.")


async def _store_unavailable(request: Request, exc: Exception) -> Response:
    # A view read through the agent store failed (the database unreachable, or closed at
    # shutdown): the caller may retry; the details are for the log only.
    log.warning("%s: the agent store could not be read: %s", request.url.path, exc)
    return problem(
        503, "store-unavailable", "The agent store cannot be read now.", {"Retry-After": "5"}
    )
