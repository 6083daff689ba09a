"""``GET /v1/events``: the agents' events as server-sent events, filtered by what the
caller may see, by agent and by thread."""

from __future__ import annotations

import collections
import json
import logging
import sqlite3
from collections.abc import AsyncGenerator, Mapping

import trio
from starlette.requests import Request
from starlette.responses import Response

from agentserver.agents.errors import StoreError
from agentserver.agents.events import Event, Subscription
from agentserver.core.handshake import Identity
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import problem
from agentserver.http.sse import EventStreamResponse, sse

log = logging.getLogger("agentserver.http")

#: Events one SSE subscriber may have waiting; past that it is dropped (not waited on).
SSE_BUFFER = 256
#: Seconds between SSE keep-alive comments on a quiet stream.
SSE_KEEPALIVE = 15.0
#: Turn → (caller thread, hop thread) entries kept for the SSE thread filter.
_TURN_CACHE = 1024


class EventRoutes:
    """The event stream route of one app."""

    def __init__(self, ctx: HttpContext, gate: Gate) -> None:
        self.ctx = ctx
        self.gate = gate
        #: Turn -> (caller thread, hop thread, sender) of its task.
        self._turns: collections.OrderedDict[str, tuple[str | None, str | None, str | None]] = (
            collections.OrderedDict()
        )
        #: SSE streams open now.
        self.streams = 0

    async def _turn_task(self, turn: str) -> tuple[str | None, str | None, str | None]:
        cached = self._turns.get(turn)
        if cached is None or cached == (None, None, None):
            view = self.ctx.agents
            try:
                cached = await view.turn_task(turn) if view is not None else (None, None, None)
            except (StoreError, sqlite3.Error) as exc:
                # Mid-stream: no response to fail; the event is not shown (not cached).
                log.warning("event filter: the agent store could not be read: %s", exc)
                return (None, None, None)
            self._turns[turn] = cached
            while len(self._turns) > _TURN_CACHE:
                self._turns.popitem(last=False)
        return cached

    async def _matches(
        self, event: Event, identity: Identity, agent: str | None, thread: str | None
    ) -> bool:
        if not self.gate.may_see(identity, event.agent_id):
            return False
        if agent is not None and event.agent_id != agent:
            return False
        turn = event.agent_turn_id
        sees_all = self.gate.sees_all(identity)
        if thread is None and sees_all:
            return True
        if turn is None:
            # Not a task's event (an agent's state, a notice): on no thread, and an
            # operator's only.
            return sees_all and thread is None
        caller, hop, sender = await self._turn_task(turn)
        if not sees_all and not self.gate.rule.decide(identity.name, sender):
            # Another client's task: never shown, whatever the filters (the stream is not
            # a request for it: a withheld event is not counted as a refusal).
            return False
        return thread is None or thread in (caller, hop)

    async def events(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        return self.respond(identity, request.query_params)

    def respond(self, identity: Identity, query: Mapping[str, str]) -> Response:
        """The event stream ``identity`` may see, filtered by ``query``'s ``agent`` and
        ``thread`` (also the web console's, whose caller comes from its cookie)."""
        bus = self.ctx.events
        agent = query.get("agent")
        thread = query.get("thread")
        try:
            sub = bus.subscribe(SSE_BUFFER) if bus is not None else None
        except RuntimeError:
            return problem(503, "busy", "Too many event subscribers.", {"Retry-After": "5"})
        return EventStreamResponse(self.stream(sub, identity, agent, thread))

    async def stream(
        self, sub: Subscription | None, identity: Identity, agent: str | None, thread: str | None
    ) -> AsyncGenerator[str, None]:
        """The SSE text of ``sub``'s events that ``identity`` may see (of ``agent``, on
        ``thread``), with keep-alive comments on a quiet stream. Ends when the server
        closes, or after an ``overflow`` event once the subscriber fell behind (it is
        dropped, never waited on); ``sub`` is closed then."""
        ctx = self.ctx
        self.streams += 1
        if sub is not None:
            ctx.subscriptions.add(sub)
        try:
            yield ": agentserver events\n\n"
            while not ctx.closing.is_set():
                event = None
                with trio.move_on_after(SSE_KEEPALIVE):
                    try:
                        if sub is None:
                            await ctx.closing.wait()
                        else:
                            event = await sub.receive()
                    except (trio.EndOfChannel, trio.ClosedResourceError):
                        return  # closed: the server is shutting down
                if ctx.closing.is_set():
                    return
                if event is None or sub is None:  # (no event without a subscription)
                    yield ": keep-alive\n\n"
                    continue
                if sub.dropped:
                    # Too slow: dropped rather than waited on (it may reconnect).
                    self.ctx.counters["sse_dropped"] += 1
                    yield f"event: overflow\ndata: {json.dumps({'dropped': sub.dropped})}\n\n"
                    return
                if await self._matches(event, identity, agent, thread):
                    yield sse(event)
        finally:
            self.streams -= 1
            log.debug("event stream ended (%d open)", self.streams)
            if sub is not None:
                ctx.subscriptions.discard(sub)
                sub.close()
