"""The web console's defences, sans I/O: cross-site request forgery (a token bound to
the browser or to its sign-in session, and the ``Origin`` check) and the headers every
page carries (CSP without inline scripts, no framing, no sniffing).

A browser cannot send ``Authorization: Bearer`` on a navigation, so signing in exchanges
the token the operator typed once for a server-side session (``http/ui/sessions.py``)
whose random id is the ``HttpOnly``, ``SameSite=Strict`` cookie :data:`SESSION_COOKIE`
(``Secure`` under TLS); the token is never in a cookie. Before signing in, the CSRF
cookie :data:`CSRF_COOKIE` is a random name for the browser and its token an HMAC of it
under a key drawn when the app is built (a restart asks for a reload); once signed in,
a form's token is derived from the session id (:func:`session_csrf`), so it holds on
every process that knows the session, and across restarts.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from urllib.parse import urlsplit

__all__ = [
    "CSP",
    "CSRF_COOKIE",
    "CSRF_FIELD",
    "CSRF_HEADER",
    "LEGACY_TOKEN_COOKIE",
    "SESSION_COOKIE",
    "CsrfGuard",
    "page_headers",
    "safe_next",
    "same_origin",
    "session_csrf",
]

#: The sign-in session's id (nothing else: never the token).
SESSION_COOKIE = "agentserver_ui_session"
#: The browser's random name the CSRF token of a form is bound to before signing in.
CSRF_COOKIE = "agentserver_ui_csrf"
#: The cookie that held the raw token before issue 44: cleared wherever it is seen.
LEGACY_TOKEN_COOKIE = "agentserver_ui_token"
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"

#: Everything from the package itself: no inline script or style, no third party, no
#: framing; ``connect-src 'self'`` for EventSource and fetch.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


def page_headers() -> dict[str, str]:
    """The headers of every console response."""
    return {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "same-origin",
        "Cache-Control": "no-store",
    }


def safe_next(target: str | None, default: str = "/ui") -> str:
    """``target`` if it is a path of the console (where a form returns to), else
    ``default``: never another site (``//evil``, ``https://…``), never a header break."""
    if not target or not target.startswith("/ui") or target.startswith("//"):
        return default
    if any(c in target for c in "\r\n\\") or urlsplit(target).netloc:
        return default
    return target


class CsrfGuard:
    """Issues and checks the per-session tokens of one app. The key lives as long as the
    app (no module-level state)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    @staticmethod
    def new_session() -> str:
        return secrets.token_urlsafe(32)

    def token(self, session: str) -> str:
        return hmac.new(self._key, session.encode("utf-8"), hashlib.sha256).hexdigest()

    def check(
        self,
        session: str | None,
        given: str | None,
        headers: Mapping[str, str],
        own_origin: str,
    ) -> bool:
        """Whether a POST may be carried out: a session cookie, the token bound to it
        (form field or header), and an ``Origin`` (or, lacking one, ``Referer``) of this
        very server when the browser sends one."""
        if not session or not given:
            return False
        if not hmac.compare_digest(self.token(session).encode(), given.encode("utf-8")):
            return False
        return same_origin(headers, own_origin)


def session_csrf(session: str) -> str:
    """The CSRF token of a signed-in browser's forms: an HMAC keyed by its session id
    (which only the browser's ``HttpOnly`` cookie and no page holds), so every process
    that knows the session checks it without a key of its own."""
    return hmac.new(session.encode("utf-8"), b"agentserver-ui-csrf", hashlib.sha256).hexdigest()


def same_origin(headers: Mapping[str, str], own_origin: str) -> bool:
    """Whether the browser's ``Origin`` (or, lacking one, ``Referer``) is this server;
    true when it sends neither."""
    origin = headers.get("origin")
    if origin is None:
        referer = headers.get("referer")
        if referer is None:
            return True
        parts = urlsplit(referer)
        origin = f"{parts.scheme}://{parts.netloc}"
    return origin == own_origin
