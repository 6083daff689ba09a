"""Human approval of tool calls (``decision="require-approval"``), durable end to end.

A call that needs approval is suspended as a waiting row of its own kind
(``turn_waiting_tools.after_execution = 'approval'``, ``tool_call_id = 'approval:ID'``)
with an ``approvals`` row, in the transactions that suspend the Turn; then the
``<approval-request>`` goes to the rule's approver. A named client approver gets it
through the durable named-client replies (kept in the store until received, so an
approver who is away gets it at her next hello); a listener approver gets it through the
pump (and again after a restart, since the pump's threads do not survive one).

The approver answers ``<approval-decision request="ID" grant="true|false">`` addressed to
the agent (every governed agent takes decisions by name, the first also by root tag; the
request id says which agent asked, whichever receives it). The first decision wins (one transaction): a grant queues an ``approval`` row
that the worker turns into exactly one forward through the pump (``forwarding`` is
committed first, so a crash in between can never send the call twice; such a call is
reported lost instead); a denial, or no decision before the rule's ``timeout``, becomes a
failed result of the call (a refusal card). Later decisions are acknowledged
(``<approval-ack status="duplicate">``) and change nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import trio
from lxml import etree

from agentserver.agents.clock import Clock
from agentserver.agents.doorbell import Doorbell
from agentserver.agents.errors import PumpRefused, StaleTurn
from agentserver.agents.events import EventBus, NoticeEvent
from agentserver.agents.ports import ToolPort, reply_ref_from_json
from agentserver.agents.profile.agent import AgentProfile, not_in_version
from agentserver.agents.store.base import AgentStore, InboxRow, StoreCalls
from agentserver.agents.store.governance import APPROVAL_PREFIX, WAITING_KIND, PendingApproval
from agentserver.agents.store.sql import governance, inbox, turns
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser
from agentserver.primitives.approval import (
    DECISION_TAG,
    NS,
    REQUEST_TAG,
    ApprovalAck,
    ApprovalDecision,
    ApprovalRequest,
)

log = logging.getLogger(__name__)

# The approval vocabulary is wire-level (a client reads and writes it too): defined in
# agentserver.primitives.approval, importable from here as before.
__all__ = [
    "APPROVAL_PREFIX",
    "DECISION_TAG",
    "NS",
    "REQUEST_TAG",
    "WAITING_KIND",
    "ApprovalAck",
    "ApprovalDecision",
    "ApprovalRequest",
    "Approvals",
    "PendingApproval",
    "forward_granted",
    "request_element",
]

#: Delivers an approval request (the element) to ``pending.approver``.
SendApproval = Callable[[PendingApproval, etree._Element], Awaitable[None]]


def request_element(p: PendingApproval, timeout: float) -> etree._Element:
    model = ApprovalRequest(
        request=p.request_id,
        agent=p.agent_id,
        thread=p.thread,
        target=p.target,
        rule=p.rule,
        timeout=timeout,
        payload=p.payload,
    )
    return etree.fromstring(model.to_xml())


def requested_event(p: PendingApproval) -> NoticeEvent:
    """The ``approval.requested`` event of a request sent (the same for a resend)."""
    return NoticeEvent(
        "approval.requested",
        p.agent_id,
        p.agent_turn_id,
        {
            "request_id": p.request_id,
            "agent": p.agent_id,
            "turn": p.agent_turn_id,
            "target": p.target,
            "rule": p.rule,
            "approver": p.approver,
            "thread": p.thread,
            "deadline": p.deadline,
        },
        dedupe_key=f"approval.requested:{p.request_id}",
    )


class Approvals:
    """Sends approval requests, applies decisions, and times out the ones left waiting.

    ``send`` is the transport (:class:`agentserver.agents.edge.bridge.PumpPorts` implements
    it): ``await send(pending, element)`` delivers the request to ``pending.approver``.
    """

    def __init__(
        self,
        store: AgentStore,
        clock: Clock,
        doorbell: Doorbell,
        send: SendApproval | None = None,
        interval_s: float = 0.5,
        events: EventBus | None = None,
    ) -> None:
        self.events = events
        self.store = store
        self.clock = clock
        self.doorbell = doorbell
        self.send = send
        self.interval_s = interval_s

    async def deliver_requests(self) -> int:
        """Send every request not sent yet (after a suspend, and all again after a restart
        for listener approvers); returns how many."""
        if self.send is None:
            return 0
        n = 0
        for p in await self.store.read(governance.unsent_approvals):
            try:
                await self.send(p, request_element(p, max(0.0, p.deadline - self.clock.now())))
            except Exception:
                log.exception(
                    "approval request %s to %s could not be sent", p.request_id, p.approver
                )
                continue
            # For webhooks (docs/webhooks.md): its outbox rows commit with the mark, so a
            # crash after the send loses no event (unmarked, it is sent again, the same
            # event by its dedupe key).
            event = requested_event(p)
            rows = self.events.outbox_render()(event) if self.events is not None else ()
            if rows:
                await self.store.run(governance.mark_approval_sent, p.request_id, rows)
            else:  # one statement
                await self.store.run1(governance.mark_approval_sent, p.request_id)
            n += 1
            if self.events is not None:
                self.events.publish(event, written=bool(rows))
        return n

    async def decide(self, request_id: str, grant: bool, reason: str, by: str | None) -> str:
        status = await self.store.run(governance.decide_approval, request_id, grant, reason, by)
        if status == "applied":
            self.doorbell.ring()
        return status

    async def expire(self) -> int:
        n = await self.store.run(governance.expire_approvals, self.clock.now())
        if n:
            self.doorbell.ring()
        return n

    async def run(
        self,
        listener_approvers: tuple[str, ...] = (),
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        if listener_approvers:
            await self.store.run1(governance.unsend_approvals, listener_approvers)
        task_status.started()
        while True:
            try:
                await self.deliver_requests()
                await self.expire()
            except Exception:
                log.exception("approvals tick failed")
            await trio.sleep(self.interval_s)


async def forward_granted(
    row: InboxRow,
    *,
    store: StoreCalls,
    profiles: Mapping[str, AgentProfile],
    tools: ToolPort,
    clock: Clock,
    doorbell: Doorbell,
) -> None:
    """The worker's handling of an ``approval`` row: forward the granted call once.

    Checked by the pump first, then two transactions around one send: the claim
    (``begin_forward``) commits, then the forward (``finish_forward``: the waiting row
    names the call's sub-thread, drawn here) commits before the call goes out through
    ``tools`` on that sub-thread, so its result never comes before its waiting row. A
    crash or a cancel between the two transactions leaves the request ``forwarding``,
    which the row's next handling reports lost rather than risk sending the call twice;
    one after the forward leaves the Turn suspended on a call that never went out, which
    a restart sends again (a listener whose steps may be retried) or reports lost. A
    refusal of the pump is the call's failed result. The doorbell rings once the forward
    or the refusal is recorded (the call's result may be due). ``profiles`` give the
    target's ``terminate`` and the Turn's resume deadline."""
    begun = await store.run(governance.begin_forward, row)
    if begun is None:
        return
    request_id, token, target, payload = begun
    profile = profiles.get(token.agent_id)
    after = "terminate" if profile is not None and target in profile.terminate_tools else "suspend"
    ref_json = await store.read(turns.turn_reply_ref, token)
    if ref_json is None:  # no longer the agent's active Turn
        raise StaleTurn(f"{token}: not the active Turn")
    if profile is not None and profile.version and not profile.has_tool(target):
        # The version granted on is not the one the call was asked on (docs/deploy.md).
        await store.run(governance.fail_forward, request_id, row, not_in_version(target, profile))
        doorbell.ring()
        return
    try:
        element = SafeParser().parse(payload.encode("utf-8"))
        tools.check_call(token.agent_id, element, target)
    except PumpRefused as refused:
        text = etree.tostring(refused.element, encoding="unicode")
        await store.run(
            governance.fail_forward, request_id, row, f"the granted call was refused: {text}"
        )
        doorbell.ring()
        return
    sub = new_thread_id()
    deadline = clock.now() + (profile.resume_deadline_s if profile else 60.0)
    try:
        await store.run(governance.finish_forward, request_id, row, sub, after, deadline)
    except StaleTurn:
        log.info("approval %s: its Turn moved on before the call was forwarded", request_id)
        doorbell.ring()
        return
    try:
        # A granted call's idempotency key is its approval request's id (its card's).
        await tools.call(
            token.agent_id,
            reply_ref_from_json(ref_json),
            element,
            target,
            key=request_id,
            thread=sub,
        )
    except PumpRefused as refused:
        await store.run(
            inbox.report_tool_result,
            token.agent_id,
            sub,
            etree.tostring(refused.element),
            failed=True,
        )
    doorbell.ring()
