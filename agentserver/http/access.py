"""Every HTTP route declared with what the authorization rule
(:mod:`agentserver.core.access`) does on it, so that none is added without one: the app is
built from :class:`GuardedRoute` and :class:`GuardedMount` only, and
tests/test_access_doors.py walks the app's route table, failing for a route that is not
declared or not in its table of expected answers.

The route's pattern (never the request's path, which holds object ids) is put in the
request's scope, so a refusal is counted and logged by route."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

#: No authentication: probes, the sign-in page, static files, the public agent card.
OPEN = "open"
#: Authenticated; the caller acts as itself and sees what its ``may-address`` allows, but
#: no object another client owns (sending, listings of listeners and agents, status).
CALLER = "caller"
#: Objects with an owner: the rule answers another client's as a missing one.
OWNER = "owner"
#: An operator's only (another caller gets the same refusal whatever it names).
OPERATOR = "operator"
KINDS = (OPEN, CALLER, OWNER, OPERATOR)

#: The scope key holding the matched route's pattern.
ROUTE_KEY = "agentserver.route"


class GuardedRoute(Route):
    """A route with its access kind (one of :data:`KINDS`)."""

    def __init__(
        self,
        path: str,
        endpoint: Callable[..., Any],
        *,
        access: str,
        methods: Sequence[str] | None = None,
    ) -> None:
        if access not in KINDS:
            raise ValueError(f"access must be one of {KINDS}, not {access!r}")
        super().__init__(path, endpoint, methods=list(methods) if methods else None)
        self.access = access

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[ROUTE_KEY] = self.path
        await super().handle(scope, receive, send)


class GuardedMount(Mount):
    """A mounted app with its access kind (the console's static files)."""

    def __init__(self, path: str, app: Any, *, access: str) -> None:
        if access not in KINDS:
            raise ValueError(f"access must be one of {KINDS}, not {access!r}")
        super().__init__(path, app=app)
        self.access = access


def route_label(scope: Scope) -> str:
    """``METHOD PATTERN`` of a request (what a refusal is counted and logged by)."""
    return f"{scope.get('method', '')} {scope.get(ROUTE_KEY, '?')}".strip()
