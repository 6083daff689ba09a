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

from agentserver.agents.errors import TurnPruned
from agentserver.core.errors import InputRefused
from agentserver.core.handshake import Identity
from agentserver.core.usage import TaskForm, task_form
from agentserver.core.xmlsafe import SafeParser
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.routes.budgets import visible_budgets
from agentserver.http.routes.status import StatusRoutes
from agentserver.http.ui import wording
from agentserver.primitives.approval import ApprovalDecision

#: Tasks listed on an agent's page.
RECENT_TASKS = 25
#: Characters of a task's text in a list.
LIST_TEXT = 100
#: The store's reading of a task it does not hold yet (a task page opened as the task is
#: sent, before its inbox row is committed): queued, no text.
NOT_YET: dict[str, Any] = {
    "inbox_status": "queued",
    "reason": None,
    "text": "",
    "text_cut": False,
    "outcome": None,
    "answer": None,
    "answer_cut": False,
    "finished_at": None,
    "asking": False,
}


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
        doc["budgets"] = [worded_budget(b) for b in await visible_budgets(self.ctx, identity)]
        for backend in doc["backends"].values():
            backend["calls"] = wording.backend_calls(backend.get("counters"))
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
            "tasks": [
                self.listed(t)
                for t in await view.recent_tasks(name, RECENT_TASKS, self.gate.scope(identity))
            ],
            "approvals": approvals,
            "operator": self.is_operator(identity),
            "task_form": dataclasses.asdict(form) if form is not None else None,
        }

    async def task(
        self, identity: Identity, name: str, thread: str, request: Request
    ) -> dict[str, Any] | None:
        """The task of agent ``name`` sent on ``thread``: its view (status, steps, usage),
        its Turn's log (cards, decisions, approvals), its pending approvals and the
        replies the gateway keeps for the caller on that thread. None: not visible (or
        its own task pruned by retention: nothing of it is left to show). A
        task not (yet) in the store is shown as waiting, and so is another client's (the
        authorization rule: exactly what a missing one shows)."""
        view = self.ctx.agents
        if view is None or name not in self.agent_names(identity):
            return None
        hidden = False
        if not self.gate.sees_all(identity):
            found, sender = await view.task_sender(name, thread, identity.name)
            hidden = found and not self.gate.owns(identity, sender, request)
        try:
            task = None if hidden else await view.task(name, thread, self.gate.scope(identity))
        except TurnPruned:
            # Its own (or, for an operator, any) task removed by retention: the console
            # has nothing of it to show ("not found"); another client's pruned task was
            # hidden above, shown as a missing one is.
            return None
        turn = task.get("turn") if task is not None else None
        log = await view.turn_log(turn) if turn else {"cards": [], "decisions": []}
        if task is not None:
            for step in task["steps"]:
                step["took"] = _took(step.get("started_at"), step.get("ended_at"))
                step["cost_text"] = wording.cost(step.get("cost"))
        # The same scope as the task itself: another client's task reads as a missing one.
        read = None if hidden else await view.task_reading(name, thread, self.gate.scope(identity))
        return {
            "agent": name,
            "thread": thread,
            "task": task,
            "reading": self.reading(read or NOT_YET, task),
            "log": log,
            "approvals": await self.approvals(identity, turn) if turn else [],
            "replies": self.replies(identity, thread, request),
            "operator": self.is_operator(identity),
        }

    def reading(self, found: dict[str, Any], task: dict[str, Any] | None) -> dict[str, Any]:
        """A task as its page shows it, from the store's reading of it
        (:func:`agentserver.agents.store.sql.views.reading`) and its view (usage): the
        state in words, the text, the answer, and its figures formatted."""
        state = wording.task_state(found["inbox_status"], found["outcome"], found["asking"])
        usage = (task or {}).get("usage") or {}
        steps = (task or {}).get("steps") or []
        costs = [s["cost"] for s in steps if s.get("cost") is not None]
        return {
            "state": state,
            "detail": wording.state_detail(
                found["inbox_status"], found["outcome"], found["reason"]
            ),
            "finished": state in wording.FINISHED,
            "text": wording.payload_text(found["text"], self._parser)
            + (" …" if found["text_cut"] else ""),
            "answer": found["answer"],
            "answer_cut": found["answer_cut"],
            "answered": state == wording.SUCCEEDED,
            "took": _took((task or {}).get("created_at"), found["finished_at"]),
            "tokens": wording.count(usage.get("total_tokens"), "token") if steps else wording.NONE,
            # Steps that recorded no cost at all read as a dash, not as "$0".
            "cost": wording.cost(sum(costs)) if costs else wording.NONE,
            "steps": wording.count(len(steps), "step"),
        }

    def listed(self, row: dict[str, Any]) -> dict[str, Any]:
        """One task of an agent's list (:func:`views.recent_tasks`' row) with its text
        shortened, its state in words and how long it took."""
        state = wording.task_state(row["inbox_status"], row["outcome"], row["asking"])
        return {
            **row,
            "state": state,
            "detail": wording.state_detail(row["inbox_status"], row["outcome"], row["reason"]),
            "summary": wording.shorten(wording.payload_text(row["text"], self._parser), LIST_TEXT)
            or "(no text)",
            "took": _took(row["created_at"], row["finished_at"]),
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


def _took(start: float | None, end: float | None) -> str:
    """How long from ``start`` to ``end`` (store clock readings), worded; a dash unless
    both are known."""
    if start is None or end is None:
        return wording.NONE
    return wording.duration(end - start)


def worded_budget(budget: dict[str, Any]) -> dict[str, Any]:
    """A budget's row (``visible_budgets``) with its amounts worded for the overview:
    tokens counted, costs in dollars, for the limits it has."""

    def amount(values: dict[str, Any]) -> str:
        limit = budget["limit"]
        parts = []
        if limit.get("tokens") is not None:
            parts.append(wording.count(values.get("tokens"), "token"))
        if limit.get("cost") is not None:
            parts.append(wording.cost(values.get("cost")))
        return ", ".join(parts) or wording.NONE

    return {
        **budget,
        "worded": {k: amount(budget[k]) for k in ("spent", "reserved", "limit")},
    }
