"""Deliveries made outside a handler: answering later (agents) and the pump's own messages.

A listener that answers long after its handler returned (an agent) holds its hop
(:meth:`Later.hold`, a durable :class:`~agentserver.pump.threadref.ThreadRef`), calls
peers from it (:meth:`Later.call_from`) and answers on it (:meth:`Later.answer`), possibly
after a restart rebuilt the hop (:meth:`Later.revive`). :meth:`Later.inject_system` sends
a pump-originated payload (the boot primitive) on the root thread.

None of this is on the per-message path (one call per tool call or answer of an agent),
so it lives here, next to the pump rather than in it, and reaches the pump only through
:class:`LaterOwner`. The synchronous methods are atomic (no checkpoint); the coroutines
wait only for room in a listener's queue, bounded by ``PumpConfig.delivery_timeout``.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio
from lxml import etree
from pydantic_xml import BaseXmlModel

from agentserver.core.envelope import EnvelopeCodec
from agentserver.core.errors import (
    ConfigurationError,
    DeliveryRefused,
    HuhReason,
    InputRefused,
    PumpClosed,
    SystemErrorCode,
)
from agentserver.core.listener import to_element
from agentserver.core.payloads import PayloadRegistry, PayloadType
from agentserver.core.routing import SelfCall
from agentserver.core.threads import RegistryFull, ThreadRecord, ThreadRegistry
from agentserver.pump.delivery import SYSTEM, Delivery
from agentserver.pump.roster import Roster
from agentserver.pump.runtime import PumpState
from agentserver.pump.threadref import ThreadRef

log = logging.getLogger("agentserver.pump")


class LaterOwner(Protocol):
    """What answering later needs of the pump. The Pump satisfies it; it is declared here
    so that this module does not import the pump (which imports it)."""

    threads: ThreadRegistry
    counters: dict[str, int]
    payloads: PayloadRegistry
    state: PumpState
    root_thread: ThreadRecord | None

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

    def settle(self, thread: ThreadRecord) -> None:
        """End ``thread`` if nothing can reach it any more (see ``Pump.settle``)."""
        ...


class Later:
    """A pump's deliveries from outside its handlers (see the module docstring)."""

    def __init__(self, pump: LaterOwner, roster: Roster, codec: EnvelopeCodec) -> None:
        self.pump = pump
        self.roster = roster
        self.codec = codec

    def hold(self, thread_id: str) -> ThreadRef:
        """Keep the hop ``thread_id`` alive past its handler and return a durable reference.

        For listeners that answer long after their handler returned (agents): the thread is
        pinned (no idle expiry, ``None`` does not end it) until it is answered with
        :meth:`answer` or released with :meth:`release`. The reference is JSON-able and can
        be stored; after a restart :meth:`revive` rebuilds the hop from it.
        """
        threads = self.pump.threads
        record = threads.get(thread_id)
        if record is None or record.parent is None:
            raise KeyError(f"no live hop thread {thread_id}")
        threads.pin(record)
        return ThreadRef(record.id, record.parent, record.chain)

    def release(self, thread_id: str) -> None:
        """Undo :meth:`hold` without answering: the hop ends once nothing else keeps it."""
        record = self.pump.threads.get(thread_id)
        if record is not None:
            self.pump.threads.unpin(record)
            self.pump.settle(record)

    def end_hop(self, hop_id: str) -> bool:
        """End the hop ``hop_id`` as :meth:`answer` would, sending nothing: for a caller
        answered another way (a named client's reply, kept in the store until received).

        The hop and every thread below it are removed (with the caller's conversation,
        an endpoint's, if that leaves it empty) in one synchronous step: no checkpoint,
        so atomic for every other task of the pump. A pin from :meth:`hold` goes with
        the hop. False when no such hop is live; idempotent."""
        record = self.pump.threads.get(hop_id)
        if record is None:
            return False
        self.pump.threads.prune(record)
        return True

    def revive(self, ref: ThreadRef) -> ThreadRecord:
        """The live hop of ``ref``, rebuilt (with its caller's thread) if a restart lost it.

        The rebuilt hop is pinned, like one returned by :meth:`hold`.
        """
        threads = self.pump.threads
        record = threads.get(ref.hop)
        if record is not None:
            return record
        now = trio.current_time()
        parent = threads.get(ref.caller_thread)
        if parent is None:
            # A one-name chain is an external party's conversation: transient, as it was.
            parent = threads.open_root(
                ref.chain[:-1], now, thread_id=ref.caller_thread, transient=len(ref.chain) == 2
            )
        record = threads.extend(parent, ref.chain[-1], now, thread_id=ref.hop)
        threads.pin(record)
        return record

    async def call_from(
        self,
        sender: str,
        ref: ThreadRef,
        payload: BaseXmlModel | etree._Element,
        to: str | None,
        *,
        key: str | None = None,
        thread: str | None = None,
    ) -> str:
        """Forward ``payload`` from ``sender`` outside a handler (an agent's tool call).

        Same rules as a handler's forward (validated; the target must be a peer and take the
        tag; exactly one target). Returns the new sub-thread id, on which the peer's answer
        (or a failure primitive) will reach ``sender`` with ``response_thread`` set to it.
        ``key``: the call's idempotency key, handed to the peer's handler
        (``HandlerMetadata.idempotency_key``; None: the new sub-thread's id).
        ``thread``: the sub-thread's id, drawn by the caller before the call (an agent
        records its waiting set before it sends); None draws one. Reusing a live
        thread's id is refused (``ValueError``).
        Raises :class:`Refusal` at once if the pump refuses; nothing is sent then. If
        cancelled while waiting for room, nothing is queued.
        """
        pump = self.pump
        if pump.state is not PumpState.RUNNING:
            raise PumpClosed(pump.state.value)
        element, ptype, target = self.checked_call(sender, payload, to)
        hop = self.revive(ref)
        try:
            child = pump.threads.extend(hop, target, trio.current_time(), thread_id=thread)
        except RegistryFull:
            raise DeliveryRefused(SystemErrorCode.ROUTING, retry_allowed=True) from None
        try:
            await pump.enqueue(
                target, Delivery(element, ptype, child, sender, False, None, None, None, key)
            )
        except DeliveryRefused:
            pump.threads.prune(child)
            raise
        return child.id

    def check_call(
        self, sender: str, payload: BaseXmlModel | etree._Element, to: str | None
    ) -> None:
        """Check a call of ``sender`` as :meth:`call_from` would, sending nothing (a
        replay's recorded tools). Raises :class:`Refusal`."""
        self.checked_call(sender, payload, to)

    def checked_call(
        self, sender: str, payload: BaseXmlModel | etree._Element, to: str | None
    ) -> tuple[etree._Element, PayloadType, str]:
        """(element, payload type, the one target) of a call of ``sender`` as
        :meth:`call_from` would make it (valid payload, exactly one peer that takes it),
        sending nothing. Raises :class:`Refusal`."""
        element = to_element(payload)
        ptype = self.codec.validate_payload(element)
        decision = self.roster.routes.outbound(sender, ptype.tag, to)
        if isinstance(decision, SelfCall) or len(decision.targets) != 1:
            raise DeliveryRefused(
                SystemErrorCode.ROUTING, retry_allowed=True, detail="a call needs exactly one peer"
            )
        return element, ptype, decision.targets[0]

    def check_task(self, agent: str, payload: BaseXmlModel | etree._Element) -> None:
        """Validate ``payload`` as a task of ``agent`` (a valid payload of one of its own
        types) without delivering it. Raises :class:`Refusal`."""
        element = to_element(payload)
        ptype = self.codec.validate_payload(element)
        if not isinstance(self.roster.routes.outbound(agent, ptype.tag, agent), SelfCall):
            raise InputRefused(
                HuhReason.INVALID_PAYLOAD, f"{agent} does not take {ptype.tag} as a task"
            )

    def check_self_call(self, sender: str, payload: BaseXmlModel | etree._Element) -> None:
        """Validate a self-iteration payload of ``sender`` without delivering it (an agent
        continues its Turn itself). Raises :class:`Refusal` as a delivery would."""
        element = to_element(payload)
        ptype = self.codec.validate_payload(element)
        if not isinstance(self.roster.routes.outbound(sender, ptype.tag, sender), SelfCall):
            raise InputRefused(HuhReason.INVALID_PAYLOAD, f"{ptype.tag} is not {sender}'s own")
        self.pump.counters["self_calls"] += 1
        log.debug("%s: self-call %s", sender, ptype.local)

    async def answer(
        self, sender: str, ref: ThreadRef, payload: BaseXmlModel | etree._Element
    ) -> bool:
        """Respond to the caller of ``ref`` on its thread, as ``HandlerResponse.respond``
        would from the hop's handler. The hop and every thread below it end (before any
        wait: a cancelled answer has still ended them).

        Returns False if nobody was there to receive it (e.g. an anonymous client that has
        gone); raises :class:`Refusal` if the payload is not valid.
        """
        element = to_element(payload)
        ptype = self.codec.validate_payload(element)
        hop = self.revive(ref)
        parent = self.pump.threads.prune(hop)
        if parent is None:
            return False
        if not self.roster.is_connected(parent.owner):
            self.pump.counters["dropped"] += 1
            return False
        await self.pump.deliver_to_owner(parent, element, ptype, sender, hop.id)
        return True

    async def inject_system(self, payload: BaseXmlModel | etree._Element, to: str) -> None:
        """Deliver a pump-originated payload (e.g. the boot primitive) to listener ``to`` on
        the root thread. Core-namespace payloads are allowed here and only here. Waits for
        room in ``to``'s queue (bounded by the delivery timeout)."""
        pump = self.pump
        if pump.state is not PumpState.RUNNING:
            raise PumpClosed(pump.state.value)
        root = pump.root_thread
        if root is None:  # set before the pump is RUNNING
            raise PumpClosed(pump.state.value)
        element = to_element(payload)
        tag = element.tag  # not a str for a comment or a processing instruction
        ptype = pump.payloads.get(tag) if isinstance(tag, str) else None
        if ptype is None or not ptype.schema.validate(element):
            raise ConfigurationError(f"system payload {tag!s} is not valid")
        if to not in self.roster.runtimes or ptype.tag not in self.roster.routes.accepts[to]:
            raise ConfigurationError(f"listener {to!r} does not take {ptype.tag}")
        await pump.enqueue(to, Delivery(element, ptype, root, SYSTEM, False, None, None))
