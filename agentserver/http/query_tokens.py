"""A token in a URL is refused, at every HTTP door (issue 44): URLs end up in logs,
browser histories, proxies and ``Referer`` headers, so a credential must only ever travel
in the ``Authorization`` header (or, for the web console, as its session cookie).

:class:`RefuseQueryTokens` wraps the whole app (every route, the unauthenticated ones
included), before any route runs: a query string with a parameter named like a
credential (:data:`CREDENTIAL_NAMES`, any case), or whose name or value is a declared
client's token, gets ``401`` ``token-in-query`` saying to use the header. Nothing of the
URL is logged: only the caller's address and the parameter's name when it is one of the
credential names.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import parse_qsl

from agentserver.http.auth import HttpAuth
from agentserver.http.problems import problem

log = logging.getLogger("agentserver.http")

#: Query parameters refused whatever their value (compared in lower case).
CREDENTIAL_NAMES = frozenset(
    {
        "token",
        "access_token",
        "access-token",
        "accesstoken",
        "auth",
        "auth_token",
        "authorization",
        "bearer",
        "api_key",
        "api-key",
        "apikey",
    }
)
TITLE = (
    "A token in the URL is refused: URLs are logged and kept. Send it in the "
    "Authorization header instead: 'Authorization: Bearer <token>'."
)


def token_in_query(query: str, auth: HttpAuth) -> str | None:
    """What in ``query`` carries a credential: the parameter's name if it is one of
    :data:`CREDENTIAL_NAMES`, ``"a client's token"`` if a name or value is a declared
    token (never the parameter itself, which may be the token); None if nothing does."""
    # Every parameter: the server's header budget (16 KiB) bounds the query string.
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name.lower() in CREDENTIAL_NAMES:
            return name.lower()
        if auth.is_token(value) or auth.is_token(name):
            return "a client's token"
    return None


class RefuseQueryTokens:
    """ASGI middleware around the HTTP API's app: refuses a request whose query string
    carries a credential (see the module docstring), counting it in ``counters``."""

    def __init__(self, app: Any, auth: HttpAuth, counters: dict[str, int]) -> None:
        self.app = app
        self.auth = auth
        self.counters = counters

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # The app serves no WebSocket; lifespan events have no query.
        query = scope.get("query_string") if scope["type"] == "http" else None
        if query:
            found = token_in_query(query.decode("latin-1"), self.auth)
            if found is not None:
                self.counters["query_tokens"] += 1
                client = scope.get("client")
                peer = client[0] if client else "?"
                log.info("HTTP request from %s refused: a credential in its URL (%s)", peer, found)
                response = problem(401, "token-in-query", TITLE, {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
