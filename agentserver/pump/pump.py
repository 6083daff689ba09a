"""The message pump: moves validated messages between listeners and endpoints under trio.

Decisions live elsewhere (``envelope`` validates, ``routing`` chooses targets, ``threads``
tracks chains); this module only applies them, moving payloads and time.

Semantics worth knowing:

- Each listener has a bounded queue (``Listener.queue_size``) served by
  ``Listener.concurrency`` worker tasks. Putting into a full queue waits, first come
  first served, for ``PumpConfig.delivery_timeout`` seconds at most (give or take one
  tick of the deadline monitor); then the sender gets a ``<SystemError>``
  (``timeout``, retry allowed). Nothing grows without bound.
- Endpoints are never waited on (see :class:`~agentserver.pump.endpoint.Endpoint`).
- Every message a sender is owed gets exactly one answer: a reply, a ``<huh>`` or a
  ``<SystemError>``. A handler's exception, wrong return type or timeout becomes one
  primitive for its caller; details go to the log only.
- Shutdown (:meth:`Pump.close`) stops accepting from endpoints, lets queued work finish
  for up to ``drain_timeout`` seconds, then cancels what is left; every external caller
  whose request was still queued or running receives a ``<SystemError>`` ``timeout``.
"""

from __future__ import annotations

import collections
import copy
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from contextlib import asynccontextmanager
from contextvars import Token
from typing import Any

import trio
from lxml import etree
from opentelemetry.context import Context
from opentelemetry.trace import Span

from agentserver.core.envelope import EnvelopeCodec, build_envelope, encode, guess_thread
from agentserver.core.errors import (
    ConfigurationError,
    DeliveryRefused,
    HuhReason,
    InputRefused,
    PumpClosed,
    Refusal,
    SystemErrorCode,
)
from agentserver.core.listener import (
    NAME_RE,
    HandlerMetadata,
    HandlerResponse,
    HandlerResult,
    Listener,
    to_element,
)
from agentserver.core.payloads import PayloadRegistry, PayloadType, model_from_tree
from agentserver.core.routing import RoutingTable, SelfCall
from agentserver.core.threads import (
    RegistryFull,
    ThreadRecord,
    ThreadRegistry,
    is_uuid4,
    new_thread_id,
)
from agentserver.core.xmlsafe import canonicalize
from agentserver.observability.tracing import Tracing, attach, detach, record_error
from agentserver.primitives.core import CORE_MODELS
from agentserver.pump.config import PumpConfig
from agentserver.pump.delivery import SYSTEM, Delivery
from agentserver.pump.endpoint import Endpoint
from agentserver.pump.later import Later
from agentserver.pump.lifecycle import Lifecycle
from agentserver.pump.refusals import MAX_STRIKES, Refusals
from agentserver.pump.roster import Roster
from agentserver.pump.runtime import ListenerRuntime, PumpState, Slot
from agentserver.pump.threadref import ThreadRef

# ThreadRef and SYSTEM are imported from here by the pump's users.
__all__ = ["MAX_STRIKES", "SYSTEM", "Pump", "PumpConfig", "ThreadRef", "open_pump"]

log = logging.getLogger("agentserver.pump")

#: A worker yields to the scheduler at least every this many back-to-back deliveries.
_YIELD_EVERY = 16
#: Handler calls shorter than this are timed (for the metrics) one in ``_TIME_EVERY``:
#: a clock read costs about 0.5 µs here, a fast handler's whole delivery about 30 µs.
_SLOW_HANDLER = 0.001
_TIME_EVERY = 16

_new_meta = tuple.__new__


class Pump:
    """Register listeners, then ``await nursery.start(pump.run)`` (or use :func:`open_pump`).

    One class of about 800 lines, past the ~500 a module aims at, on purpose: the hot
    paths (the synchronous fast path :meth:`inject_now` → :meth:`_inject_sync`, and a
    worker's loop :meth:`serve`) are attribute lookups on ``self`` and calls of its own
    methods, with no cross-object call and no extra frame per message; splitting the class
    by concern would add one per message on exactly those paths (measured figures:
    docs/performance.md). What has no per-message cost is composed in: the listeners and
    endpoints and the wiring frozen from them (``pump.roster``: the pump holds its dicts),
    the run, drain, workers' restarts, deadline monitor and shutdown (``pump.lifecycle``),
    answering later and the pump's own messages (``pump.later``), the refusal and failure
    paths no successful message takes (``pump.refusals``); the methods here keep their
    names for callers. The parts reach the pump through the protocols they declare
    (``Engine``, ``LaterOwner``, ``EndpointOwner``, ``RefusalOwner``): :meth:`enqueue`,
    :meth:`deliver_to_owner`, :meth:`settle`, :meth:`serve`, :meth:`fail`,
    :meth:`drained`, :meth:`refuse_queued`, ``state`` and ``now`` are for them, not users.
    """

    def __init__(
        self,
        listeners: Iterable[Listener] = (),
        *,
        config: PumpConfig | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config or PumpConfig()
        self.tracing = tracing or Tracing()
        #: None when tracing is off: the hot paths test this one attribute.
        self._tracer = self.tracing if self.tracing.enabled else None
        if not NAME_RE.match(self.config.organism):
            raise ConfigurationError(f"organism name {self.config.organism!r}: use [a-z0-9_-]")
        self.payloads = PayloadRegistry()
        for model in CORE_MODELS:
            self.payloads.add(model)
        self.threads = ThreadRegistry(
            max_threads=self.config.max_threads, idle_ttl=self.config.thread_idle_ttl
        )
        self._codec = EnvelopeCodec(self.payloads, max_bytes=self.config.max_message_bytes)
        roster = self.roster = Roster(self.config, self.payloads, self.threads, self)
        # The roster's own dicts, filled in place: the hot path reads them on self.
        self._runtimes = self.roster.runtimes
        self._endpoints = self.roster.endpoints
        self._sync_by_tag = self.roster.sync_by_tag
        #: The routing table, frozen by run(): every method that reads it runs only once
        #: the pump is RUNNING (declared here, assigned there, so the hot path tests nothing).
        self._table: RoutingTable
        #: Set by the lifecycle only (Lifecycle.run).
        self.state = PumpState.NEW
        self._inflight = 0
        #: trio's clock as of the deadline monitor's last tick (set by the lifecycle).
        self.now = 0.0
        self._idle = trio.Event()
        self.root_thread: ThreadRecord | None = None
        names = "injected refused delivered handler_errors timeouts dropped self_calls sent"
        self.counters = dict.fromkeys(names.split(), 0)
        #: Refusals by (listener or endpoint refused, reason): for the metrics.
        self.refusals: collections.Counter[tuple[str, str]] = collections.Counter()
        later = self._later = Later(self, roster, self._codec)
        lifecycle = self._lifecycle = Lifecycle(self, roster)
        # The parts' methods, bound here under the names callers and docs use (Pump.hold,
        # Pump.open_endpoint, ...): an attribute each, no forwarding frame.
        self.register = roster.register
        self.usage_instructions = roster.usage_instructions
        self.is_connected = roster.is_connected
        self.open_endpoint = roster.open_endpoint
        self.detach_endpoint = roster.detach_endpoint
        self.handler_latency = roster.handler_latency
        self.close = lifecycle.close
        self.hold, self.release, self.revive = later.hold, later.release, later.revive
        self.call_from, self.answer = later.call_from, later.answer
        self.inject_system, self.end_hop = later.inject_system, later.end_hop
        self.check_call, self.check_self_call = later.check_call, later.check_self_call
        self.check_task = later.check_task
        refusing = Refusals(self, roster.endpoints)
        self._count_refusal, self._primitive = refusing.count, refusing.primitive
        self._answer_endpoint, self._refuse_sync = refusing.answer_endpoint, refusing.refuse_sync
        self._bounce, self.fail, self._pass_up = refusing.bounce, refusing.fail, refusing.pass_up
        for listener in listeners:
            roster.register(listener)

    # -- kept on the Pump for its callers (the rest of the roster, lifecycle and later) --

    @property
    def listeners(self) -> tuple[Listener, ...]:
        return self.roster.listeners

    async def run(self, *, task_status: trio.TaskStatus[Pump] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until :meth:`close` (then drain) or until cancelled (then refuse what is left):
        :meth:`Lifecycle.run`. ``task_status.started`` fires once every worker is up and
        the root thread exists."""
        if self.state is not PumpState.NEW:
            raise RuntimeError("a pump runs once")
        self._table = self.roster.freeze()
        await self._lifecycle.run(functools.partial(task_status.started, self))

    @property
    def running(self) -> bool:
        return self.state is PumpState.RUNNING

    def stats(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "threads": len(self.threads),
            "inflight": self._inflight,
            "endpoints": len(self._endpoints),
            **self.roster.queue_stats(),
            **self.counters,
        }

    # -- the hot path: inject -------------------------------------------------------------

    async def inject(self, data: bytes, endpoint: Endpoint) -> None:
        """Validate and route one envelope from ``endpoint``.

        Returns once the message is queued for its listener(s), or once the refusal is queued
        for the endpoint. Raises :class:`PumpClosed` if the pump does not accept messages.
        """
        rest = self.inject_now(data, endpoint)
        if rest is not None:
            await rest

    def inject_now(self, data: bytes, endpoint: Endpoint) -> Coroutine[Any, Any, None] | None:
        """:meth:`inject`'s synchronous part: None if the message was dealt with here (a
        refusal, or a sync listener's answer: the common case), else the coroutine that
        does the rest, which the caller must await. Raises :class:`PumpClosed` like
        :meth:`inject`. Saves a coroutine per message on the fast path, and tells a
        caller (the server's reader) whether the message was dealt with without waiting."""
        if self.state is not PumpState.RUNNING:
            raise PumpClosed(self.state.value)
        self.counters["injected"] += 1
        root = None
        try:
            root = self._codec.parse_root(data)
            inbound = self._codec.decode(root)
        except InputRefused as refusal:
            if refusal.payload_tag is not None:
                refusal = self._table.explain(refusal)
            self._answer_endpoint(endpoint, guess_thread(root) or new_thread_id(), refusal, data)
            return None
        to, thread_id, inbound_payload, ptype = inbound
        rt = self._sync_by_tag.get(ptype.tag)
        if (
            rt is not None
            and (to is None or to == rt.listener.name)
            and (endpoint.allowed is None or rt.listener.name in endpoint.allowed)
        ):
            return self._inject_sync(rt, endpoint, thread_id, inbound_payload, ptype, data)
        return self._inject_routed(endpoint, to, thread_id, inbound_payload, ptype, data)

    async def _inject_routed(
        self,
        endpoint: Endpoint,
        to: str | None,
        thread_id: str,
        inbound_payload: etree._Element,
        ptype: PayloadType,
        data: bytes,
    ) -> None:
        """:meth:`inject` through the routing table and the listeners' queues."""
        now = self.now
        try:
            thread = self._client_thread(endpoint, thread_id, now)
        except RegistryFull:
            busy = DeliveryRefused(
                SystemErrorCode.ROUTING, retry_allowed=True, detail="registry full"
            )
            self._answer_endpoint(endpoint, thread_id, busy, data)
            return
        try:
            targets = self._table.inbound(ptype.tag, to)
            if endpoint.allowed is not None and not all(t in endpoint.allowed for t in targets):
                raise InputRefused(
                    HuhReason.INVALID_PAYLOAD, f"{endpoint.name} may not address {targets}"
                )
        except InputRefused as refusal:
            self.threads.finish(thread)  # a fresh conversation got no hop: it ends here
            if refusal.payload_tag is not None:
                refusal = self._table.explain(refusal)
            self._answer_endpoint(endpoint, thread.id, refusal, data)
            return
        payload: etree._Element | None = inbound_payload
        for target in targets:
            if payload is None:  # broadcast: every further listener gets its own copy
                payload = copy.deepcopy(inbound_payload)
            try:
                child = self.threads.extend(thread, target, now)
            except RegistryFull:
                busy = DeliveryRefused(
                    SystemErrorCode.ROUTING, retry_allowed=True, detail="registry full"
                )
                self._answer_endpoint(endpoint, thread.id, busy, data)
                continue
            delivery = Delivery(payload, ptype, child, endpoint.name, False, None, data)
            payload = None
            if self._put_nowait(target, delivery):
                continue
            try:
                await self._put(target, delivery)
            except DeliveryRefused as refusal:
                self.threads.prune(child)
                self._answer_endpoint(endpoint, thread.id, refusal, data)
        if not thread.children:  # no hop was opened: the conversation holds nothing
            self.threads.finish(thread)

    def _inject_sync(
        self,
        rt: ListenerRuntime,
        endpoint: Endpoint,
        thread_id: str,
        payload: etree._Element,
        ptype: PayloadType,
        data: bytes,
    ) -> Coroutine[Any, Any, None] | None:
        """The synchronous fast path: ``endpoint``'s request to ``rt``'s sync handler,
        run here, in the injecting task. The common outcome, a valid response, is pushed
        to the endpoint at once, and the request never touches a queue, a worker or the
        thread registry (its conversation and hop would live for this call only). Any
        other outcome (an exception, a forward, an invalid reply, ...) gets its threads
        made then and goes through the general machinery: the returned coroutine does
        that, and the caller awaits it."""
        # The conversation thread, as _client_thread would choose it.
        record = self.threads.lookup(thread_id)
        if record is not None:
            if record.parent is None and (
                record.chain is endpoint.chain or record.chain == endpoint.chain
            ):
                record.last_active = self.now
            else:
                thread_id = new_thread_id()
        elif thread_id != endpoint.last_thread:
            # A client usually goes on on one thread: its id is checked once, not per
            # message (the registry lookup above is still made every time).
            if is_uuid4(thread_id):
                endpoint.last_thread = thread_id
            else:
                thread_id = new_thread_id()
        listener = rt.listener
        name = listener.name
        # tuple.__new__: a NamedTuple's own __new__ is a Python function (twice the cost).
        hop = new_thread_id()
        meta = _new_meta(
            HandlerMetadata,
            (hop, endpoint.name, name, False, rt.usage, None, endpoint.chain + rt.chain, hop),
        )
        self.counters["delivered"] += 1
        rt.handled += 1
        if self._tracer is not None:
            return self._inject_sync_traced(
                self._tracer, rt, endpoint, thread_id, payload, ptype, data, meta
            )
        try:
            if rt.skip:
                rt.skip -= 1
                result = rt.sync(payload, meta)
            else:
                started = time.perf_counter()
                result = rt.sync(payload, meta)
                elapsed = time.perf_counter() - started
                rt.latency.observe(elapsed, rt.weight)
                rt.weight = 1 if elapsed >= _SLOW_HANDLER else _TIME_EVERY
                rt.skip = rt.weight - 1
        except Exception as exc:
            return self._sync_fallback(
                rt, endpoint, thread_id, meta[0], payload, ptype, data, None, error=exc
            )
        if (
            type(result) is HandlerResponse
            and result.is_response
            and type(result.payload) is etree._Element
        ):
            answer = result.payload
            try:
                self._codec.validate_payload(answer)
            except Refusal:
                pass  # bounced to the listener by the general path
            else:
                if endpoint.push(
                    canonicalize(build_envelope(name, endpoint.name, thread_id, answer))
                ):
                    self.counters["sent"] += 1
                else:
                    self.counters["dropped"] += 1
                return None
        elif result is None:
            endpoint.chain_ended()  # the request ends unanswered, as a worker's would
            return None
        return self._sync_fallback(rt, endpoint, thread_id, meta[0], payload, ptype, data, result)

    def _inject_sync_traced(
        self,
        tracer: Tracing,
        rt: ListenerRuntime,
        endpoint: Endpoint,
        thread_id: str,
        payload: etree._Element,
        ptype: PayloadType,
        data: bytes,
        meta: HandlerMetadata,
    ) -> Coroutine[Any, Any, None] | None:
        """:meth:`_inject_sync`'s call and answer with tracing on: in the call's ``handle``
        span, as a worker would run it (what falls back runs after the span, in the
        sender's context)."""
        span = tracer.start_handle(rt.listener.name, None, endpoint.name, meta[0], True)
        token = attach(span)
        error: Exception | None = None
        result: HandlerResult = None
        try:
            started = time.perf_counter()
            result = rt.sync(payload, meta)
            rt.latency.observe(time.perf_counter() - started, 1)  # a span reads clocks anyway
        except Exception as exc:
            record_error(span, type(exc).__name__)
            error = exc
        finally:
            detach(token)
        if error is not None:
            pass
        elif (
            type(result) is HandlerResponse
            and result.is_response
            and type(result.payload) is etree._Element
        ):
            try:
                self._codec.validate_payload(result.payload)
            except Refusal:
                pass
            else:
                self._push(endpoint, rt.listener.name, thread_id, result.payload)
                span.end()
                return None
        elif result is None:
            endpoint.chain_ended()
            span.end()
            return None
        # The general path runs in the span too (a forward's hop is its child), then ends it.
        return self._sync_fallback(
            rt, endpoint, thread_id, meta[0], payload, ptype, data, result, error=error, span=span
        )

    async def _sync_fallback(
        self,
        rt: ListenerRuntime,
        endpoint: Endpoint,
        thread_id: str,
        hop: str,
        payload: etree._Element,
        ptype: PayloadType,
        data: bytes,
        result: object,
        *,
        error: Exception | None = None,
        span: Span | None = None,
    ) -> None:
        """A fast-path call that did not simply answer: open its conversation and hop (with
        the ids its handler saw) and finish it as a worker would have. ``result``: what the
        handler returned; ``error``: what it raised instead."""
        listener = rt.listener
        now = self.now
        thread = None
        try:
            thread = self._client_thread(endpoint, thread_id, now)
            child = self.threads.extend(thread, listener.name, now, thread_id=hop)
        except RegistryFull:
            if thread is not None and not thread.children:
                self.threads.finish(thread)
            busy = DeliveryRefused(
                SystemErrorCode.ROUTING, retry_allowed=True, detail="registry full"
            )
            self._answer_endpoint(endpoint, thread_id, busy, data)
            if span is not None:
                record_error(span, "registry_full")
                span.end()
            return
        d = Delivery(payload, ptype, child, endpoint.name, False, None, data)
        self._inflight += 1
        child.pending += 1
        token = attach(span) if span is not None else None
        try:
            if isinstance(error, Refusal):
                log.info("%s: refused on %s: %s", listener.name, child.dotted, error)
                await self.fail(child, error, d)
            elif error is not None:
                self.counters["handler_errors"] += 1
                log.error("%s: handler raised on %s", listener.name, child.dotted, exc_info=error)
                reason = f"{listener.name}: handler raised {type(error).__name__}: {error}"
                await self.fail(child, InputRefused(HuhReason.HANDLER_FAILED, reason), d)
            elif type(result) is HandlerResponse and type(result.payload) is etree._Element:
                await self._emit(listener, child, result, result.payload)
            else:
                await self._apply(listener, child, result, d)
        finally:
            child.pending -= 1
            self._done()
            if token is not None:
                detach(token)
            if span is not None:
                span.end()
        if not (child.children or child.pins or child.pending):
            self.settle(child)

    def _client_thread(self, endpoint: Endpoint, thread_id: str, now: float) -> ThreadRecord:
        """The endpoint's conversation thread: reused if it is the endpoint's own, accepted
        if it is a fresh uuid4, else replaced by a new uuid4 (which the replies carry).
        A client can never attach to another party's thread.

        The conversation is transient (it ends with its last hop: a finished conversation
        holds no registry capacity; reusing its id opens it again) and charged to the
        endpoint's quota."""
        threads = self.threads
        record = threads.get(thread_id)
        if record is not None:
            if record.parent is None and (
                record.chain is endpoint.chain or record.chain == endpoint.chain
            ):
                record.last_active = now
                return record
        elif is_uuid4(thread_id):
            return threads.open_root(
                endpoint.chain, now, thread_id, quota=endpoint.quota, transient=True
            )
        return threads.open_root(endpoint.chain, now, None, quota=endpoint.quota, transient=True)

    # -- delivery ------------------------------------------------------------------------

    async def enqueue(self, target: str, delivery: Delivery) -> None:
        """Queue for a listener. Raises DeliveryRefused(timeout) if the queue stays full."""
        if not self._put_nowait(target, delivery):
            await self._put(target, delivery)

    def _put_nowait(self, target: str, delivery: Delivery) -> bool:
        """Queue for a listener if there is room now and nobody is waiting for room.
        False: nothing was queued."""
        rt = self._runtimes[target]
        if rt.waiters:
            return False
        if self._tracer is not None:
            delivery.trace = self._tracer.current_span()
        try:
            rt.send.send_nowait(delivery)
        except trio.WouldBlock:
            return False
        self._inflight += 1
        delivery.thread.pending += 1
        return True

    async def _put(self, target: str, delivery: Delivery) -> None:
        """Wait, behind anyone already waiting, for room in a listener's queue; after
        ``delivery_timeout`` seconds (up to one monitor tick more) raise
        DeliveryRefused(timeout). On cancellation nothing stays queued."""
        rt = self._runtimes[target]
        if self.state is PumpState.CLOSED:  # no monitor left to end a wait
            raise DeliveryRefused(SystemErrorCode.TIMEOUT, retry_allowed=True, detail="closed")
        self._inflight += 1
        delivery.thread.pending += 1
        if self._tracer is not None:
            delivery.trace = self._tracer.current_span()
        try:
            deadline = trio.current_time() + self.config.delivery_timeout
            if await rt.waiters.wait(delivery, deadline):
                return
        except BaseException:
            self._undo(delivery)
            raise
        self._undo(delivery)
        self.counters["timeouts"] += 1
        raise DeliveryRefused(
            SystemErrorCode.TIMEOUT, retry_allowed=True, detail=f"{target} queue full"
        )

    def _undo(self, delivery: Delivery) -> None:
        delivery.thread.pending -= 1
        self._done()

    def _done(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def drained(self) -> None:
        """Return once nothing is queued or being handled (the lifecycle's drain).
        Cancelled: nothing changes."""
        if self._inflight:
            self._idle = trio.Event()
            await self._idle.wait()

    def refuse_queued(self, d: Delivery, refusal: Refusal) -> None:
        """``d`` was taken off its queue unhandled at shutdown: it is no longer in flight,
        and an external caller (or a listener's caller) is told now, synchronously."""
        self._inflight -= 1
        d.thread.pending -= 1
        if d.from_id in self._endpoints or d.thread.parent is not None:
            self._refuse_sync(d.thread, refusal)

    async def deliver_to_owner(
        self,
        record: ThreadRecord,
        payload: etree._Element,
        ptype: PayloadType,
        from_id: str,
        response_thread: str | None,
    ) -> None:
        """Hand ``payload`` to whoever works on ``record``: a listener or an endpoint."""
        owner = record.owner
        if owner in self._runtimes:
            await self.enqueue(
                owner, Delivery(payload, ptype, record, from_id, False, response_thread, None)
            )
            return
        endpoint = self._endpoints.get(owner)
        if endpoint is not None:
            # The owner's thread was touched when its message was handled: no clock read.
            self._push(endpoint, from_id, record.id, payload)
            return
        self.counters["dropped"] += 1
        log.info("dropped %s for %s on %s: nobody there", ptype.local, owner, record.dotted)

    def _push(
        self, endpoint: Endpoint, from_id: str, thread_id: str, payload: etree._Element
    ) -> None:
        """Send a validated payload to an endpoint (never waits; counted if dropped)."""
        if endpoint.push(encode(from_id, endpoint.name, thread_id, payload)):
            self.counters["sent"] += 1
        else:
            self.counters["dropped"] += 1

    # -- handlers ------------------------------------------------------------------------

    async def serve(self, rt: ListenerRuntime, slot: Slot) -> None:
        """Take deliveries off the listener's queue and run the handler on each.

        The whole of a delivery runs inline here (no coroutine per step): this loop is the
        pump's hot path. Nothing reads the clock per message (see
        ``Lifecycle._deadline_monitor``): a handler's duration, for the metrics, is measured for
        every call after a slow one (``_SLOW_HANDLER``) but only one call in
        ``_TIME_EVERY`` after a fast one, that observation then counting for the calls
        skipped. With tracing on, the delivery runs in its ``handle`` span.
        """
        receive = rt.receive
        waiters = rt.waiters
        listener = rt.listener
        handler = rt.call
        raw = listener.raw
        unreadable = rt.unreadable
        threads = self.threads
        counters = self.counters
        latency = rt.latency
        perf_counter = time.perf_counter
        skip, weight = 0, 1  # handler calls not to time; the weight of the next timing
        tracer = self._tracer
        span: Span | None = None
        token: Token[Context] | None = None
        streak = 0
        while True:
            try:
                d = receive.receive_nowait()
                if waiters:
                    waiters.hand_over(rt.send)
                streak += 1
                if streak >= _YIELD_EVERY:
                    # Bounded unfairness: yield to other tasks every few deliveries rather
                    # than on every one (a scheduler round trip costs as much as a delivery).
                    streak = 0
                    await trio.lowlevel.checkpoint()
            except trio.WouldBlock:
                try:
                    d = await receive.receive()
                except trio.EndOfChannel:
                    return
                streak = 0
            # The delivery stays pending on its thread until its outputs are out, so the
            # thread cannot be finished (by a call of it ending) while its handler runs.
            thread = d.thread
            slot.delivery = d
            if tracer is not None:
                span = tracer.start_handle(
                    listener.name, d.trace, d.from_id, thread.id, d.original is not None
                )
                token = attach(span)
            try:
                if threads.get(thread.id) is not thread:
                    counters["dropped"] += 1
                    log.info(
                        "%s: thread %s ended while the message waited; dropped",
                        listener.name,
                        thread.id,
                    )
                    continue
                counters["delivered"] += 1
                thread.last_active = self.now
                if unreadable and d.ptype.model in unreadable:
                    await self._pass_up(listener, thread, d)
                    continue
                meta = HandlerMetadata(
                    thread.id,
                    d.from_id,
                    listener.name,
                    d.is_self_call,
                    rt.usage,
                    d.response_thread,
                    thread.chain,
                    d.key or thread.id,
                )
                try:
                    payload = d.payload if raw else model_from_tree(d.ptype.model, d.payload)
                    slot.deadline = math.inf  # the monitor starts the clock at its next tick
                    slot.current = d
                    timed = not skip
                    if timed:
                        started = perf_counter()
                    else:
                        skip -= 1
                    try:
                        result = await handler(payload, meta)
                    finally:
                        slot.current = None
                        if timed:
                            elapsed = perf_counter() - started
                            latency.observe(elapsed, weight)
                            weight = 1 if elapsed >= _SLOW_HANDLER else _TIME_EVERY
                            skip = weight - 1
                except trio.Cancelled:
                    if slot.expired is None:
                        # Shutdown, not a timeout: tell an external caller now, synchronously.
                        self._refuse_sync(
                            thread, DeliveryRefused(SystemErrorCode.TIMEOUT, retry_allowed=True)
                        )
                    elif span is not None:
                        record_error(span, "timeout")
                    raise
                except Refusal as refusal:
                    # A handler may answer its caller with a primitive on purpose (a
                    # remote listener's step that timed out or failed: agentserver.remote.hub).
                    if span is not None:
                        record_error(span, type(refusal).__name__)
                    log.info("%s: refused on %s: %s", listener.name, thread.dotted, refusal)
                    await self.fail(thread, refusal, d)
                    continue
                except Exception as exc:
                    if span is not None:
                        record_error(span, type(exc).__name__)
                    counters["handler_errors"] += 1
                    log.exception("%s: handler raised on %s", listener.name, thread.dotted)
                    reason = f"{listener.name}: handler raised {type(exc).__name__}: {exc}"
                    await self.fail(thread, InputRefused(HuhReason.HANDLER_FAILED, reason), d)
                    continue
                if type(result) is HandlerResponse and type(result.payload) is etree._Element:
                    if result.is_response and self._answer_client(listener, thread, result.payload):
                        continue
                    await self._emit(listener, thread, result, result.payload)
                else:
                    await self._apply(listener, thread, result, d)
            finally:
                thread.pending -= 1
                rt.handled += 1
                self._done()
                if span is not None:
                    if token is not None:  # always, with a span (for the checker)
                        detach(token)
                    span.end()
                    span = None
            if not (thread.children or thread.pins or thread.pending):
                # Nothing can reach this thread any more (it answered, or its chain ended).
                self.settle(thread)

    def _answer_client(
        self, listener: Listener, thread: ThreadRecord, element: etree._Element
    ) -> bool:
        """The hot case of :meth:`_emit`, without a coroutine: a valid response (its
        payload ``element``) whose caller is an endpoint. Returns False, having changed
        nothing, in any other case (then :meth:`_emit` handles it, refusals included)."""
        threads = self.threads
        if threads.get(thread.id) is not thread or thread.parent is None:
            return False
        parent = threads.get(thread.parent)
        if parent is None:
            return False
        owner = parent.chain[-1]
        endpoint = self._endpoints.get(owner)
        if endpoint is None:
            return False
        try:
            self._codec.validate_payload(element)
        except Refusal:
            return False
        threads.prune(thread)
        self._push(endpoint, listener.name, parent.id, element)
        return True

    async def _apply(
        self, listener: Listener, thread: ThreadRecord, result: object, d: Delivery
    ) -> None:
        if result is None:
            return  # the chain ends (the worker settles the thread)
        if isinstance(result, HandlerResponse):
            items: tuple[HandlerResponse, ...] = (result,)
        elif isinstance(result, list | tuple) and all(
            isinstance(r, HandlerResponse) for r in result
        ):
            items = tuple(result)
        else:
            self.counters["handler_errors"] += 1
            log.error(
                "%s: handler returned %s, not a HandlerResponse",
                listener.name,
                type(result).__name__,
            )
            reason = f"{listener.name}: handler returned {type(result).__name__}"
            await self.fail(thread, InputRefused(HuhReason.HANDLER_FAILED, reason), d)
            return
        if not items:
            return
        for item in items:
            try:
                element = to_element(item.payload)
            except Exception as exc:
                self.counters["handler_errors"] += 1
                log.exception("%s: handler returned an unusable payload", listener.name)
                reason = f"{listener.name}: handler returned an unusable payload: {exc}"
                await self.fail(thread, InputRefused(HuhReason.HANDLER_FAILED, reason), d)
                return
            await self._emit(listener, thread, item, element)

    async def _emit(
        self,
        listener: Listener,
        thread: ThreadRecord,
        item: HandlerResponse,
        element: etree._Element,
    ) -> None:
        """Validate and route one handler output; refusals go back to the sender."""
        if self.threads.get(thread.id) is not thread:
            self.counters["dropped"] += 1
            log.warning("%s: output after its thread ended on %s dropped", listener.name, thread.id)
            return
        try:
            ptype = self._codec.validate_payload(element)
            if item.is_response:
                parent = self.threads.prune(thread)
                if parent is None:
                    log.info(
                        "%s responded on %s with no caller; dropped", listener.name, thread.dotted
                    )
                    return
                await self.deliver_to_owner(parent, element, ptype, listener.name, thread.id)
                return
            decision = self._table.outbound(listener.name, ptype.tag, item.to)
            now = self.now
            if isinstance(decision, SelfCall):
                await self.enqueue(
                    listener.name,
                    Delivery(element, ptype, thread, listener.name, True, None, None),
                )
            else:
                for i, target in enumerate(decision.targets):
                    payload = element if i == 0 else copy.deepcopy(element)
                    child = self.threads.extend(thread, target, now)
                    try:
                        await self.enqueue(
                            target,
                            Delivery(payload, ptype, child, listener.name, False, None, None),
                        )
                    except DeliveryRefused:
                        self.threads.prune(child)
                        raise
            thread.strikes = 0
        except RegistryFull:
            await self._bounce(
                listener,
                thread,
                DeliveryRefused(SystemErrorCode.ROUTING, retry_allowed=True),
                element,
            )
        except Refusal as refusal:
            await self._bounce(listener, thread, refusal, element)

    def settle(self, thread: ThreadRecord) -> None:
        """End ``thread`` if nothing can reach it any more (see ``ThreadRegistry.finish``).
        If that ends an endpoint's request without an answer, tell the endpoint, so that
        a server frees the request's in-flight slot now."""
        top = self.threads.finish(thread)
        if top is not None and top.parent is not None and len(top.chain) == 2:
            endpoint = self._endpoints.get(top.chain[0])
            if endpoint is not None:
                endpoint.chain_ended()


@asynccontextmanager
async def open_pump(
    listeners: Iterable[Listener] = (),
    *,
    config: PumpConfig | None = None,
    tracing: Tracing | None = None,
) -> AsyncIterator[Pump]:
    """Run a pump for the duration of the block; leaving it drains and closes the pump."""
    pump = Pump(listeners, config=config, tracing=tracing)
    async with trio.open_nursery() as nursery:
        await nursery.start(pump.run)
        try:
            yield pump
        finally:
            pump.close()
