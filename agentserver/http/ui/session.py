"""Who a browser is, for the web console: its sign-in session (``http/ui/sessions.py``:
the cookie holds a random session id, never the token), or the API's gate for a script's
``Authorization`` header and for anonymous callers; the CSRF cookie; the POST check."""

from __future__ import annotations

import hmac
import logging
import sqlite3
from typing import Any
from urllib.parse import parse_qsl, quote

import trio
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from agentserver.agents.errors import StoreError
from agentserver.core.handshake import Identity
from agentserver.http.gate import Gate
from agentserver.http.problems import problem
from agentserver.http.ui.security import (
    CSRF_COOKIE,
    CSRF_FIELD,
    CSRF_HEADER,
    LEGACY_TOKEN_COOKIE,
    SESSION_COOKIE,
    CsrfGuard,
    page_headers,
    same_origin,
    session_csrf,
)
from agentserver.http.ui.sessions import UiSessions

log = logging.getLogger("agentserver.http.ui")

#: Fields a console form has at most.
MAX_FIELDS = 20
FORM = "application/x-www-form-urlencoded"
#: ``request.state.ui_identity`` before the request's session was resolved.
_UNRESOLVED = object()
#: Seconds between the checks of an open event stream's session (it ends soon after the
#: session is signed out, on any process, or expires).
STREAM_RECHECK = 5.0


def own_origin(request: Request) -> str:
    """This server's origin as the browser addressed it."""
    url = request.url
    return f"{url.scheme}://{url.netloc}"


class UiSession:
    """Authenticates the console's requests of one app and guards its POSTs."""

    def __init__(self, gate: Gate, csrf: CsrfGuard, sessions: UiSessions, *, secure: bool) -> None:
        self.gate = gate
        self.csrf = csrf
        self.sessions = sessions
        self.secure = secure

    @property
    def needs_login(self) -> bool:
        """Clients are declared: the browser must sign in with one's token."""
        return self.gate.ctx.auth.required

    async def signed_in(self, request: Request) -> Identity | None:
        """The client of the request's session cookie; None without one, or for an
        unknown, expired or revoked session. Resolved once per request."""
        known = getattr(request.state, "ui_identity", _UNRESOLVED)
        if known is None or isinstance(known, Identity):  # resolved already
            return known
        session = request.cookies.get(SESSION_COOKIE)
        identity = await self.sessions.resolve(session) if session else None
        request.state.ui_identity = identity
        if identity is not None:
            request.state.ui_session = session
        return identity

    async def identify(self, request: Request) -> Identity | Response:
        """The caller (the session of the console's cookie, or the Authorization header
        of a script), or the problem refusing it: 401 for a session cookie that no
        longer stands for anyone."""
        if not self.needs_login or not request.cookies.get(SESSION_COOKIE):
            return await self.gate.identify(request)
        counters = self.gate.ctx.counters
        counters["requests"] += 1
        identity = await self.signed_in(request)
        if identity is None:
            # Not a failed authentication (not throttled): a session id is 256 random
            # bits, so there is nothing to guess; it expired or was signed out.
            counters["unauthenticated"] += 1
            response = problem(
                401,
                "ui-session",
                "Not signed in: the console session is unknown, expired or signed out. "
                "Sign in again at /ui/login.",
                {"WWW-Authenticate": "Bearer"},
            )
            response.headers.update(page_headers())
            self.clear_login(response)
            return response
        return identity

    async def page_identity(self, request: Request) -> Identity | Response:
        """As :meth:`identify`, but a page sends a browser without a valid session to the
        sign-in page rather than showing a problem."""
        if self.needs_login and not request.cookies.get(SESSION_COOKIE):
            # Not signed in yet: no credentials tried, so not a failed authentication
            # (which would slow down this address's API calls too).
            return self.to_login(request)
        identity = await self.identify(request)
        if (
            isinstance(identity, Response)
            and self.needs_login
            and identity.status_code in (401, 403)
        ):
            response = self.to_login(request)
            self.clear_login(response)
            return response
        return identity

    def bound_stream(self, request: Request, response: Response) -> Response | SessionBoundStream:
        """``response`` (an event stream) ended once the request's session no longer
        stands for anyone; as is without a session (anonymous, or a script's header)."""
        session = getattr(request.state, "ui_session", None)
        if session is None:
            return response
        return SessionBoundStream(response, self.sessions, session)

    @staticmethod
    def to_login(request: Request) -> Response:
        """The login page, coming back here once signed in."""
        target = request.url.path
        if request.url.query:
            target += "?" + request.url.query
        return RedirectResponse(f"/ui/login?next={quote(target, safe='/')}", 303, page_headers())

    def browser_of(self, request: Request) -> tuple[str, bool]:
        """The browser's CSRF cookie and whether it is new (then :meth:`finish` sets it)."""
        browser = request.cookies.get(CSRF_COOKIE)
        if browser and 20 <= len(browser) <= 100:
            return browser, False
        return self.csrf.new_session(), True

    def csrf_token(self, request: Request, browser: str) -> str:
        """The CSRF token of this page's forms: the sign-in session's, once resolved for
        this request (good on every process), else the browser cookie's."""
        session = getattr(request.state, "ui_session", None)
        return session_csrf(session) if session else self.csrf.token(browser)

    def finish(self, response: Response, browser: str, new: bool) -> Response:
        """The console's headers, and the CSRF cookie if it is new."""
        response.headers.update(page_headers())
        if new:
            response.set_cookie(
                CSRF_COOKIE,
                browser,
                httponly=True,
                samesite="strict",
                secure=self.secure,
                path="/ui",
            )
        return response

    def set_login(self, response: Response, session: str) -> None:
        """The session cookie (its id only), for as long as the session lasts."""
        response.set_cookie(
            SESSION_COOKIE,
            session,
            max_age=int(self.sessions.lifetime_s),
            httponly=True,
            samesite="strict",
            secure=self.secure,
            path="/ui",
        )
        self._clear_legacy(response)

    def clear_login(self, response: Response) -> None:
        response.delete_cookie(SESSION_COOKIE, path="/ui", samesite="strict", secure=self.secure)
        self._clear_legacy(response)

    def _clear_legacy(self, response: Response) -> None:
        # A browser signed in before sessions holds the raw token in this cookie.
        response.delete_cookie(
            LEGACY_TOKEN_COOKIE, path="/ui", samesite="strict", secure=self.secure
        )

    async def check_post(self, request: Request) -> dict[str, str] | Response:
        """The form of a console POST, or the 403 problem refusing it as cross-site: no
        token bound to the browser's CSRF cookie or to its live sign-in session, or a
        foreign ``Origin``/``Referer``."""
        fields = await read_form(request, self.gate.ctx.gateway.max_bytes)
        if fields is None:
            response = problem(400, "bad-form", "Not a form this console sends.")
            response.headers.update(page_headers())
            return response
        given = fields.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER)
        origin = own_origin(request)
        ok = self.csrf.check(request.cookies.get(CSRF_COOKIE), given, request.headers, origin)
        if not ok and given and request.cookies.get(SESSION_COOKIE):
            if await self.signed_in(request) is not None:
                session = request.state.ui_session
                ok = hmac.compare_digest(
                    session_csrf(session).encode(), given.encode("utf-8")
                ) and same_origin(request.headers, origin)
        if not ok:
            response = problem(403, "csrf", "This form is not from this console: reload it.")
            response.headers.update(page_headers())
            return response
        return fields


class SessionBoundStream:
    """An open-ended response (the console's event stream) that ends when its session
    does: every :data:`STREAM_RECHECK` seconds the session is resolved again, and once it
    is gone the stream is told its client disconnected, so it ends as for a client that
    left (its closing bytes sent)."""

    def __init__(self, inner: Response, sessions: UiSessions, session: str) -> None:
        self.inner = inner
        self.sessions = sessions
        self.session = session

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        ended = trio.Event()

        async def watch() -> None:
            while True:
                await trio.sleep(STREAM_RECHECK)
                try:
                    live = await self.sessions.resolve(self.session) is not None
                except (StoreError, sqlite3.Error) as exc:
                    # Cannot tell: end the stream (the browser's EventSource reconnects,
                    # and is checked then) rather than serve an unchecked session.
                    log.info("event stream ended: its session could not be checked: %s", exc)
                    live = False
                if not live:
                    ended.set()
                    return

        async def receive_or_end() -> Any:
            if ended.is_set():
                return {"type": "http.disconnect"}
            message = None
            async with trio.open_nursery() as nursery:

                async def real() -> None:
                    nonlocal message
                    message = await receive()
                    nursery.cancel_scope.cancel()

                async def end() -> None:
                    await ended.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(real)
                nursery.start_soon(end)
            return message if message is not None else {"type": "http.disconnect"}

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await self.inner(scope, receive_or_end, send)
            nursery.cancel_scope.cancel()


async def read_form(request: Request, limit: int) -> dict[str, str] | None:
    """The URL-encoded form of a POST (the console's forms send nothing else), read up to
    ``limit`` bytes; None if it is another type, larger, or malformed. The first value
    of a repeated field wins."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != FORM:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    try:
        pairs = parse_qsl(
            body.decode("utf-8"),
            keep_blank_values=True,
            max_num_fields=MAX_FIELDS,
            errors="strict",
        )
    except (UnicodeDecodeError, ValueError):
        return None
    fields: dict[str, str] = {}
    for key, value in pairs:
        fields.setdefault(key, value)
    return fields
