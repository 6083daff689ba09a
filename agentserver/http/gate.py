"""Who calls the HTTP API: each request's caller authenticated (:mod:`agentserver.http.auth`)
or refused with a problem, failed authentications slowed per address as failed hellos are
on the socket (at most one slowed request per address waits; the others are refused at
once), and which listeners and agents a caller may see."""

from __future__ import annotations

import logging

import trio
from starlette.requests import Request
from starlette.responses import Response

from agentserver.core.errors import HuhReason
from agentserver.core.handshake import Identity, Unauthenticated
from agentserver.http.auth import AnonymousRefused
from agentserver.http.context import HttpContext
from agentserver.http.problems import huh_problem, problem

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
