"""The agents' ports implemented on the pump, and the pump handler of an agent listener.

An agent listener's handler does only intake: a task becomes an Enqueue (the hop thread is
held open and its durable reference stored with the inbox row), and anything that arrives
on the sub-thread of an earlier tool call becomes a tool result. Everything else happens in
the worker, which talks back to the pump through :class:`PumpPorts`.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable

from lxml import etree

from agentserver.agents.edge.named_clients import NamedClientReplies
from agentserver.agents.errors import CallerElsewhere, PumpRefused
from agentserver.agents.governance.approvals import (
    DECISION_TAG,
    ApprovalAck,
    ApprovalDecision,
    PendingApproval,
)
from agentserver.agents.ports import PROCESS_KEY, ReplyRef, reply_ref_from_json
from agentserver.agents.runtime import AgentRuntime
from agentserver.agents.store.base import AgentStore, TurnToken
from agentserver.agents.store.sql import governance, replies, turns, views
from agentserver.agents.turn.answer import FAILED, STATUS_ATTR
from agentserver.agents.turn.memory import SPEAKS_FOR
from agentserver.agents.turn.scheduler import SCHEDULE_KEY
from agentserver.core.access import AccessRule
from agentserver.core.envelope import encode, envelope_multitask
from agentserver.core.errors import Refusal
from agentserver.core.listener import Handler, HandlerMetadata, HandlerResponse, HandlerResult
from agentserver.core.namespaces import CORE_NS
from agentserver.core.payloads import model_from_tree
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import canonical_or_empty
from agentserver.primitives.core import primitive_for
from agentserver.pump.pump import Pump, ThreadRef

log = logging.getLogger(__name__)

_CORE = f"{{{CORE_NS}}}"
#: How many recently delivered Turn ids are remembered to drop duplicate deliveries.
_DEDUP_WINDOW = 4096


def _refused(refusal: Refusal, payload: etree._Element) -> PumpRefused:
    return PumpRefused(primitive_for(refusal, canonical_or_empty(payload)), str(refusal))


def thread_reply_ref(ref: ThreadRef) -> ReplyRef:
    """The reply reference of a held hop: its thread keys, as :meth:`ThreadRef.to_json`
    writes them (the bridge reads them back with :meth:`ThreadRef.from_json`)."""
    return ReplyRef(hop=ref.hop, caller_thread=ref.caller_thread, chain=list(ref.chain))


class PumpPorts:
    """:class:`~agentserver.agents.ports.ToolPort` and ``ReplyPort`` over a running pump.

    ``named_clients`` are the client identities declared in boot.xml: a reply for one is
    kept in the store until received and offered to a live connection of that identity
    (:attr:`clients`, see :mod:`agentserver.agents.edge.named_clients`), whichever of its
    connections sent the task. A reply for an anonymous client that has gone is recorded in
    the store only (its deliverable card). Without a ``store`` (a test's ports) replies
    are only sent and approval requests wait.
    """

    def __init__(
        self,
        pump: Pump,
        *,
        store: AgentStore | None = None,
        named_clients: Iterable[str] = (),
        operators: Iterable[str] = (),
        access: AccessRule | None = None,
    ) -> None:
        self.pump = pump
        self.named_clients = frozenset(named_clients)
        self.store = store
        #: The named clients' connections (None without a store).
        self.clients = NamedClientReplies(store, self.named_clients) if store is not None else None
        self._delivered: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: Listeners whose approval decisions are the operator's (console routers).
        self.operators = frozenset(operators)
        #: Endpoint name -> the named client it speaks for when it decides an approval:
        #: the HTTP API's per-message endpoints of an authenticated client (its replies
        #: still go to that endpoint, so this is not :attr:`clients`' identity map).
        self._deciders: dict[str, str] = {}
        #: The authorization rule (agentserver/core/access.py): a client that is not an
        #: approval request's approver learns nothing of it (None: no rule, a test's).
        self.access = access

    def speak_for(self, endpoint: str, identity: str) -> None:
        """Endpoint ``endpoint`` was opened for authenticated client ``identity``: an
        approval decision it sends is ``identity``'s. Until :meth:`forget_endpoint`."""
        self._deciders[endpoint] = identity

    def forget_endpoint(self, endpoint: str) -> None:
        self._deciders.pop(endpoint, None)

    def decider(self, endpoint: str) -> str:
        """Who decides an approval sent from ``endpoint``: the named client behind it
        (a connection's, or an HTTP message's), else the endpoint's own name."""
        found = self._deciders.get(endpoint)
        if found is None and self.clients is not None:
            found = self.clients.identity_of(endpoint)
        return found or endpoint

    def reply_ref(self, ref: ThreadRef) -> ReplyRef:
        """The durable reference of a task's hop; it names the client identity when the
        caller is a connection of a named client (a second connection's endpoint is not
        named after it), so the answer still finds her after the connection ends."""
        data = thread_reply_ref(ref)
        identity = self.clients.identity_of(ref.caller) if self.clients is not None else None
        if identity is not None:
            data["client"] = identity
        elif self._deciders and (speaks := self._deciders.get(ref.caller)) is not None:
            # An authenticated HTTP message: answered on its own endpoint, but its
            # conversation (memory="client") is its client's, as on her socket.
            data[SPEAKS_FOR] = speaks
        return data

    # -- ToolPort -------------------------------------------------------------------------

    async def call(
        self,
        agent: str,
        turn_thread: ReplyRef,
        payload: etree._Element,
        to: str | None,
        *,
        key: str | None = None,
        thread: str | None = None,
    ) -> str:
        try:
            return await self.pump.call_from(
                agent, ThreadRef.from_json(turn_thread), payload, to, key=key, thread=thread
            )
        except Refusal as refusal:
            raise _refused(refusal, payload) from None

    def check_call(self, agent: str, payload: etree._Element, to: str | None) -> None:
        """Check a call as :meth:`call` would send it, sending nothing (a replay).
        Raises PumpRefused."""
        try:
            self.pump.check_call(agent, payload, to)
        except Refusal as refusal:
            raise _refused(refusal, payload) from None

    def check_task(self, agent: str, payload: etree._Element) -> None:
        try:
            self.pump.check_task(agent, payload)
        except Refusal as refusal:
            raise _refused(refusal, payload) from None

    async def self_iterate(
        self, agent: str, turn_thread: ReplyRef, payload: etree._Element
    ) -> None:
        try:
            self.pump.check_self_call(agent, payload)
        except Refusal as refusal:
            raise _refused(refusal, payload) from None

    # -- approval requests ------------------------------------------------------------------

    async def send_approval(self, pending: PendingApproval, request: etree._Element) -> None:
        """Send an approval request to its approver: a named client durably (kept until
        she has received it, offered again at her next hello), a listener through the pump
        (a sub-thread of the Turn, so its answer comes back to the agent)."""
        approver = pending.approver
        if approver in self.named_clients and self.store is not None and self.clients:
            body = encode(pending.agent_id, approver, new_thread_id(), request)
            with self.clients.keeping():
                reply_id = await self.store.run(
                    replies.record_client_reply,
                    approver,
                    {"approval": pending.request_id},
                    body,
                    failed=False,
                )
                if reply_id:
                    await self.clients.deliver(approver, reply_id, body)
            return
        if self.store is None:
            raise RuntimeError("approval requests need the store")
        ref = await self.store.read(
            turns.turn_reply_ref, TurnToken(pending.agent_id, pending.agent_turn_id, 0)
        )
        if ref is None:
            raise RuntimeError(f"turn {pending.agent_turn_id} has no reply reference")
        await self.call(pending.agent_id, reply_ref_from_json(ref), request, approver)

    # -- ReplyPort ------------------------------------------------------------------------

    async def deliver(
        self, reply_ref: ReplyRef, payload: etree._Element, *, failed: bool, turn_id: str
    ) -> None:
        if turn_id in self._delivered:
            return
        ref = ThreadRef.from_json(reply_ref)
        agent = ref.chain[-1]
        caller = ref.caller
        identity = reply_ref.get("client")
        if identity not in self.named_clients:
            identity = caller if caller in self.named_clients else None
        home = reply_ref.get(PROCESS_KEY)
        if (
            identity is None
            and home is not None
            and self.store is not None
            and home != self.store.owner
        ):
            # An anonymous caller connected to another process: that one answers it.
            raise CallerElsewhere(str(home))
        if identity is not None and self.store is not None and self.clients is not None:
            # Kept before it is offered: it leaves the store only once received.
            body = encode(agent, identity, ref.caller_thread, payload)
            # A flush may offer the reply as soon as it is kept (on PostgreSQL the keep
            # rings this process's own flusher): deliver() must know if it did.
            with self.clients.keeping():
                reply_id = await self.store.run(
                    replies.record_client_reply,
                    identity,
                    ref.to_json(),
                    body,
                    failed=failed,
                    agent_turn_id=turn_id,
                )
                self.pump.end_hop(ref.hop)  # as an answer would: the hop ends
                if reply_id:
                    await self.clients.deliver(identity, reply_id, body)
        elif SCHEDULE_KEY in reply_ref:
            # A schedule's run: no caller waits for its answer, which goes to the store
            # and the agent's events only. Nothing is gone, so nothing to log.
            self.pump.release(ref.hop)
        elif self.pump.is_connected(caller):
            if not await self.pump.answer(agent, ref, payload):
                log.info("turn %s: caller %s went away; answer kept in the store", turn_id, caller)
        else:
            log.info(
                "turn %s: anonymous caller %s is gone; answer kept in the store", turn_id, caller
            )
            self.pump.release(ref.hop)
        self._delivered[turn_id] = None
        while len(self._delivered) > _DEDUP_WINDOW:
            self._delivered.popitem(last=False)


async def _sees_request(runtime: AgentRuntime, access: AccessRule, by: str, request: str) -> bool:
    """Whether client ``by`` may see approval request ``request`` though it is not its
    approver: an operator, or the sender of the task whose call waits for it."""
    if access.sees_all(by):
        return True
    for pending in await runtime.store.read(governance.pending_approvals):
        if pending.request_id == request:
            _caller, _hop, sender = await runtime.store.read(views.turn_task, pending.agent_turn_id)
            return access.decide(by, sender)
    return False


async def approval_decision(
    runtime: AgentRuntime, payload: etree._Element, meta: HandlerMetadata, ports: PumpPorts | None
) -> HandlerResult:
    """An approver's ``<approval-decision>``: the first one per request wins; every one is
    acknowledged (a listener approver's, arriving as its response, needs no ack). Any
    governed agent may receive it (by name, or the first by root tag): the store applies
    it by its request id, to the agent that asked."""
    decision = model_from_tree(ApprovalDecision, payload)
    by: str | None = meta.from_id
    if ports is not None and meta.from_id in ports.operators:
        by = None  # the server's own console: the operator may decide any request
    elif ports is not None:
        by = ports.decider(meta.from_id)
    status = await runtime.approvals.decide(
        decision.request, decision.grant, decision.reason.strip(), by
    )
    if (
        status == "not-yours"
        and ports is not None
        and ports.access is not None
        and by in ports.named_clients  # anonymous callers (no <clients>) keep not-yours
        and not await _sees_request(runtime, ports.access, by, decision.request)
    ):
        # Neither its approver, nor an operator, nor the sender of the task that asked:
        # answered as an unknown request, so request ids cannot be probed
        # (docs/security.md).
        ports.access.refuse(by, "approval", "approval-decision")
        status = "unknown"
    if status != "applied":
        log.info("approval decision for %s from %s: %s", decision.request, by, status)
    if meta.response_thread is not None:
        return None
    return HandlerResponse.respond(ApprovalAck(request=decision.request, status=status))


def agent_handler(
    runtime: AgentRuntime, pump: Pump, name: str, ports: PumpPorts | None = None
) -> Handler:
    """The pump handler of agent ``name`` (a raw listener: it receives lxml elements).
    With ``ports``, a task's reference names its named client (:meth:`PumpPorts.reply_ref`)."""

    async def handle(payload: etree._Element, meta: HandlerMetadata) -> HandlerResult:
        if payload.tag == DECISION_TAG:
            return await approval_decision(runtime, payload, meta, ports)
        if meta.response_thread is not None:
            # A refusal, or a peer's answer that says it failed (status="failed").
            failed = isinstance(payload.tag, str) and (
                payload.tag.startswith(_CORE) or payload.get(STATUS_ATTR) == FAILED
            )
            await runtime.report_tool_result(name, meta.response_thread, payload, failed=failed)
            return None
        if meta.from_id == "system":
            # A primitive about the agent's own output: the ports raise PumpRefused for
            # those, so this only happens for a pump-originated notice; log it.
            log.info("%s: system notice on %s ignored", name, meta.thread_id)
            return None
        ref = pump.hold(meta.thread_id)
        reply_ref = ports.reply_ref(ref) if ports is not None else thread_reply_ref(ref)
        if runtime.store.shared and "client" not in reply_ref:
            # The caller's connection is in this process: an anonymous caller is answered
            # from here, whichever process runs the Turn (pg/callers.py). A named client's
            # answer is kept for her wherever she reconnects, so it names no process (a
            # dead process's callers' replies are given up).
            reply_ref[PROCESS_KEY] = runtime.store.owner
        traceparent = pump.tracing.traceparent()
        if traceparent is not None:
            # Stored with the task: its Turn joins this trace, even after a restart.
            reply_ref["traceparent"] = traceparent
        try:
            # The task's own mode, from its envelope (a socket client's attribute, or the
            # gateway's from ``?multitask=``); None: the agent's.
            await runtime.enqueue(name, payload, reply_ref, multitask=envelope_multitask(payload))
        except BaseException:
            pump.release(meta.thread_id)
            raise
        return None

    return handle
