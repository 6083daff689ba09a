"""Who a browser is, for the web console: the API's gate with the token from the
console's cookie, the session cookie the CSRF token is bound to, and the POST check."""

from __future__ import annotations

from urllib.parse import parse_qsl, quote

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from agentserver.core.handshake import Identity
from agentserver.http.gate import Gate
from agentserver.http.problems import problem
from agentserver.http.ui.security import (
    CSRF_FIELD,
    CSRF_HEADER,
    SESSION_COOKIE,
    TOKEN_COOKIE,
    CsrfGuard,
    page_headers,
)

#: Fields a console form has at most.
MAX_FIELDS = 20
FORM = "application/x-www-form-urlencoded"

#: Seconds a login lasts in the browser (the token itself does not expire).
LOGIN_MAX_AGE = 12 * 3600


def own_origin(request: Request) -> str:
    """This server's origin as the browser addressed it."""
    url = request.url
    return f"{url.scheme}://{url.netloc}"


class UiSession:
    """Authenticates the console's requests of one app and guards its POSTs."""

    def __init__(self, gate: Gate, csrf: CsrfGuard, *, secure: bool) -> None:
        self.gate = gate
        self.csrf = csrf
        self.secure = secure

    @property
    def needs_login(self) -> bool:
        """Clients are declared: the browser must give one's token."""
        return self.gate.ctx.auth.required

    async def identify(self, request: Request) -> Identity | Response:
        """The caller (the cookie's token, or the Authorization header of a script), or
        the problem the gate refuses it with."""
        token = request.cookies.get(TOKEN_COOKIE)
        return await self.gate.identify(request, f"Bearer {token}" if token else None)

    async def page_identity(self, request: Request) -> Identity | Response:
        """As :meth:`identify`, but a page sends a browser without a valid login to the
        login page rather than showing a problem."""
        if self.needs_login and not request.cookies.get(TOKEN_COOKIE):
            # Not signed in yet: no credentials tried, so not a failed authentication
            # (which would slow down this address's API calls too).
            return self.to_login(request)
        identity = await self.identify(request)
        if (
            isinstance(identity, Response)
            and self.needs_login
            and identity.status_code in (401, 403)
        ):
            return self.to_login(request)
        return identity

    @staticmethod
    def to_login(request: Request) -> Response:
        """The login page, coming back here once signed in."""
        target = request.url.path
        if request.url.query:
            target += "?" + request.url.query
        return RedirectResponse(f"/ui/login?next={quote(target, safe='/')}", 303, page_headers())

    def session_of(self, request: Request) -> tuple[str, bool]:
        """The browser's session id and whether it is new (then :meth:`finish` sets it)."""
        session = request.cookies.get(SESSION_COOKIE)
        if session and 20 <= len(session) <= 100:
            return session, False
        return self.csrf.new_session(), True

    def finish(self, response: Response, session: str, new: bool) -> Response:
        """The console's headers, and the session cookie if it is new."""
        response.headers.update(page_headers())
        if new:
            response.set_cookie(
                SESSION_COOKIE,
                session,
                httponly=True,
                samesite="strict",
                secure=self.secure,
                path="/ui",
            )
        return response

    def set_login(self, response: Response, token: str) -> None:
        response.set_cookie(
            TOKEN_COOKIE,
            token,
            max_age=LOGIN_MAX_AGE,
            httponly=True,
            samesite="strict",
            secure=self.secure,
            path="/ui",
        )

    def clear_login(self, response: Response) -> None:
        response.delete_cookie(TOKEN_COOKIE, path="/ui", samesite="strict", secure=self.secure)

    async def check_post(self, request: Request) -> dict[str, str] | Response:
        """The form of a console POST, or the 403 problem refusing it as cross-site (no
        session, a token not bound to it, or a foreign ``Origin``/``Referer``)."""
        fields = await read_form(request, self.gate.ctx.gateway.max_bytes)
        if fields is None:
            response = problem(400, "bad-form", "Not a form this console sends.")
            response.headers.update(page_headers())
            return response
        given = fields.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER)
        if not self.csrf.check(
            request.cookies.get(SESSION_COOKIE), given, request.headers, own_origin(request)
        ):
            response = problem(403, "csrf", "This form is not from this console: reload it.")
            response.headers.update(page_headers())
            return response
        return fields


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
