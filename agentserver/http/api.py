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

from agentserver.agents.errors import StoreError
from agentserver.http.access import CALLER, OPEN, OPERATOR, OWNER, GuardedRoute
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import problem
from agentserver.http.query_tokens import RefuseQueryTokens
from agentserver.http.routes.a2a import A2aRoutes
from agentserver.http.routes.agents import AgentRoutes
from agentserver.http.routes.agui import AguiRoutes
from agentserver.http.routes.budgets import BudgetRoutes
from agentserver.http.routes.drain import DrainRoutes
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
    agui = AguiRoutes(ctx, gate)
    drain = DrainRoutes(ctx, gate)
    return Starlette(
        routes=[
            GuardedRoute("/healthz", status.healthz, access=OPEN),
            GuardedRoute("/readyz", status.readyz, access=OPEN),
            GuardedRoute("/metrics", status.metrics, access=CALLER),
            GuardedRoute("/v1/messages", messages.post_message, methods=["POST"], access=CALLER),
            GuardedRoute("/v1/threads/{thread}", messages.thread, access=OWNER),
            GuardedRoute("/v1/listeners", agents.listeners, access=CALLER),
            GuardedRoute("/v1/agents", agents.agents, access=CALLER),
            GuardedRoute("/v1/agents/{name}/tasks/{thread}", agents.task, access=OWNER),
            GuardedRoute(
                "/v1/agents/{name}/tasks/{thread}/fork", agents.fork, methods=["POST"], access=OWNER
            ),
            GuardedRoute("/v1/events", events.events, access=OWNER),
            GuardedRoute(
                "/v1/schedules", schedules.collection, methods=["GET", "POST"], access=OWNER
            ),
            GuardedRoute(
                "/v1/schedules/{name}", schedules.one, methods=["GET", "DELETE"], access=OWNER
            ),
            GuardedRoute(
                "/v1/schedules/{name}/{action}", schedules.action, methods=["POST"], access=OWNER
            ),
            GuardedRoute("/v1/status", status.status, access=CALLER),
            GuardedRoute("/v1/steps", status.steps, access=CALLER),
            GuardedRoute("/v1/drain", drain.start, methods=["POST"], access=OPERATOR),
            GuardedRoute("/v1/drain", drain.state, access=OPERATOR),
            GuardedRoute("/v1/webhooks", hooks.list, access=OPERATOR),
            GuardedRoute("/v1/webhooks", hooks.create, methods=["POST"], access=OPERATOR),
            GuardedRoute("/v1/webhooks/{name}", hooks.one, access=OPERATOR),
            GuardedRoute("/v1/webhooks/{name}", hooks.delete, methods=["DELETE"], access=OPERATOR),
            GuardedRoute(
                "/v1/webhooks/{name}/enable", hooks.enable, methods=["POST"], access=OPERATOR
            ),
            GuardedRoute("/v1/budgets", budgets.list, access=OWNER),
            GuardedRoute("/v1/budgets/{name}", budgets.one, access=OWNER),
            GuardedRoute("/v1/budgets/{name}", budgets.put, methods=["PUT"], access=OPERATOR),
            GuardedRoute(
                "/v1/budgets/{name}/reset", budgets.reset, methods=["POST"], access=OPERATOR
            ),
            *ui_routes(ctx, gate, events, status),
            GuardedRoute(
                "/mcp", McpRoute(ctx, gate), methods=["GET", "POST", "DELETE"], access=CALLER
            ),
            GuardedRoute("/.well-known/agent-card.json", a2a.card, access=OPEN),
            GuardedRoute("/a2a", a2a.rpc, methods=["POST"], access=OWNER),
            GuardedRoute("/a2a/agents/{name}", a2a.rpc, methods=["POST"], access=OWNER),
            GuardedRoute("/a2a/agents/{name}/agent-card.json", a2a.agent_card, access=OPEN),
            # An AG-UI run: sends as the caller; a reconnection or a resume reaches only
            # the caller's own run (its thread is derived from the caller; an interrupt
            # is answered after the rule's check of its task).
            GuardedRoute("/agui/agents/{name}", agui.run, methods=["POST"], access=OWNER),
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
