"""Who calls the HTTP API: each request's caller authenticated (:mod:`agentserver.http.auth`)
or refused with a problem, failed authentications slowed per address as failed hellos are
on the socket (at most one slowed request per address waits; the others are refused at
once), and which listeners and agents a caller may see."""

from __future__ import annotations

import logging

import trio
from starlette.requests import Request
from starlette.responses import Response

from agentserver.core.access import AccessRule
from agentserver.core.errors import HuhReason
from agentserver.core.handshake import Identity, Unauthenticated
from agentserver.http.access import route_label
from agentserver.http.auth import AnonymousRefused
from agentserver.http.context import HttpContext
from agentserver.http.problems import huh_problem, problem
from agentserver.http.replies import ThreadView

log = logging.getLogger("agentserver.http")


def peer_address(request: Request) -> str | None:
    """The caller's address, if known."""
    client = request.client
    return client.host if client is not None else None


class Gate:
    """Authenticates the requests of one app."""

    def __init__(self, ctx: HttpContext) -> None:
        self.ctx = ctx
        #: Addresses with a slowed (throttled) request waiting.
        self._throttled: set[str] = set()

    async def identify(
        self, request: Request, authorization: str | None = None
    ) -> Identity | Response:
        """The caller, or the problem that refuses it. Failures are throttled per address
        as failed hellos are on the socket. ``authorization``: the credentials to check
        instead of the request's ``Authorization`` header (the web console's cookie)."""
        ctx = self.ctx
        ctx.counters["requests"] += 1
        peer = peer_address(request) or "?"
        throttle = ctx.throttle
        delay = throttle.delay(peer, trio.current_time())
        if delay > 0:
            ctx.counters["throttled"] += 1
            if peer in self._throttled:
                # One slowed request per address at a time: more would only hold tasks.
                return huh_problem(HuhReason.UNAUTHENTICATED)
            self._throttled.add(peer)
            try:
                await trio.sleep(delay)
            finally:
                self._throttled.discard(peer)
        try:
            identity = ctx.auth.identify(
                authorization or request.headers.get("authorization"), peer_address(request)
            )
        except AnonymousRefused as exc:
            ctx.counters["unauthenticated"] += 1
            log.info("HTTP request from %s refused: %s", peer, exc)
            return problem(403, "huh/unauthenticated", HuhReason.UNAUTHENTICATED.value)
        except Unauthenticated as exc:
            ctx.counters["unauthenticated"] += 1
            if throttle.failed(peer, trio.current_time()):
                log.warning("failed HTTP authentications from %s: slowing them down", peer)
            log.info("HTTP request from %s refused: %s", peer, exc)
            return huh_problem(HuhReason.UNAUTHENTICATED)
        if ctx.auth.required:
            throttle.succeeded(peer)
        return identity

    @staticmethod
    def may_see(identity: Identity, listener: str) -> bool:
        """Whether ``identity`` may see (and address) ``listener``."""
        return identity.allowed is None or listener in identity.allowed

    # -- the authorization rule (agentserver/core/access.py), as the routes call it ----

    @property
    def rule(self) -> AccessRule:
        rule = self.ctx.access
        assert rule is not None  # made by HttpContext.__post_init__ at the latest
        return rule

    @staticmethod
    def door(request: Request) -> str:
        """The door a request came through, for the refusal's count and log line."""
        return "ui" if request.url.path.startswith("/ui") else "http"

    def owns(self, identity: Identity, owner: str | None, request: Request) -> bool:
        """Whether ``identity`` may see and act on an object of ``owner``; a refusal is
        counted and logged with the route (answer it as a missing object)."""
        return self.rule.allows(
            identity.name, owner, door=self.door(request), route=route_label(request.scope)
        )

    def refuse(self, identity: Identity, request: Request) -> None:
        """Report a refusal decided with the rule (an object left out of an answer)."""
        self.rule.refuse(identity.name, self.door(request), route_label(request.scope))

    def sees_all(self, identity: Identity) -> bool:
        """An operator (or an anonymous caller without ``<clients>``)."""
        return self.rule.sees_all(identity.name)

    async def task_visible(
        self, identity: Identity, name: str, thread: str, request: Request, *, latest: bool = False
    ) -> bool:
        """Whether agent ``name``'s task on ``thread`` exists for ``identity``: the agent is
        one it may see, and the task is its own (or it sees all). False for a missing task
        and for another's alike (the route answers both as missing); another's is
        counted and logged as a refusal."""
        view = self.ctx.agents
        if view is None or name not in view.agents or not self.may_see(identity, name):
            return False
        if self.sees_all(identity):
            return True
        # ``latest``: the action reads the thread's latest task whoever sent it (a fork),
        # so that one must be the caller's, not only some task on the thread.
        found, sender = await view.task_sender(name, thread, None if latest else identity.name)
        return found and self.owns(identity, sender, request)

    def agent_summaries(self, identity: Identity, agents: list[dict]) -> list[dict]:
        """Agents' summaries (``/v1/agents``, ``/v1/status``, the console's overview) as
        ``identity`` may see them: a client is not shown the text of another's failed task
        (the last error keeps its status and time; the text and Turn are an operator's)."""
        if self.sees_all(identity):
            return agents
        out = []
        for agent in agents:
            error = agent.get("last_error")
            if error:
                agent = {**agent, "last_error": {**error, "turn": None, "text": None}}
            out.append(agent)
        return out

    def kept_thread(self, identity: Identity, thread: str, request: Request) -> ThreadView | None:
        """The replies the gateway keeps on ``thread`` if ``identity`` may see them (its
        own message's, or any for an operator); None for a missing thread and another's
        alike (the latter counted and logged as a refusal)."""
        view = self.ctx.gateway.thread(thread, identity.name, any_owner=True)
        if view is None or not self.owns(identity, view.owner, request):
            return None
        return view

    def scope(self, identity: Identity) -> str | None:
        """The one sender whose objects ``identity`` may list (None: all)."""
        return self.rule.scope(identity.name)
