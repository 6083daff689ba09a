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
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from contextlib import asynccontextmanager
from typing import Any

import trio
from lxml import etree
from pydantic_xml import BaseXmlModel

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
    RESERVED_NAMES,
    HandlerMetadata,
    HandlerResponse,
    Listener,
    to_element,
)
from agentserver.core.namespaces import CORE_NS
from agentserver.core.payloads import PayloadRegistry, PayloadType
from agentserver.core.routing import RoutingTable, SelfCall
from agentserver.core.threads import (
    RegistryFull,
    ThreadQuota,
    ThreadRecord,
    ThreadRegistry,
    is_uuid4,
    new_thread_id,
)
from agentserver.core.usage import describe_payload, usage_instructions
from agentserver.core.xmlsafe import canonical_or_empty, canonicalize
from agentserver.observability.logs import current_slot
from agentserver.observability.metrics import LatencyHistogram
from agentserver.observability.tracing import Tracing, attach, detach, record_error
from agentserver.primitives.core import CORE_MODELS, SystemErrorPayload, primitive_for
from agentserver.pump.config import PumpConfig
from agentserver.pump.delivery import Delivery
from agentserver.pump.endpoint import Endpoint, Sink
from agentserver.pump.runtime import ListenerRuntime, PumpState, Slot
from agentserver.pump.threadref import ThreadRef

log = logging.getLogger("agentserver.pump")

SYSTEM = "system"
#: After this many consecutive refused outputs on one thread, the owner's caller gets a
#: ``<huh>`` instead of the owner getting yet another one (stops refusal ping-pong).
MAX_STRIKES = 3
#: A worker yields to the scheduler at least every this many back-to-back deliveries.
_YIELD_EVERY = 16
#: Handler calls shorter than this are timed (for the metrics) one in ``_TIME_EVERY``:
#: a clock read costs about 0.5 µs here, a fast handler's whole delivery about 30 µs.
_SLOW_HANDLER = 0.001
_TIME_EVERY = 16

_new_meta = tuple.__new__


class Pump:
    """Register listeners, then ``await nursery.start(pump.run)`` (or use :func:`open_pump`).

    One class of about 1,170 lines, past the ~500 a module aims at, on purpose: the hot
    paths (the synchronous fast path :meth:`inject_now` → :meth:`_inject_sync`, and a
    worker's loop :meth:`_serve`) are attribute lookups on ``self`` and calls of its own
    methods, with no cross-object call and no extra frame per message; splitting the class
    by concern would add one per message on exactly those paths (measured figures:
    docs/performance.md). What could leave without a per-message cost has left: the
    configuration (``pump.config``), what is queued and who waits for room
    (``pump.delivery``), the per-listener state and worker slots (``pump.runtime``), the
    durable hop reference (``pump.threadref``) and the endpoints (``pump.endpoint``). The
    agents' answering-later methods (:meth:`hold` … :meth:`answer`) stay: they work on the
    same queues and thread registry, which another object would have to reach into.
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
        self._listeners: list[Listener] = []
        self._runtimes: dict[str, ListenerRuntime] = {}
        self._endpoints: dict[str, Endpoint] = {}
        self._table: RoutingTable | None = None
        #: Root tag → the runtime of the one synchronous listener taking it.
        self._sync_by_tag: dict[str, ListenerRuntime] = {}
        self._state = PumpState.NEW
        self._inflight = 0
        #: trio's clock as of the deadline monitor's last tick (see _deadline_monitor).
        self._now = 0.0
        self._idle = trio.Event()
        self._close_requested = trio.Event()
        self.root_thread: ThreadRecord | None = None
        self.counters = {
            "injected": 0,
            "refused": 0,
            "delivered": 0,
            "handler_errors": 0,
            "timeouts": 0,
            "dropped": 0,
            "self_calls": 0,
            "sent": 0,
        }
        #: Refusals by (listener or endpoint refused, reason): for the metrics.
        self.refusals: collections.Counter[tuple[str, str]] = collections.Counter()
        for listener in listeners:
            self.register(listener)

    # -- configuration -----------------------------------------------------------------

    def register(self, listener: Listener) -> None:
        """Add a listener (before :meth:`run`). Derives and compiles its payload XSDs now,
        so a model without an XSD equivalent fails here, not at the first message."""
        if self._state is not PumpState.NEW:
            raise ConfigurationError("listeners must be registered before the pump runs")
        if any(existing.name == listener.name for existing in self._listeners):
            raise ConfigurationError(f"listener name {listener.name!r} is used twice")
        for model in (*listener.payload_types, *listener.responses):
            self.payloads.add(model)
        self._listeners.append(listener)

    @property
    def listeners(self) -> tuple[Listener, ...]:
        return tuple(self._listeners)

    def _freeze(self) -> None:
        names = {listener.name for listener in self._listeners}
        for listener in self._listeners:
            missing = [p for p in listener.peers if p not in names]
            if missing:
                raise ConfigurationError(
                    f"listener {listener.name!r} names unknown peers: {', '.join(missing)}"
                )
        tag_of = {p.model: p for p in self.payloads}
        self._table = RoutingTable(self._listeners, tag_of)
        by_name = {listener.name: listener for listener in self._listeners}
        # Describing a type compiles its XSD with xmlschema (~15 ms): once per type, not
        # once per listener that has it among its peers' types.
        describe = functools.cache(describe_payload)
        for listener in self._listeners:
            own = [tag_of[m] for m in listener.payload_types]
            peers = {p: [tag_of[m] for m in by_name[p].payload_types] for p in listener.peers}
            self._runtimes[listener.name] = ListenerRuntime(
                listener, usage_instructions(listener.name, own, peers, describe=describe)
            )
        for tag, names in self._table.by_tag.items():
            if len(names) == 1 and self._runtimes[names[0]].sync is not None:
                self._sync_by_tag[tag] = self._runtimes[names[0]]

    def usage_instructions(self, name: str) -> str:
        """The generated instructions of a listener (available once the pump runs)."""
        return self._runtimes[name].usage

    # -- running -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Pump] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until :meth:`close` (then drain) or until cancelled (then refuse what is left).

        ``task_status.started`` fires once every worker is up and the root thread exists.
        """
        if self._state is not PumpState.NEW:
            raise RuntimeError("a pump runs once")
        self._freeze()
        now = self._now = trio.current_time()
        self.root_thread = self.threads.open_root((SYSTEM, self.config.organism), now)
        self.threads.pin(self.root_thread)
        try:
            async with trio.open_nursery() as nursery:
                for rt in self._runtimes.values():
                    for _ in range(rt.listener.concurrency):
                        nursery.start_soon(self._worker, rt)
                nursery.start_soon(self._expirer)
                nursery.start_soon(self._deadline_monitor)
                self._state = PumpState.RUNNING
                task_status.started(self)
                await self._close_requested.wait()
                self._state = PumpState.DRAINING
                with trio.move_on_after(self.config.drain_timeout):
                    if self._inflight:
                        self._idle = trio.Event()
                        await self._idle.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._state = PumpState.CLOSED
            # Senders still waiting for room (from outside the pump) are refused now: the
            # monitor that would time them out has stopped.
            for rt in self._runtimes.values():
                rt.waiters.expire(math.inf)
            self._refuse_leftovers()
            for endpoint in list(self._endpoints.values()):
                endpoint.close()

    def close(self) -> None:
        """Begin a graceful shutdown. Idempotent; :meth:`run` returns once drained."""
        self._close_requested.set()

    @property
    def running(self) -> bool:
        return self._state is PumpState.RUNNING

    def stats(self) -> dict[str, object]:
        return {
            "state": self._state.value,
            "threads": len(self.threads),
            "inflight": self._inflight,
            "endpoints": len(self._endpoints),
            "queues": {
                n: rt.send.statistics().current_buffer_used for n, rt in self._runtimes.items()
            },
            # Senders waiting for room in a full queue.
            "waiting": {n: len(rt.waiters) for n, rt in self._runtimes.items()},
            "handled": {n: rt.handled for n, rt in self._runtimes.items()},
            **self.counters,
        }

    def handler_latency(self) -> dict[str, LatencyHistogram]:
        """Each listener's handler durations (for the metrics)."""
        return {n: rt.latency for n, rt in self._runtimes.items()}

    def _count_refusal(self, name: str, refusal: Refusal) -> None:
        self.counters["refused"] += 1
        reason = getattr(refusal, "reason", None) or getattr(refusal, "code", None)
        self.refusals[name, getattr(reason, "value", str(reason))] += 1

    async def _expirer(self) -> None:
        while True:
            await trio.sleep(self.config.expire_interval)
            removed = self.threads.expire(trio.current_time())
            if removed:
                log.debug("expired %d idle threads", len(removed))

    # -- endpoints ---------------------------------------------------------------------

    def open_endpoint(
        self,
        name: str | None = None,
        *,
        buffer: int | None = None,
        buffer_bytes: int | None = None,
        allowed: Iterable[str] | None = None,
        sink: Sink | None = None,
        on_chain_end: Callable[[], None] | None = None,
    ) -> Endpoint:
        """Attach an external party. ``name`` must not be a listener's or another
        endpoint's; by default a unique ``client-…`` name is generated. Its outgoing buffer
        holds ``buffer`` messages and ``buffer_bytes`` bytes (the config's by default).
        ``sink`` and ``on_chain_end`` are its owner's hooks (see :class:`Endpoint`), kept
        until :meth:`Endpoint.release`. Synchronous; raises ConfigurationError for a bad
        or taken name."""
        if name is None:
            name = "client-" + new_thread_id()[:8]
            while name in self._endpoints:
                name = "client-" + new_thread_id()[:8]
        if not NAME_RE.match(name) or name in RESERVED_NAMES:
            raise ConfigurationError(f"endpoint name {name!r}: use 1-64 of [a-z0-9_-]")
        if name in self._endpoints or any(lst.name == name for lst in self._listeners):
            raise ConfigurationError(f"endpoint name {name!r} is taken")
        endpoint = Endpoint(
            self,
            name,
            buffer or self.config.endpoint_buffer,
            frozenset(allowed) if allowed is not None else None,
            buffer_bytes or self.config.endpoint_buffer_bytes,
            quota=ThreadQuota(self.config.max_threads_per_endpoint),
            sink=sink,
            on_chain_end=on_chain_end,
        )
        self._endpoints[name] = endpoint
        return endpoint

    def detach_endpoint(self, endpoint: Endpoint) -> None:
        """Forget a closed endpoint: its name is free again and its threads are dropped.
        Called by :meth:`Endpoint.close`; idempotent."""
        if self._endpoints.get(endpoint.name) is endpoint:
            del self._endpoints[endpoint.name]
            self.threads.remove_owned_by(endpoint.name)

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
        if self._state is not PumpState.RUNNING:
            raise PumpClosed(self._state.value)
        self.counters["injected"] += 1
        root = None
        try:
            root = self._codec.parse_root(data)
            inbound = self._codec.decode(root)
        except InputRefused as refusal:
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
        now = self._now
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
            self._answer_endpoint(endpoint, thread.id, refusal, data)
            return
        payload = inbound_payload
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
                record.last_active = self._now
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
            return self._inject_sync_traced(rt, endpoint, thread_id, payload, ptype, data, meta)
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
                rt, endpoint, thread_id, meta[0], payload, ptype, data, exc, raised=True
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
        span = self._tracer.start_handle(rt.listener.name, None, endpoint.name, meta[0], True)
        token = attach(span)
        raised = False
        try:
            started = time.perf_counter()
            result = rt.sync(payload, meta)
            rt.latency.observe(time.perf_counter() - started, 1)  # a span reads clocks anyway
        except Exception as exc:
            record_error(span, type(exc).__name__)
            result, raised = exc, True
        finally:
            detach(token)
        if raised:
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
            rt, endpoint, thread_id, meta[0], payload, ptype, data, result, raised=raised, span=span
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
        raised: bool = False,
        span: object = None,
    ) -> None:
        """A fast-path call that did not simply answer: open its conversation and hop (with
        the ids its handler saw) and finish it as a worker would have."""
        listener = rt.listener
        now = self._now
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
            if raised and isinstance(result, Refusal):
                log.info("%s: refused on %s: %s", listener.name, child.dotted, result)
                await self._fail(child, result, d)
            elif raised:
                self.counters["handler_errors"] += 1
                log.error("%s: handler raised on %s", listener.name, child.dotted, exc_info=result)
                reason = f"{listener.name}: handler raised {type(result).__name__}: {result}"
                await self._fail(child, InputRefused(HuhReason.HANDLER_FAILED, reason), d)
            elif type(result) is HandlerResponse and type(result.payload) is etree._Element:
                await self._emit(listener, child, result, result.payload)
            else:
                await self._apply(listener, child, result, d)
        finally:
            child.pending -= 1
            self._done()
            if span is not None:
                detach(token)
                span.end()
        if not (child.children or child.pins or child.pending):
            self._settle(child)

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
            thread_id = None
        elif not is_uuid4(thread_id):
            thread_id = None
        return threads.open_root(
            endpoint.chain, now, thread_id, quota=endpoint.quota, transient=True
        )

    def _answer_endpoint(
        self, endpoint: Endpoint, thread_id: str, refusal: Refusal, original: bytes
    ) -> None:
        self._count_refusal(endpoint.name, refusal)
        log.info("refused message from %s: %s", endpoint.name, refusal)
        endpoint.push(encode(SYSTEM, endpoint.name, thread_id, self._primitive(refusal, original)))

    async def inject_system(self, payload: BaseXmlModel | etree._Element, to: str) -> None:
        """Deliver a pump-originated payload (e.g. the boot primitive) to listener ``to`` on
        the root thread. Core-namespace payloads are allowed here and only here."""
        if self._state is not PumpState.RUNNING:
            raise PumpClosed(self._state.value)
        element = to_element(payload)
        ptype = self.payloads.get(element.tag)
        if ptype is None or not ptype.schema.validate(element):
            raise ConfigurationError(f"system payload {element.tag} is not valid")
        if to not in self._runtimes or ptype.tag not in self._table.accepts[to]:
            raise ConfigurationError(f"listener {to!r} does not take {ptype.tag}")
        await self._enqueue(
            to, Delivery(element, ptype, self.root_thread, SYSTEM, False, None, None)
        )

    # -- answering later (agents) ------------------------------------------------------

    def hold(self, thread_id: str) -> ThreadRef:
        """Keep the hop ``thread_id`` alive past its handler and return a durable reference.

        For listeners that answer long after their handler returned (agents): the thread is
        pinned (no idle expiry, ``None`` does not end it) until it is answered with
        :meth:`answer` or released with :meth:`release`. The reference is JSON-able and can
        be stored; after a restart :meth:`revive` rebuilds the hop from it.
        """
        record = self.threads.get(thread_id)
        if record is None or record.parent is None:
            raise KeyError(f"no live hop thread {thread_id}")
        self.threads.pin(record)
        return ThreadRef(record.id, record.parent, record.chain)

    def release(self, thread_id: str) -> None:
        """Undo :meth:`hold` without answering: the hop ends once nothing else keeps it."""
        record = self.threads.get(thread_id)
        if record is not None:
            self.threads.unpin(record)
            self._settle(record)

    def end_hop(self, hop_id: str) -> bool:
        """End the hop ``hop_id`` as :meth:`answer` would, sending nothing: for a caller
        answered another way (a named client's reply, kept in the store until received).

        The hop and every thread below it are removed (with the caller's conversation,
        an endpoint's, if that leaves it empty) in one synchronous step: no checkpoint,
        so atomic for every other task of the pump. A pin from :meth:`hold` goes with
        the hop. False when no such hop is live; idempotent."""
        record = self.threads.get(hop_id)
        if record is None:
            return False
        self.threads.prune(record)
        return True

    def revive(self, ref: ThreadRef) -> ThreadRecord:
        """The live hop of ``ref``, rebuilt (with its caller's thread) if a restart lost it.

        The rebuilt hop is pinned, like one returned by :meth:`hold`.
        """
        record = self.threads.get(ref.hop)
        if record is not None:
            return record
        now = trio.current_time()
        parent = self.threads.get(ref.caller_thread)
        if parent is None:
            # A one-name chain is an external party's conversation: transient, as it was.
            parent = self.threads.open_root(
                ref.chain[:-1], now, thread_id=ref.caller_thread, transient=len(ref.chain) == 2
            )
        record = self.threads.extend(parent, ref.chain[-1], now, thread_id=ref.hop)
        self.threads.pin(record)
        return record

    async def call_from(
        self,
        sender: str,
        ref: ThreadRef,
        payload: BaseXmlModel | etree._Element,
        to: str | None,
        *,
        key: str | None = None,
    ) -> str:
        """Forward ``payload`` from ``sender`` outside a handler (an agent's tool call).

        Same rules as a handler's forward (validated; the target must be a peer and take the
        tag; exactly one target). Returns the new sub-thread id, on which the peer's answer
        (or a failure primitive) will reach ``sender`` with ``response_thread`` set to it.
        ``key``: the call's idempotency key, handed to the peer's handler
        (``HandlerMetadata.idempotency_key``; None: the new sub-thread's id).
        Raises :class:`Refusal` at once if the pump refuses; nothing is sent then.
        """
        if self._state is not PumpState.RUNNING:
            raise PumpClosed(self._state.value)
        element, ptype, target = self._checked_call(sender, payload, to)
        hop = self.revive(ref)
        try:
            child = self.threads.extend(hop, target, trio.current_time())
        except RegistryFull:
            raise DeliveryRefused(SystemErrorCode.ROUTING, retry_allowed=True) from None
        try:
            await self._enqueue(
                target, Delivery(element, ptype, child, sender, False, None, None, None, key)
            )
        except DeliveryRefused:
            self.threads.prune(child)
            raise
        return child.id

    def check_call(
        self, sender: str, payload: BaseXmlModel | etree._Element, to: str | None
    ) -> None:
        """Check a call of ``sender`` as :meth:`call_from` would (valid payload, exactly
        one peer that takes it), sending nothing: a replay's recorded tools. Raises
        :class:`Refusal`."""
        self._checked_call(sender, payload, to)

    def _checked_call(
        self, sender: str, payload: BaseXmlModel | etree._Element, to: str | None
    ) -> tuple[etree._Element, PayloadType, str]:
        """(element, payload type, the one target) of a call, or a :class:`Refusal`."""
        element = to_element(payload)
        ptype = self._codec.validate_payload(element)
        decision = self._table.outbound(sender, ptype.tag, to)
        if isinstance(decision, SelfCall) or len(decision.targets) != 1:
            raise DeliveryRefused(
                SystemErrorCode.ROUTING, retry_allowed=True, detail="a call needs exactly one peer"
            )
        return element, ptype, decision.targets[0]

    def check_self_call(self, sender: str, payload: BaseXmlModel | etree._Element) -> None:
        """Validate a self-iteration payload of ``sender`` without delivering it (an agent
        continues its Turn itself). Raises :class:`Refusal` as a delivery would."""
        element = to_element(payload)
        ptype = self._codec.validate_payload(element)
        if not isinstance(self._table.outbound(sender, ptype.tag, sender), SelfCall):
            raise InputRefused(HuhReason.INVALID_PAYLOAD, f"{ptype.tag} is not {sender}'s own")
        self.counters["self_calls"] += 1
        log.debug("%s: self-call %s", sender, ptype.local)

    async def answer(
        self, sender: str, ref: ThreadRef, payload: BaseXmlModel | etree._Element
    ) -> bool:
        """Respond to the caller of ``ref`` on its thread, as ``HandlerResponse.respond``
        would from the hop's handler. The hop and every thread below it end.

        Returns False if nobody was there to receive it (e.g. an anonymous client that has
        gone); raises :class:`Refusal` if the payload is not valid.
        """
        element = to_element(payload)
        ptype = self._codec.validate_payload(element)
        hop = self.revive(ref)
        parent = self.threads.prune(hop)
        if parent is None:
            return False
        owner = parent.owner
        if owner not in self._runtimes and owner not in self._endpoints:
            self.counters["dropped"] += 1
            return False
        await self._deliver_to_owner(parent, element, ptype, sender, hop.id)
        return True

    def is_connected(self, name: str) -> bool:
        """True if ``name`` is a listener or an attached endpoint."""
        return name in self._runtimes or name in self._endpoints

    # -- delivery ------------------------------------------------------------------------

    async def _enqueue(self, target: str, delivery: Delivery) -> None:
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
        if self._state is PumpState.CLOSED:  # no monitor left to end a wait
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

    async def _deliver_to_owner(
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
            await self._enqueue(
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

    async def _worker(self, rt: ListenerRuntime) -> None:
        """One concurrency slot of a listener. A handler that overruns its timeout is
        cancelled by :meth:`_deadline_monitor` through this slot's cancel scope; the slot
        then answers the caller with a timeout and starts over in a fresh scope. (A cancel
        scope per call would cost more than the rest of a delivery.)"""
        slot = Slot(rt.listener.name)
        current_slot.set(slot)  # this task's log records name the delivery it handles
        while True:
            with trio.CancelScope() as scope:
                slot.scope = scope
                rt.slots.append(slot)
                try:
                    await self._serve(rt, slot)
                finally:
                    rt.slots.remove(slot)
                return
            expired, slot.expired = slot.expired, None
            if expired is not None:
                self.counters["timeouts"] += 1
                log.warning(
                    "%s: handler timed out after %ss on %s",
                    rt.listener.name,
                    rt.listener.timeout,
                    expired.thread.dotted,
                )
                await self._fail(
                    expired.thread,
                    DeliveryRefused(SystemErrorCode.TIMEOUT, retry_allowed=True),
                    expired,
                )

    async def _serve(self, rt: ListenerRuntime, slot: Slot) -> None:
        """Take deliveries off the listener's queue and run the handler on each.

        The whole of a delivery runs inline here (no coroutine per step): this loop is the
        pump's hot path. Nothing reads the clock per message (see
        :meth:`_deadline_monitor`): a handler's duration, for the metrics, is measured for
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
        span = token = None
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
                thread.last_active = self._now
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
                    payload = d.payload if raw else d.ptype.model.from_xml_tree(d.payload)
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
                    await self._fail(thread, refusal, d)
                    continue
                except Exception as exc:
                    if span is not None:
                        record_error(span, type(exc).__name__)
                    counters["handler_errors"] += 1
                    log.exception("%s: handler raised on %s", listener.name, thread.dotted)
                    reason = f"{listener.name}: handler raised {type(exc).__name__}: {exc}"
                    await self._fail(thread, InputRefused(HuhReason.HANDLER_FAILED, reason), d)
                    continue
                if type(result) is HandlerResponse and type(result.payload) is etree._Element:
                    if result.is_response and self._answer_client(listener, thread, result):
                        continue
                    await self._emit(listener, thread, result, result.payload)
                else:
                    await self._apply(listener, thread, result, d)
            finally:
                thread.pending -= 1
                rt.handled += 1
                self._done()
                if span is not None:
                    detach(token)
                    span.end()
                    span = None
            if not (thread.children or thread.pins or thread.pending):
                # Nothing can reach this thread any more (it answered, or its chain ended).
                self._settle(thread)

    async def _deadline_monitor(self) -> None:
        """Keep the pump's coarse clock and cancel handlers that overrun their timeout.

        Every ``tick`` it records the time (hot paths stamp threads with it instead of
        reading the clock per message) and looks at each busy slot: a call seen for the
        first time gets its deadline, ``now + timeout``; a call past its deadline is
        cancelled. So a handler is cancelled after at least ``timeout`` and at most
        ``timeout + 2 * tick`` seconds, never early.
        """
        timeouts = [rt.listener.timeout for rt in self._runtimes.values()]
        tick = min(max(min(timeouts, default=1.0) / 10, 0.005), 1.0)
        tick = min(tick, max(self.config.delivery_timeout / 10, 0.005))
        runtimes = list(self._runtimes.values())
        while True:
            await trio.sleep(tick)
            now = self._now = trio.current_time()
            for rt in runtimes:
                if rt.waiters:
                    rt.waiters.expire(now)
                timeout = rt.listener.timeout
                for slot in rt.slots:
                    if slot.current is None:
                        continue
                    if slot.deadline == math.inf:
                        slot.deadline = now + timeout
                    elif slot.deadline <= now:
                        slot.expired = slot.current
                        slot.current = None
                        slot.scope.cancel()

    def _answer_client(
        self, listener: Listener, thread: ThreadRecord, item: HandlerResponse
    ) -> bool:
        """The hot case of :meth:`_emit`, without a coroutine: a valid response whose
        caller is an endpoint. Returns False, having changed nothing, in any other case
        (then :meth:`_emit` handles it, refusals included)."""
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
        element = item.payload
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
            await self._fail(thread, InputRefused(HuhReason.HANDLER_FAILED, reason), d)
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
                await self._fail(thread, InputRefused(HuhReason.HANDLER_FAILED, reason), d)
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
                await self._deliver_to_owner(parent, element, ptype, listener.name, thread.id)
                return
            decision = self._table.outbound(listener.name, ptype.tag, item.to)
            now = self._now
            if isinstance(decision, SelfCall):
                await self._enqueue(
                    listener.name,
                    Delivery(element, ptype, thread, listener.name, True, None, None),
                )
            else:
                for i, target in enumerate(decision.targets):
                    payload = element if i == 0 else copy.deepcopy(element)
                    child = self.threads.extend(thread, target, now)
                    try:
                        await self._enqueue(
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

    async def _bounce(
        self, listener: Listener, thread: ThreadRecord, refusal: Refusal, element: etree._Element
    ) -> None:
        """Return a refused output to its sender, on the sender's thread."""
        self._count_refusal(listener.name, refusal)
        log.info("%s: output refused on %s: %s", listener.name, thread.dotted, refusal)
        if self.threads.get(thread.id) is not thread:
            return
        thread.strikes += 1
        if thread.strikes > MAX_STRIKES:
            # The caller never sees the refused output: it is the listener's, not its own.
            reason = f"{listener.name}: {MAX_STRIKES} outputs refused in a row, the last: {refusal}"
            await self._fail(thread, InputRefused(HuhReason.HANDLER_FAILED, reason), None)
            return
        primitive = self._primitive(refusal, canonical_or_empty(element))
        ptype = self.payloads.get(primitive.tag)
        try:
            await self._enqueue(
                listener.name, Delivery(primitive, ptype, thread, SYSTEM, False, None, None)
            )
        except DeliveryRefused:
            log.warning("%s: could not return a refusal (queue full)", listener.name)

    async def _fail(self, thread: ThreadRecord, refusal: Refusal, d: Delivery | None) -> None:
        """The owner of ``thread`` failed (on delivery ``d``, if known): its caller gets
        one primitive; the thread ends.

        A ``<huh>``'s ``original-attempt`` echoes only the caller's own message: ``d`` if
        the caller sent it, else nothing (a peer's answer or the owner's own output are
        none of the caller's business; for a client they may be internal data)."""
        parent = self.threads.prune(thread)
        if parent is None:
            return
        original = b""
        if d is not None and d.from_id == parent.owner and not d.is_self_call:
            original = d.original if d.original is not None else canonical_or_empty(d.payload)
        primitive = self._primitive(refusal, original)
        try:
            await self._deliver_to_owner(
                parent, primitive, self.payloads.get(primitive.tag), SYSTEM, thread.id
            )
        except DeliveryRefused:
            log.warning("could not deliver a failure notice to %s", parent.owner)

    async def _pass_up(self, listener: Listener, thread: ThreadRecord, d: Delivery) -> None:
        """``d`` is a primitive the handler cannot read (its annotation does not admit
        it): instead of crashing the handler, its caller gets the failure. A
        ``<SystemError>`` goes up as it is; a ``<huh>`` becomes the caller's own
        "could not be completed" (its original-attempt is the listener's output, none of
        the caller's business)."""
        log.warning(
            "%s: its handler does not take <%s> (annotate its payload parameter with %s to "
            "receive it), so its caller gets the failure on %s",
            listener.name,
            d.ptype.local,
            d.ptype.model.__name__,
            thread.dotted,
        )
        if d.ptype.model is SystemErrorPayload:
            parent = self.threads.prune(thread)
            if parent is not None:
                try:
                    await self._deliver_to_owner(parent, d.payload, d.ptype, SYSTEM, thread.id)
                except DeliveryRefused:
                    log.warning("could not deliver a failure notice to %s", parent.owner)
            return
        reason = f"{listener.name}: its output was refused and its handler does not take <huh>"
        detail = d.payload.findtext(f"{{{CORE_NS}}}detail")
        if detail:
            reason += f" (the refusal: {detail})"
        await self._fail(thread, InputRefused(HuhReason.HANDLER_FAILED, reason), None)

    def _primitive(self, refusal: Refusal, original: bytes = b"") -> etree._Element:
        return primitive_for(refusal, original, explain=self.config.explain_refusals)

    def _settle(self, thread: ThreadRecord) -> None:
        """End ``thread`` if nothing can reach it any more (see ``ThreadRegistry.finish``).
        If that ends an endpoint's request without an answer, tell the endpoint, so that
        a server frees the request's in-flight slot now."""
        top = self.threads.finish(thread)
        if top is not None and top.parent is not None and len(top.chain) == 2:
            endpoint = self._endpoints.get(top.chain[0])
            if endpoint is not None:
                endpoint.chain_ended()

    def _refuse_sync(self, thread: ThreadRecord, refusal: Refusal) -> None:
        """On cancellation: tell an external caller now (pushing to an endpoint never blocks)."""
        parent = self.threads.get(thread.parent) if thread.parent else None
        if parent is None:
            return
        endpoint = self._endpoints.get(parent.owner)
        if endpoint is not None:
            self._count_refusal(endpoint.name, refusal)
            endpoint.push(encode(SYSTEM, endpoint.name, parent.id, self._primitive(refusal)))

    def _refuse_leftovers(self) -> None:
        """After cancellation: refuse every delivery still queued, so none is lost silently."""
        refusal = DeliveryRefused(SystemErrorCode.TIMEOUT, retry_allowed=True, detail="shutdown")
        for rt in self._runtimes.values():
            while True:
                try:
                    d = rt.receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                self._inflight -= 1
                d.thread.pending -= 1
                if d.from_id in self._endpoints or d.thread.parent is not None:
                    self._refuse_sync(d.thread, refusal)


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
