"""The console's approval commands: ``/approve ID`` and ``/deny ID [reason]``.

They become an ``<approval-decision>`` sent to an agent that takes decisions (any one,
however many governed agents there are: requests are kept in the one agent store, so any
agent applies a decision by its id, to the agent that asked).
The agent acknowledges it with an ``<approval-ack>``, which the router shows. Decisions
made at the console are the operator's: the server's own console may decide any request
(see docs/agents.md, "Human approval"). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from lxml import etree

APPROVAL_NS = "urn:agentserver:approval"
DECISION_TAG = f"{{{APPROVAL_NS}}}approval-decision"
HELP = (
    "  /approve ID            grant the tool call waiting for approval request ID",
    "  /deny ID [REASON]      refuse it (the agent is told REASON)",
)


def parse_approval(
    text: str, peers: Mapping[str, tuple[str, ...]]
) -> tuple[str, etree._Element] | str | None:
    """``(agent, decision)`` for an approval command, an error text, or None when ``text``
    is not one."""
    word, _, rest = text.partition(" ")
    if word not in ("/approve", "/deny"):
        return None
    request, _, reason = rest.strip().partition(" ")
    if not request:
        return f"error: write {word} ID" + (" [REASON]" if word == "/deny" else "")
    agents = sorted(name for name, tags in peers.items() if DECISION_TAG in tags)
    if not agents:
        return "error: this console cannot reach an agent that takes approval decisions"
    decision = etree.Element(DECISION_TAG, nsmap={None: APPROVAL_NS})
    decision.set("request", request)
    decision.set("grant", "true" if word == "/approve" else "false")
    etree.SubElement(decision, f"{{{APPROVAL_NS}}}reason").text = reason.strip()
    return agents[0], decision


def render_ack(payload: etree._Element) -> tuple[str, ...] | None:
    """An ``<approval-ack>`` as a console line (None: not one)."""
    if payload.tag != f"{{{APPROVAL_NS}}}approval-ack":
        return None
    status = payload.get("status", "")
    request = payload.get("request", "")
    texts = {
        "applied": f"approval {request}: decision applied",
        "duplicate": f"approval {request}: already decided (or timed out); nothing changed",
        "unknown": f"approval {request}: no such request",
        "not-yours": f"approval {request}: you are not its approver",
    }
    return (texts.get(status, f"approval {request}: {status}"),)


def render_request(payload: etree._Element) -> tuple[str, ...] | None:
    """An ``<approval-request>`` as one console line saying how to answer it (None: not
    one). The payload text is folded onto the line: a request is read at a glance."""
    if payload.tag != f"{{{APPROVAL_NS}}}approval-request":
        return None
    request = payload.get("request", "")
    text = " ".join((payload.findtext(f"{{{APPROVAL_NS}}}payload") or "").split())
    try:
        left = f"{float(payload.get('timeout', '')):g}"
    except ValueError:
        left = "?"
    return (
        f"approval request {request}: {payload.get('agent', '')} wants to call "
        f"{payload.get('target', '')} with {text} (rule {payload.get('rule', '')}, "
        f"{left} s left): "
        f"/approve {request} or /deny {request} [reason]",
    )
