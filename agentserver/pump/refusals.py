"""Refusals and failures: every ``<huh>`` and ``<SystemError>`` the pump owes a sender.

A part of :class:`~agentserver.pump.pump.Pump` (composed in, its methods bound onto the
pump under their old names): the paths taken when something is refused or fails (an
endpoint's message refused, a listener's output bounced back to it, a handler's failure
passed to its caller, a cancelled request answered at once). None of them is on the
path of a message that succeeds, so they live apart from the hot path; each call is as
cheap as before (a bound method read from the pump's instance attributes).
"""

from __future__ import annotations

import collections
import logging
from typing import Protocol

from lxml import etree

from agentserver.core.envelope import encode
from agentserver.core.errors import DeliveryRefused, HuhReason, InputRefused, Refusal
from agentserver.core.listener import Listener
from agentserver.core.namespaces import CORE_NS
from agentserver.core.payloads import PayloadRegistry, PayloadType
from agentserver.core.threads import ThreadRecord, ThreadRegistry
from agentserver.core.xmlsafe import canonical_or_empty, tag_of
from agentserver.primitives.core import SystemErrorPayload, primitive_for
from agentserver.pump.config import PumpConfig
from agentserver.pump.delivery import SYSTEM, Delivery
from agentserver.pump.endpoint import Endpoint

log = logging.getLogger("agentserver.pump")

#: After this many consecutive refused outputs on one thread, the owner's caller gets a
#: ``<huh>`` instead of the owner getting yet another one (stops refusal ping-pong).
MAX_STRIKES = 3


class RefusalOwner(Protocol):
    """What refusing needs of the pump. The Pump satisfies it; declared here so that this
    module does not import the pump (which imports it)."""

    config: PumpConfig
    threads: ThreadRegistry
    counters: dict[str, int]
    payloads: PayloadRegistry

    @property
    def refusals(self) -> collections.Counter[tuple[str, str]]: ...

    async def enqueue(self, target: str, delivery: Delivery) -> None:
        """Queue for a listener, waiting for room (see ``Pump.enqueue``)."""
        ...

    async def deliver_to_owner(
        self,
        record: ThreadRecord,
        payload: etree._Element,
        ptype: PayloadType,
        from_id: str,
        response_thread: str | None,
    ) -> None:
        """Hand a payload to whoever works on ``record`` (see ``Pump.deliver_to_owner``)."""
        ...


class Refusals:
    """The pump's refusal and failure paths (see the module docstring)."""

    def __init__(self, pump: RefusalOwner, endpoints: dict[str, Endpoint]) -> None:
        self.pump = pump
        #: The roster's endpoints by name (the same dict the pump reads).
        self.endpoints = endpoints

    def count(self, name: str, refusal: Refusal) -> None:
        self.pump.counters["refused"] += 1
        reason = getattr(refusal, "reason", None) or getattr(refusal, "code", None)
        self.pump.refusals[name, getattr(reason, "value", str(reason))] += 1

    def answer_endpoint(
        self, endpoint: Endpoint, thread_id: str, refusal: Refusal, original: bytes
    ) -> None:
        self.count(endpoint.name, refusal)
        log.info("refused message from %s: %s", endpoint.name, refusal)
        endpoint.push(encode(SYSTEM, endpoint.name, thread_id, self.primitive(refusal, original)))

    async def bounce(
        self, listener: Listener, thread: ThreadRecord, refusal: Refusal, element: etree._Element
    ) -> None:
        """Return a refused output to its sender, on the sender's thread."""
        self.count(listener.name, refusal)
        log.info("%s: output refused on %s: %s", listener.name, thread.dotted, refusal)
        if self.pump.threads.get(thread.id) is not thread:
            return
        thread.strikes += 1
        if thread.strikes > MAX_STRIKES:
            # The caller never sees the refused output: it is the listener's, not its own.
            reason = f"{listener.name}: {MAX_STRIKES} outputs refused in a row, the last: {refusal}"
            await self.fail(thread, InputRefused(HuhReason.HANDLER_FAILED, reason), None)
            return
        primitive = self.primitive(refusal, canonical_or_empty(element))
        ptype = self.primitive_type(primitive)
        try:
            await self.pump.enqueue(
                listener.name, Delivery(primitive, ptype, thread, SYSTEM, False, None, None)
            )
        except DeliveryRefused:
            log.warning("%s: could not return a refusal (queue full)", listener.name)

    async def fail(self, thread: ThreadRecord, refusal: Refusal, d: Delivery | None) -> None:
        """The owner of ``thread`` failed (on delivery ``d``, if known): its caller gets
        one primitive; the thread ends.

        A ``<huh>``'s ``original-attempt`` echoes only the caller's own message: ``d`` if
        the caller sent it, else nothing (a peer's answer or the owner's own output are
        none of the caller's business; for a client they may be internal data)."""
        parent = self.pump.threads.prune(thread)
        if parent is None:
            return
        original = b""
        if d is not None and d.from_id == parent.owner and not d.is_self_call:
            original = d.original if d.original is not None else canonical_or_empty(d.payload)
        primitive = self.primitive(refusal, original)
        try:
            await self.pump.deliver_to_owner(
                parent, primitive, self.primitive_type(primitive), SYSTEM, thread.id
            )
        except DeliveryRefused:
            log.warning("could not deliver a failure notice to %s", parent.owner)

    async def pass_up(self, listener: Listener, thread: ThreadRecord, d: Delivery) -> None:
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
            parent = self.pump.threads.prune(thread)
            if parent is not None:
                try:
                    await self.pump.deliver_to_owner(parent, d.payload, d.ptype, SYSTEM, thread.id)
                except DeliveryRefused:
                    log.warning("could not deliver a failure notice to %s", parent.owner)
            return
        reason = f"{listener.name}: its output was refused and its handler does not take <huh>"
        detail = d.payload.findtext(f"{{{CORE_NS}}}detail")
        if detail:
            reason += f" (the refusal: {detail})"
        await self.fail(thread, InputRefused(HuhReason.HANDLER_FAILED, reason), None)

    def primitive(self, refusal: Refusal, original: bytes = b"") -> etree._Element:
        return primitive_for(refusal, original, explain=self.pump.config.explain_refusals)

    def primitive_type(self, primitive: etree._Element) -> PayloadType:
        """The payload type of a primitive :meth:`primitive` built: registered, as every
        core model is, when the pump was made (CORE_MODELS)."""
        ptype = self.pump.payloads.get(tag_of(primitive))
        if ptype is None:
            raise LookupError(f"primitive {tag_of(primitive)} is not a registered payload type")
        return ptype

    def refuse_sync(self, thread: ThreadRecord, refusal: Refusal) -> None:
        """On cancellation: tell an external caller now (pushing to an endpoint never blocks)."""
        parent = self.pump.threads.get(thread.parent) if thread.parent else None
        if parent is None:
            return
        endpoint = self.endpoints.get(parent.owner)
        if endpoint is not None:
            self.count(endpoint.name, refusal)
            endpoint.push(encode(SYSTEM, endpoint.name, parent.id, self.primitive(refusal)))
