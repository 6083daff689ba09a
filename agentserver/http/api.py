"""The Starlette app of the HTTP API (reference: docs/operations.md, "HTTP API reference").

Runs on trio (Starlette runs on anyio; Hypercorn's trio worker drives it). Every route
but ``/healthz`` and ``/readyz`` authenticates the caller (:mod:`agentserver.http.auth`);
every error is an RFC 9457 problem (:mod:`agentserver.http.problems`).
"""

from __future__ import annotations

import collections
import json
import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from lxml import etree
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentserver.agents.errors import StoreError
from agentserver.agents.events import (
    Event,
    EventBus,
    Subscription,
)
from agentserver.core.errors import HuhReason
from agentserver.core.handshake import Identity, Unauthenticated
from agentserver.core.threads import is_uuid4
from agentserver.core.throttle import HelloThrottle
from agentserver.http.agents_view import AgentsView
from agentserver.http.auth import AnonymousRefused, HttpAuth
from agentserver.http.gateway import HttpGateway
from agentserver.http.problems import (
    huh_problem,
    problem,
    refusal_problem,
    reply_problem,
)
from agentserver.http.sse import EventStreamResponse, sse
from agentserver.pump.pump import Pump

log = logging.getLogger("agentserver.http")

XML = "application/xml"
THREAD_HEADER = "Agentserver-Thread"
#: Events one SSE subscriber may have waiting; past that it is dropped (not waited on).
SSE_BUFFER = 256
#: Seconds between SSE keep-alive comments on a quiet stream.
SSE_KEEPALIVE = 15.0
#: Turn → (caller thread, hop thread) entries kept for the SSE thread filter.
_TURN_CACHE = 1024


@dataclass
class HttpContext:
    """Everything the app reads; built by the composition root (agentserver/app.py)."""

    pump: Pump
    gateway: HttpGateway
    auth: HttpAuth
    registry: CollectorRegistry
    throttle: HelloThrottle = field(default_factory=HelloThrottle)
    agents: AgentsView | None = None
    events: EventBus | None = None
    #: ``() -> {backend: stats}`` of the LLM router (None: no router).
    backends: Callable[[], dict[str, dict[str, Any]]] | None = None
    #: ``() -> dict`` of the transports' figures (connections, counters) for /v1/status.
    transports: Callable[[], dict[str, Any]] = dict
    #: The remote listeners' step log (agents/step_log.py; None: no remote listeners).
    steps: Any = None
    organism: str = ""
    version: str = ""
    counters: dict[str, int] = field(
        default_factory=lambda: {
            "requests": 0,
            "unauthenticated": 0,
            "throttled": 0,
            "sse_dropped": 0,
        }
    )
    #: Set by :meth:`close`.
    closing: trio.Event = field(default_factory=trio.Event)
    #: The open event streams' subscriptions.
    subscriptions: set[Subscription] = field(default_factory=set)

    def close(self) -> None:
        """The server is shutting down: end the event streams now (endless, they would
        hold the server for the whole graceful timeout)."""
        self.closing.set()
        for sub in list(self.subscriptions):
            sub.close()


def build_app(ctx: HttpContext) -> Starlette:
    api = _Api(ctx)
    return Starlette(
        routes=[
            Route("/healthz", api.healthz),
            Route("/readyz", api.readyz),
            Route("/metrics", api.metrics),
            Route("/v1/messages", api.post_message, methods=["POST"]),
            Route("/v1/threads/{thread}", api.thread),
            Route("/v1/listeners", api.listeners),
            Route("/v1/agents", api.agents),
            Route("/v1/agents/{name}/tasks/{thread}", api.task),
            Route("/v1/events", api.events),
            Route("/v1/status", api.status),
            Route("/v1/steps", api.steps),
        ],
        exception_handlers={
            404: _not_found,
            405: _not_allowed,
            StoreError: _store_unavailable,
            sqlite3.Error: _store_unavailable,
        },
    )


async def _not_found(request: Request, exc: Exception) -> Response:
    return problem(404, "not-found", "Not found.")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return problem(405, "method-not-allowed", "Method not allowed.")


async def _store_unavailable(request: Request, exc: Exception) -> Response:
    # A view read through the agent store failed (the database unreachable, or closed at
    # shutdown): the caller may retry; the details are for the log only.
    log.warning("%s: the agent store could not be read: %s", request.url.path, exc)
    return problem(
        503, "store-unavailable", "The agent store cannot be read now.", {"Retry-After": "5"}
    )


def _unread(response: Response) -> Response:
    """A response sent before the request's body was read: the connection is closed after
    it (the unread rest of the body cannot be told from a next request)."""
    response.headers["Connection"] = "close"
    return response


def _peer(request: Request) -> str | None:
    client = request.client
    return client.host if client is not None else None


class _Api:
    def __init__(self, ctx: HttpContext) -> None:
        self.ctx = ctx
        self._turns: collections.OrderedDict[str, tuple[str | None, str | None]] = (
            collections.OrderedDict()
        )
        #: SSE streams open now.
        self.streams = 0
        #: Addresses with a slowed (throttled) request waiting.
        self._throttled: set[str] = set()

    # -- auth -----------------------------------------------------------------------------

    async def _identify(self, request: Request) -> Identity | Response:
        """The caller, or the problem that refuses it. Failures are throttled per address
        as failed hellos are on the socket."""
        ctx = self.ctx
        ctx.counters["requests"] += 1
        peer = _peer(request) or "?"
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
            identity = ctx.auth.identify(request.headers.get("authorization"), _peer(request))
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
    def _may_see(identity: Identity, listener: str) -> bool:
        return identity.allowed is None or listener in identity.allowed

    # -- health ---------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readiness(self) -> dict[str, Any]:
        ctx = self.ctx
        checks: dict[str, bool | None] = {"pump": ctx.pump.running, "store": None, "llm": None}
        if ctx.agents is not None:
            checks["store"] = await ctx.agents.reachable()
            if ctx.backends is not None:
                backends = ctx.backends().values()
                checks["llm"] = any(
                    b.get("skipped") is None
                    and b.get("breaker") != "open"
                    and not b.get("cooling_for")
                    for b in backends
                )
            else:
                checks["llm"] = False
        ready = all(v is not False for v in checks.values())
        return {"ready": ready, "checks": checks}

    async def readyz(self, request: Request) -> Response:
        body = await self.readiness()
        return JSONResponse(body, 200 if body["ready"] else 503)

    async def metrics(self, request: Request) -> Response:
        identity = await self._identify(request)
        if isinstance(identity, Response):
            return identity
        return Response(generate_latest(self.ctx.registry), media_type=CONTENT_TYPE_LATEST)

    # -- messages -------------------------------------------------------------------------

    async def post_message(self, request: Request) -> Response:
        identity = await self._identify(request)
        if isinstance(identity, Response):
            return _unread(identity)
        gateway = self.ctx.gateway
        limit = gateway.max_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            # Refused before the body is read, as an oversize frame is on the socket.
            return _unread(huh_problem(HuhReason.TOO_LARGE))
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return _unread(huh_problem(HuhReason.TOO_LARGE))
            chunks.append(chunk)
        params = request.query_params
        wait = params.get("wait", "true").lower() not in ("false", "0", "no")
        thread = params.get("thread")
        if thread is not None and not is_uuid4(thread):
            return problem(400, "bad-thread", "A thread must be a uuid4.")
        outcome = await gateway.send(
            identity, params.get("to"), b"".join(chunks), wait=wait, thread=thread
        )
        extra = {"thread": outcome.thread} if outcome.thread else {}
        headers = {THREAD_HEADER: outcome.thread} if outcome.thread else None
        if outcome.kind == "refused":
            assert outcome.refusal is not None
            return refusal_problem(outcome.refusal)
        if outcome.kind == "accepted":
            return JSONResponse(
                {"thread": outcome.thread, "replies": f"/v1/threads/{outcome.thread}"},
                202,
                headers={**(headers or {}), "Location": f"/v1/threads/{outcome.thread}"},
            )
        if outcome.kind == "unanswered":
            return Response(status_code=204, headers=headers)
        if outcome.kind == "timeout":
            return problem(
                504,
                "system-error/timeout",
                "The request did not complete in time.",
                headers,
                replies=f"/v1/threads/{outcome.thread}",
                **extra,
            )
        refused = reply_problem(outcome.reply, **extra)
        if refused is not None:
            return refused
        return Response(outcome.reply, 200, headers=headers, media_type=XML)

    async def thread(self, request: Request) -> Response:
        identity = await self._identify(request)
        if isinstance(identity, Response):
            return identity
        thread = request.path_params["thread"]
        view = self.ctx.gateway.thread(thread, identity.name)
        if view is None:
            return problem(404, "not-found", "Not found.")
        return JSONResponse(
            {
                "thread": view.thread,
                "replies": [r.decode("utf-8") for r in view.replies],
                "unanswered": view.unanswered,
                "dropped": view.dropped,
                "expires_in": round(view.expires_in, 3),
            }
        )

    # -- topology -------------------------------------------------------------------------

    async def listeners(self, request: Request) -> Response:
        identity = await self._identify(request)
        if isinstance(identity, Response):
            return identity
        pump = self.ctx.pump
        out = []
        for listener in pump.listeners:
            if not self._may_see(identity, listener.name):
                continue
            types = []
            for model in listener.payload_types:
                ptype = next((p for p in pump.payloads if p.model is model), None)
                if ptype is None or ptype.namespace.startswith("https://xml-pipeline.org/ns/"):
                    continue  # core primitives: only the pump sends them
                types.append(
                    {
                        "root": ptype.tag,
                        "xsd": etree.tostring(ptype.schema_doc, encoding="unicode"),
                    }
                )
            if types:
                out.append(
                    {
                        "name": listener.name,
                        "description": listener.description,
                        "agent": listener.agent,
                        "payloads": types,
                    }
                )
        return JSONResponse({"listeners": out})

    # -- agents ---------------------------------------------------------------------------

    async def agents(self, request: Request) -> Response:
        identity = await self._identify(request)
        if isinstance(identity, Response):
            return identity
        view = self.ctx.agents
        if view is None:
            return JSONResponse({"agents": []})
        names = [n for n in view.agents if self._may_see(identity, n)]
        return JSONResponse({"agents": await view.agent_list(names)})

    async def task(self, request: Request) -> Response:
        identity = await self._identify(request)
        if isinstance(identity, Response):
            return identity
        name = request.path_params["name"]
        view = self.ctx.agents
        found = None
        if view is not None and name in view.agents and self._may_see(identity, name):
            found = await view.task(name, request.path_params["thread"])
        if found is None:
            return problem(404, "not-found", "Not found.")
        return JSONResponse(found)

    # -- events ---------------------------------------------------------------------------

    async def _turn_threads(self, turn: str) -> tuple[str | None, str | None]:
        cached = self._turns.get(turn)
        if cached is None or cached == (None, None):
            view = self.ctx.agents
            try:
                cached = await view.turn_thread(turn) if view is not None else (None, None)
            except (StoreError, sqlite3.Error) as exc:
                # Mid-stream: no response to fail; the event is not shown (not cached).
                log.warning("event filter: the agent store could not be read: %s", exc)
                return (None, None)
            self._turns[turn] = cached
            while len(self._turns) > _TURN_CACHE:
                self._turns.popitem(last=False)
        return cached

    async def _matches(
        self, event: Event, identity: Identity, agent: str | None, thread: str | None
    ) -> bool:
        if not self._may_see(identity, event.agent_id):
            return False
        if agent is not None and event.agent_id != agent:
            return False
        if thread is not None:
            turn = event.agent_turn_id
            return turn is not None and thread in await self._turn_threads(turn)
        return True

    async def events(self, request: Request) -> Response:
        identity = await self._identify(request)
        if isinstance(identity, Response):
            return identity
        bus = self.ctx.events
        agent = request.query_params.get("agent")
        thread = request.query_params.get("thread")
        try:
            sub = bus.subscribe(SSE_BUFFER) if bus is not None else None
        except RuntimeError:
            return problem(503, "busy", "Too many event subscribers.", {"Retry-After": "5"})
        return EventStreamResponse(self._stream(sub, identity, agent, thread))

    async def _stream(
        self, sub: Subscription | None, identity: Identity, agent: str | None, thread: str | None
    ):
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
                if event is None:
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

    # -- status ---------------------------------------------------------------------------

    async def status_document(self) -> dict[str, Any]:
        ctx = self.ctx
        pump = ctx.pump
        stats = pump.stats()
        listeners = [
            {
                "name": lst.name,
                "agent": lst.agent,
                "queue": stats["queues"].get(lst.name, 0),
                "waiting": stats["waiting"].get(lst.name, 0),
                "handled": stats["handled"].get(lst.name, 0),
            }
            for lst in pump.listeners
        ]
        view = ctx.agents
        return {
            "organism": ctx.organism,
            "version": ctx.version,
            "ready": await self.readiness(),
            "pump": {k: v for k, v in stats.items() if k not in ("queues", "waiting", "handled")},
            "listeners": listeners,
            "agents": await view.agent_list() if view is not None else [],
            "backends": ctx.backends() if ctx.backends is not None else {},
            "connections": {
                **ctx.transports(),
                "http_pending": ctx.gateway.active,
                "http_kept_threads": len(ctx.gateway.pending),
                "sse_streams": self.streams,
            },
            "http": {**ctx.counters, **ctx.gateway.counters},
        }

    async def steps(self, request: Request) -> Response:
        """The remote listeners' step log, oldest first: ``?listener=``, ``?step=``,
        ``?after=SEQ`` (page on from the last row's ``seq``), ``?limit=`` (1-1000)."""
        identity = await self._identify(request)
        if isinstance(identity, Response):
            return identity
        q = request.query_params
        try:
            after, limit = int(q.get("after", "0")), int(q.get("limit", "100"))
        except ValueError:
            return problem(400, "bad-request", "after and limit are integers.")
        log_ = self.ctx.steps
        listener = q.get("listener") or None
        if log_ is None or (listener is not None and not self._may_see(identity, listener)):
            return JSONResponse({"durable": False, "steps": []})
        rows = await log_.rows(
            step=q.get("step") or None, listener=listener, after=after, limit=limit
        )
        return JSONResponse(
            {
                "durable": log_.durable,
                "steps": [r.as_dict() for r in rows if self._may_see(identity, r.listener)],
            }
        )

    async def status(self, request: Request) -> Response:
        identity = await self._identify(request)
        if isinstance(identity, Response):
            return identity
        return JSONResponse(await self.status_document())
