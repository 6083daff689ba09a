"""The web console's routes under ``/ui``, assembled for the API's app
(:func:`agentserver.http.api.build_app`): pages, their JSON, the event stream, the
actions and the package's static files."""

from __future__ import annotations

from starlette.routing import BaseRoute
from starlette.staticfiles import StaticFiles

from agentserver.agents.clock import SystemClock
from agentserver.http.access import CALLER, OPEN, OPERATOR, OWNER, GuardedMount, GuardedRoute
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.routes.events import EventRoutes
from agentserver.http.routes.status import StatusRoutes
from agentserver.http.ui.actions import Actions
from agentserver.http.ui.data import ConsoleData
from agentserver.http.ui.pages import Pages, environment
from agentserver.http.ui.security import CsrfGuard
from agentserver.http.ui.session import UiSession
from agentserver.http.ui.sessions import MemorySessionTable, UiSessions


def ui_routes(
    ctx: HttpContext, gate: Gate, events: EventRoutes, status: StatusRoutes
) -> list[BaseRoute]:
    """The console's routes, on the API's gate (same tokens, same throttling)."""
    sessions = ctx.ui_sessions
    if sessions is None:
        # An app built without the composition root's sessions (no agents' store was
        # given): this process's memory, the system clock.
        sessions = UiSessions(MemorySessionTable(SystemClock()), ctx.auth)
    session = UiSession(gate, CsrfGuard(), sessions, secure=ctx.tls)
    data = ConsoleData(ctx, status, gate)
    pages = Pages(ctx, session, data, events, environment())
    actions = Actions(ctx, session, data)
    post = ["POST"]
    return [
        GuardedRoute("/ui", pages.overview, access=CALLER),
        GuardedRoute("/ui/login", pages.login, access=OPEN),
        GuardedRoute("/ui/login", actions.login, methods=post, access=OPEN),
        GuardedRoute("/ui/logout", actions.logout, methods=post, access=CALLER),
        GuardedRoute("/ui/agents/{name}", pages.agent, access=OWNER),
        GuardedRoute("/ui/agents/{name}/tasks/{thread}", pages.task, access=OWNER),
        GuardedRoute("/ui/threads/{thread}", pages.thread, access=OWNER),
        GuardedRoute("/ui/events", pages.events_stream, access=OWNER),
        GuardedRoute("/ui/api/overview", pages.overview_json, access=CALLER),
        GuardedRoute("/ui/api/agents/{name}", pages.agent_json, access=OWNER),
        GuardedRoute("/ui/api/agents/{name}/tasks/{thread}", pages.task_json, access=OWNER),
        GuardedRoute("/ui/api/threads/{thread}", pages.thread_json, access=OWNER),
        GuardedRoute("/ui/send", actions.send, methods=post, access=CALLER),
        GuardedRoute("/ui/approvals/{request}/decide", actions.decide, methods=post, access=OWNER),
        GuardedRoute(
            "/ui/agents/{name}/{verb:str}", actions.operate, methods=post, access=OPERATOR
        ),
        GuardedMount(
            "/ui/static",
            StaticFiles(packages=[("agentserver.http.ui", "static")]),
            access=OPEN,
        ),
    ]
