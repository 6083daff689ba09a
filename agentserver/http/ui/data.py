"""What the web console's pages show, as plain JSON-able documents read from the HTTP
API's objects (the agent store's views, the pump, the router's stats, the gateway's kept
replies) and filtered by what the caller may see. Each function is one or a few reads;
nothing here writes. Used both to render a page and by the page's script to refresh it.

Bounded: an agent's page lists its newest :data:`RECENT_TASKS` tasks, a task's page its
Turn's newest cards (:data:`agentserver.agents.store.sql.views.TURN_LOG_CARDS`, each cut); the
pending approvals are all read (they are few: each holds a suspended call)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from starlette.requests import Request

from agentserver.core.errors import InputRefused
from agentserver.core.handshake import Identity
from agentserver.core.usage import TaskForm, task_form
from agentserver.core.xmlsafe import SafeParser
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.routes.budgets import visible_budgets
from agentserver.http.routes.status import StatusRoutes
from agentserver.primitives.approval import ApprovalDecision

#: Tasks listed on an agent's page.
RECENT_TASKS = 25


class ConsoleData:
    """Reads for the console's pages of one app."""

    def __init__(self, ctx: HttpContext, status: StatusRoutes, gate: Gate) -> None:
        self.ctx = ctx
        self.status = status
        #: The API's gate: the authorization rule (agentserver/core/access.py) as routes
        #: call it.
        self.gate = gate
        self._parser = SafeParser(ctx.gateway.max_bytes)
        #: Listener name → its task form (None: no such listener, or it takes nothing
        #: a person sends); one entry per listener at most.
        self._task_forms: dict[str, TaskForm | None] = {}

    def task_form(self, name: str) -> TaskForm | None:
        """How a task for listener ``name`` is typed: its first payload type other than
        an approval decision (which an agent takes too, from its approvers). Computed
        once per listener (compiling its XSD takes milliseconds), then kept."""
        if name in self._task_forms:
            return self._task_forms[name]
        pump = self.ctx.pump
        listener = next((lst for lst in pump.listeners if lst.name == name), None)
        ptypes = {p.model: p for p in pump.payloads}
        form = None
        if listener is not None:
            for model in listener.payload_types:
                if model is not ApprovalDecision and model in ptypes:
                    form = task_form(ptypes[model])
                    break
        self._task_forms[name] = form
        return form

    def is_operator(self, identity: Identity) -> bool:
        """Whether ``identity`` may stop and cancel (the socket's rule)."""
        ctx = self.ctx
        if ctx.operator is None:
            return False
        if identity.name is None:
            return ctx.anonymous_operators
        return identity.name in ctx.operators

    def agent_names(self, identity: Identity) -> list[str]:
        view = self.ctx.agents
        if view is None:
            return []
        return [n for n in view.agents if Gate.may_see(identity, n)]

    async def approvals(self, identity: Identity, turn: str | None = None) -> list[dict]:
        """Pending approval requests of the agents ``identity`` may see (of one Turn): an
        operator sees all; a client those it is the approver of and those of its own
        tasks (the authorization rule, docs/security.md)."""
        view = self.ctx.agents
        if view is None:
            return []
        now = time.time()
        out = []
        sees_all = self.gate.sees_all(identity)
        for p in await view.pending_approvals():
            if not Gate.may_see(identity, p.agent_id):
                continue
            if turn is not None and p.agent_turn_id != turn:
                continue
            if not sees_all and p.approver != identity.name:
                _caller, _hop, sender = await view.turn_task(p.agent_turn_id)
                if not self.gate.rule.decide(identity.name, sender):
                    continue
            item = dataclasses.asdict(p)
            item["seconds_left"] = max(0, round(p.deadline - now))
            item["mine"] = identity.name is None or identity.name == p.approver
            out.append(item)
        return out

    async def overview(self, identity: Identity) -> dict[str, Any]:
        doc = await self.status.status_document()
        seen = set(self.agent_names(identity))
        doc["agents"] = self.gate.agent_summaries(
            identity, [a for a in doc["agents"] if a["name"] in seen]
        )
        doc["listeners"] = [lst for lst in doc["listeners"] if Gate.may_see(identity, lst["name"])]
        doc["approvals"] = await self.approvals(identity)
        doc["operator"] = self.is_operator(identity)
        doc["caller"] = identity.name
        doc["budgets"] = await visible_budgets(self.ctx, identity)
        return doc

    async def agent(self, identity: Identity, name: str) -> dict[str, Any] | None:
        view = self.ctx.agents
        if view is None or name not in self.agent_names(identity):
            return None
        approvals = [a for a in await self.approvals(identity) if a["agent_id"] == name]
        form = self.task_form(name)
        return {
            "agent": self.gate.agent_summaries(identity, [await view.agent(name)])[0],
            # Only the caller's own tasks unless it sees all (docs/security.md).
            "tasks": await view.recent_tasks(name, RECENT_TASKS, self.gate.scope(identity)),
            "approvals": approvals,
            "operator": self.is_operator(identity),
            "task_form": dataclasses.asdict(form) if form is not None else None,
        }

    async def task(
        self, identity: Identity, name: str, thread: str, request: Request
    ) -> dict[str, Any] | None:
        """The task of agent ``name`` sent on ``thread``: its view (status, steps, usage),
        its Turn's log (cards, decisions, approvals), its pending approvals and the
        replies the gateway keeps for the caller on that thread. None: not visible. A
        task not (yet) in the store is shown as waiting, and so is another client's (the
        authorization rule: exactly what a missing one shows)."""
        view = self.ctx.agents
        if view is None or name not in self.agent_names(identity):
            return None
        hidden = False
        if not self.gate.sees_all(identity):
            found, sender = await view.task_sender(name, thread, identity.name)
            hidden = found and not self.gate.owns(identity, sender, request)
        task = None if hidden else await view.task(name, thread, self.gate.scope(identity))
        turn = task.get("turn") if task is not None else None
        log = await view.turn_log(turn) if turn else {"cards": [], "decisions": []}
        return {
            "agent": name,
            "thread": thread,
            "task": task,
            "log": log,
            "approvals": await self.approvals(identity, turn) if turn else [],
            "replies": self.replies(identity, thread, request),
            "operator": self.is_operator(identity),
        }

    def replies(
        self, identity: Identity, thread: str, request: Request
    ) -> list[dict[str, str]] | None:
        """The replies kept for the caller's message on ``thread`` (any message's for an
        operator): who sent each, its payload's text and the whole envelope; None if the
        gateway keeps none it may see."""
        kept = self.gate.kept_thread(identity, thread, request)
        if kept is None:
            return None
        return [reply_document(r, self._parser) for r in kept.replies]


def reply_document(envelope: bytes, parser: SafeParser) -> dict[str, str]:
    """One kept reply for the page: its sender, its payload's text (what a person reads:
    an answer's words) and the envelope as sent."""
    xml = envelope.decode("utf-8", "replace")
    try:
        root = parser.parse(envelope)
    except InputRefused:
        return {"from": "", "text": "", "xml": xml}
    sender = root[0][0].text or "" if len(root) and len(root[0]) else ""
    payload = root[1] if len(root) > 1 else None
    text = " ".join("".join(payload.itertext()).split()) if payload is not None else ""
    return {"from": sender, "text": text, "xml": xml}
