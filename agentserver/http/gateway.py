"""Messages over HTTP into the pump: one endpoint per message, as a socket connection has
one per connection, so the pump validates, routes and refuses them exactly as it does
socket frames (same ``max-message-bytes``, same canned ``<huh>`` texts, same
``may-address``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio
from lxml import etree

from agentserver.core.envelope import MULTITASK, build_envelope
from agentserver.core.errors import (
    ConfigurationError,
    DeliveryRefused,
    EndpointClosed,
    HuhReason,
    InputRefused,
    PumpClosed,
    Refusal,
    SystemErrorCode,
)
from agentserver.core.handshake import Identity
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser
from agentserver.http.replies import Exchange, PendingThreads, ThreadView
from agentserver.pump.endpoint import Endpoint, Sink
from agentserver.pump.pump import Pump

log = logging.getLogger("agentserver.http")

#: Refused when max-pending messages already wait (the socket's "server busy").
BUSY = DeliveryRefused(SystemErrorCode.ROUTING, retry_allowed=True, detail="http busy")


class GatewayLimits(Protocol):
    """The connection limits the gateway applies, as the socket does (boot.xml
    ``<limits>``: :class:`agentserver.net.limits.Limits` is one)."""

    @property
    def max_message_bytes(self) -> int: ...
    @property
    def outgoing_buffer(self) -> int: ...
    @property
    def outgoing_buffer_bytes(self) -> int: ...


class Deciders(Protocol):
    """Who the gateway's endpoints speak for when they decide an approval
    (:class:`agentserver.agents.edge.bridge.PumpPorts` is one): an authenticated client's
    decision sent over HTTP is that client's, as on its socket connection."""

    def speak_for(self, endpoint: str, identity: str) -> None: ...
    def forget_endpoint(self, endpoint: str) -> None: ...


class GatewaySettings(Protocol):
    """The HTTP API's own bounds (boot.xml ``<http>``:
    :class:`agentserver.config.topology.HttpSpec` is one)."""

    @property
    def max_pending(self) -> int: ...
    @property
    def reply_ttl(self) -> float: ...
    @property
    def max_replies(self) -> int: ...
    @property
    def wait_timeout(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one message: ``kind`` is reply (``reply`` holds the envelope),
    accepted (kept for ``GET /v1/threads``), unanswered (its request ended without a
    reply), timeout (no reply within wait-timeout: kept like an accepted one), or refused
    (``refusal``: it never reached the pump)."""

    kind: str
    thread: str = ""
    reply: bytes = b""
    refusal: Refusal | None = None


class HttpGateway:
    """Sends messages for HTTP callers and keeps the replies of ``?wait=false`` ones."""

    def __init__(
        self,
        pump: Pump,
        limits: GatewayLimits,
        spec: GatewaySettings,
        deciders: Deciders | None = None,
    ) -> None:
        self.pump = pump
        self.deciders = deciders
        self.limits = limits
        self.spec = spec
        self._parser = SafeParser(limits.max_message_bytes)
        self.pending = PendingThreads(spec.max_pending, spec.reply_ttl)
        #: Messages holding an endpoint now (waiting ones and kept ones).
        self.active = 0
        self.counters = {"messages": 0, "refused": 0, "busy": 0, "timeouts": 0, "expired": 0}

    @property
    def max_bytes(self) -> int:
        return self.limits.max_message_bytes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Forget kept threads whose time is up (closing their endpoints), until cancelled."""
        interval = max(0.05, min(self.spec.reply_ttl / 4, 5.0))
        task_status.started()
        try:
            while True:
                await trio.sleep(interval)
                now = trio.current_time()
                self.pending.touch(now)
                for exchange in self.pending.expire(now):
                    self.counters["expired"] += 1
                    self._release(exchange)
        finally:
            for exchange in self.pending.clear():
                self._release(exchange)

    def thread(
        self, thread: str, owner: str | None, *, any_owner: bool = False
    ) -> ThreadView | None:
        """The replies kept for ``thread`` if ``owner`` sent it (whoever did, with
        ``any_owner``)."""
        return self.pending.view(thread, owner, trio.current_time(), any_owner=any_owner)

    async def send(
        self,
        identity: Identity,
        to: str | None,
        body: bytes,
        *,
        wait: bool,
        thread: str | None = None,
        multitask: str | None = None,
    ) -> Outcome:
        """Send ``body`` (one XML payload) to ``to`` as ``identity``, on ``thread`` (a
        uuid4 the caller chose) or a new thread; ``multitask``: the task's double-texting
        mode for an agent (docs/runs.md; a named client's only: an anonymous message is
        a conversation of its own)."""
        self.counters["messages"] += 1
        if self.active >= self.spec.max_pending or (not wait and self.pending.full):
            self.counters["busy"] += 1
            return Outcome("refused", refusal=BUSY)
        try:
            payload = self._parser.parse(body)
        except InputRefused as refusal:
            self.counters["refused"] += 1
            return Outcome("refused", refusal=refusal)
        thread = thread or new_thread_id()
        try:
            exchange = Exchange(
                thread,
                identity.name,
                lambda sink, on_chain_end: self._open_endpoint(identity, sink, on_chain_end),
                self.spec.max_replies,
            )
        except PumpClosed:
            return Outcome("refused", refusal=BUSY)
        endpoint = exchange.endpoint
        self.active += 1
        kept = False
        try:
            try:
                envelope = build_envelope(endpoint.name, to, thread, payload)
                if multitask is not None:
                    # As a socket client's envelope carries it: one way to the agent's intake.
                    envelope.set(MULTITASK, multitask)
            except ValueError:  # a ``to`` that XML cannot carry (control characters)
                self.counters["refused"] += 1
                return Outcome("refused", refusal=InputRefused(HuhReason.INVALID_ENVELOPE))
            try:
                await endpoint.send(etree.tostring(envelope))
            except (PumpClosed, EndpointClosed):
                return Outcome("refused", refusal=BUSY)
            if not wait:
                self._keep(exchange)
                kept = True
                return Outcome("accepted", thread)
            with trio.move_on_after(self.spec.wait_timeout):
                await exchange.wait_settled()
            if exchange.replies:
                return Outcome("reply", thread, reply=exchange.replies[0])
            if exchange.unanswered:
                return Outcome("unanswered", thread)
            # Still running: its replies are kept for GET /v1/threads/{id}, if there is room.
            self.counters["timeouts"] += 1
            if not self.pending.full:
                self._keep(exchange)
                kept = True
            return Outcome("timeout", thread)
        finally:
            if not kept:
                self._release(exchange)

    def _keep(self, exchange: Exchange) -> None:
        replaced = self.pending.keep(exchange, trio.current_time())
        if replaced is not None and replaced is not exchange:
            self._release(replaced)

    def _release(self, exchange: Exchange) -> None:
        self.active -= 1
        if self.deciders is not None and exchange.owner is not None:
            self.deciders.forget_endpoint(exchange.endpoint.name)
        exchange.endpoint.release()

    def _open_endpoint(
        self,
        identity: Identity,
        sink: Sink,
        on_chain_end: Callable[[], None],
    ) -> Endpoint:
        pump = self.pump
        if not pump.running:
            raise PumpClosed("not running")
        open_endpoint = functools.partial(
            pump.open_endpoint,
            buffer=self.limits.outgoing_buffer,
            buffer_bytes=self.limits.outgoing_buffer_bytes,
            sink=sink,
            on_chain_end=on_chain_end,
        )
        if identity.name is None:
            return open_endpoint(None)
        # Always suffixed: an HTTP message of a named client is answered on its own
        # endpoint (like a second socket connection of that client), never handed to the
        # client's socket connections.
        for _ in range(8):
            name = f"{identity.name[:55]}-{new_thread_id()[:8]}"
            try:
                endpoint = open_endpoint(name, allowed=identity.allowed)
            except ConfigurationError:
                continue
            if self.deciders is not None:
                self.deciders.speak_for(endpoint.name, identity.name)
            return endpoint
        raise PumpClosed("no endpoint name")
