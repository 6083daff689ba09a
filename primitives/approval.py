"""The approval vocabulary (docs/agents.md, "Human approval"): the request an approver
receives, the decision it sends, and the agent's acknowledgement. Wire-level, so that a
client (:mod:`agentserver.net.client`) reads and writes it without the agents' code.
"""

from __future__ import annotations

from pydantic_xml import BaseXmlModel, attr, element

NS = "urn:agentserver:approval"
REQUEST_TAG = f"{{{NS}}}approval-request"
DECISION_TAG = f"{{{NS}}}approval-decision"


class ApprovalRequest(BaseXmlModel, tag="approval-request", nsmap={"": NS}):
    """Sent to the approver: one tool call waiting for a decision."""

    request: str = attr()
    agent: str = attr()
    thread: str = attr()
    target: str = attr()
    rule: str = attr()
    timeout: float = attr()
    payload: str = element()


class ApprovalDecision(BaseXmlModel, tag="approval-decision", nsmap={"": NS}):
    """The approver's answer, addressed to the agent."""

    request: str = attr()
    grant: bool = attr()
    reason: str = element(default="")


class ApprovalAck(BaseXmlModel, tag="approval-ack", nsmap={"": NS}):
    """The agent's acknowledgement of a decision: ``applied``, ``duplicate`` (an earlier
    decision or the timeout already settled it), ``unknown`` or ``not-yours``."""

    request: str = attr()
    status: str = attr()
