"""The web console's pages (GET): rendered on the server from
:mod:`agentserver.http.ui.data` documents through autoescaping Jinja2 templates, and the
same documents as JSON for the pages' script to refresh them, plus the event stream the
task page listens to (the API's own SSE stream, authenticated by the console's cookie)."""

from __future__ import annotations

from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from agentserver.core.handshake import Identity
from agentserver.core.threads import is_uuid4
from agentserver.http.context import HttpContext
from agentserver.http.problems import problem
from agentserver.http.routes.events import EventRoutes
from agentserver.http.ui.data import ConsoleData
from agentserver.http.ui.security import CSRF_FIELD, page_headers, safe_next
from agentserver.http.ui.session import SessionBoundStream, UiSession


def environment() -> jinja2.Environment:
    """The templates shipped in the package, every substitution HTML-escaped."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader("agentserver.http.ui", "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


class Pages:
    """The GET routes of the console of one app."""

    def __init__(
        self,
        ctx: HttpContext,
        session: UiSession,
        data: ConsoleData,
        events: EventRoutes,
        templates: jinja2.Environment,
    ) -> None:
        self.ctx = ctx
        self.session = session
        self.data = data
        self.events = events
        self.templates = templates

    def render(
        self,
        request: Request,
        template: str,
        identity: Identity | None,
        status: int = 200,
        **values: Any,
    ) -> Response:
        browser, new = self.session.browser_of(request)
        notice = request.query_params.get("notice", "")
        html = self.templates.get_template(template).render(
            organism=self.ctx.organism,
            version=self.ctx.version,
            caller=identity.name if identity is not None else None,
            needs_login=self.session.needs_login,
            csrf_field=CSRF_FIELD,
            csrf=self.session.csrf_token(request, browser),
            here=_here(request),
            notice=notice[:300],
            **values,
        )
        return self.session.finish(HTMLResponse(html, status), browser, new)

    def json(self, body: Any) -> Response:
        return JSONResponse(body, headers=page_headers())

    async def overview(self, request: Request) -> Response:
        identity = await self.session.page_identity(request)
        if isinstance(identity, Response):
            return identity
        doc = await self.data.overview(identity)
        return self.render(request, "overview.html", identity, doc=doc)

    async def login(self, request: Request) -> Response:
        return self.render(
            request,
            "login.html",
            None,
            next=safe_next(request.query_params.get("next")),
            failed=request.query_params.get("failed") == "1",
        )

    async def agent(self, request: Request) -> Response:
        identity = await self.session.page_identity(request)
        if isinstance(identity, Response):
            return identity
        name = request.path_params["name"]
        doc = await self.data.agent(identity, name)
        if doc is None:
            return self.not_found(request, identity)
        return self.render(request, "agent.html", identity, name=name, doc=doc)

    async def task(self, request: Request) -> Response:
        identity = await self.session.page_identity(request)
        if isinstance(identity, Response):
            return identity
        name, thread = request.path_params["name"], request.path_params["thread"]
        doc = await self.data.task(identity, name, thread, request) if is_uuid4(thread) else None
        if doc is None:
            return self.not_found(request, identity)
        return self.render(request, "task.html", identity, name=name, thread=thread, doc=doc)

    async def thread(self, request: Request) -> Response:
        """The replies to a payload the caller sent a listener (kept by the gateway)."""
        identity = await self.session.page_identity(request)
        if isinstance(identity, Response):
            return identity
        thread = request.path_params["thread"]
        replies = self.data.replies(identity, thread, request) if is_uuid4(thread) else None
        if replies is None:
            return self.not_found(request, identity)
        to = request.query_params.get("to", "")
        return self.render(request, "thread.html", identity, thread=thread, to=to, replies=replies)

    def not_found(self, request: Request, identity: Identity) -> Response:
        return self.render(request, "missing.html", identity, status=404)

    # -- the same documents as JSON, for the pages' script ---------------------------------

    async def overview_json(self, request: Request) -> Response:
        identity = await self.session.identify(request)
        if isinstance(identity, Response):
            return identity
        return self.json(await self.data.overview(identity))

    async def agent_json(self, request: Request) -> Response:
        identity = await self.session.identify(request)
        if isinstance(identity, Response):
            return identity
        doc = await self.data.agent(identity, request.path_params["name"])
        if doc is None:
            return problem(404, "not-found", "Not found.")
        return self.json(doc)

    async def task_json(self, request: Request) -> Response:
        identity = await self.session.identify(request)
        if isinstance(identity, Response):
            return identity
        name, thread = request.path_params["name"], request.path_params["thread"]
        doc = await self.data.task(identity, name, thread, request) if is_uuid4(thread) else None
        if doc is None:
            return problem(404, "not-found", "Not found.")
        return self.json(doc)

    async def thread_json(self, request: Request) -> Response:
        identity = await self.session.identify(request)
        if isinstance(identity, Response):
            return identity
        thread = request.path_params["thread"]
        replies = self.data.replies(identity, thread, request) if is_uuid4(thread) else None
        if replies is None:
            return problem(404, "not-found", "Not found.")
        return self.json({"thread": thread, "replies": replies})

    async def events_stream(self, request: Request) -> Response | SessionBoundStream:
        """``/v1/events`` for the browser (EventSource sends no Authorization header): the
        same stream and filters, the caller from the console's cookie."""
        identity = await self.session.identify(request)
        if isinstance(identity, Response):
            return identity
        response = self.events.respond(identity, request.query_params)
        response.headers.update(page_headers())
        # A stream outlives its request: it ends when the session is signed out or expires.
        return self.session.bound_stream(request, response)


def _here(request: Request) -> str:
    """Where a form of this page returns to (without the last notice)."""
    return request.url.path
