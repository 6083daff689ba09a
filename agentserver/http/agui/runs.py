"""AG-UI runs on our agents (docs/ag-ui.md): a run's input becomes the agent's task, sent
through the HTTP gateway as the caller (the same validation, routing, ``may-address``
and authorization as ``POST /v1/messages``), on a thread derived from the caller and the
run (:func:`~agentserver.http.agui.agents.run_thread`); a run posted again finds its task
and streams it from where it is; a run with ``resume`` entries decides the approvals its
interrupts stand for and streams the rest of their Turn.

Sans HTTP: the route (:mod:`agentserver.http.routes.agui`) authenticates, parses and
answers the :class:`RunProblem` this raises as a problem. No import of the
``ag-ui-protocol`` package: the run input arrives as the route parsed it, a plain dict.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from lxml import etree

from agentserver.agents.events import EventBus, Subscription
from agentserver.core.handshake import Identity
from agentserver.core.payloads import model_xml
from agentserver.core.xmlsafe import SafeParser
from agentserver.http.agui.agents import AguiAgent, RunRefused, last_user_text, run_thread
from agentserver.http.sendonce import SendOnce, until_stored
from agentserver.primitives.approval import NS as APPROVAL_NS
from agentserver.primitives.approval import ApprovalDecision

log = logging.getLogger("agentserver.agui")

_ACK = f"{{{APPROVAL_NS}}}approval-ack"
#: Events a stream's subscriber may have waiting (then it is polled instead).
BUFFER = 256
#: The longest threadId and runId taken (they are hashed into a thread, but a client
#: sending megabytes of id is a mistake to tell).
MAX_ID = 256


class RunProblem(Exception):
    """A run refused before its stream starts: the route answers ``status`` with a
    problem of ``kind`` saying ``text``."""

    def __init__(self, status: int, kind: str, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.kind = kind
        self.text = text


class RunRefusedByPump(Exception):
    """The task was refused by the pump (``refusal``: the route answers it as
    ``POST /v1/messages`` does)."""

    def __init__(self, refusal: Any) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


class Sender(Protocol):
    """The HTTP gateway (:class:`agentserver.http.gateway.HttpGateway`)."""

    async def send(
        self,
        identity: Identity,
        to: str | None,
        body: bytes,
        *,
        wait: bool,
        thread: str | None = None,
    ) -> Any: ...


class Conversations(Protocol):
    """Which conversation the next task on a thread continues (``AgentRuntime.expect_fork``)."""

    def expect_fork(self, agent_id: str, thread: str, conversation: str) -> None: ...


class Tasks(Protocol):
    """Whether an agent has a task on a thread, whoever sent it
    (:meth:`agentserver.http.agents_view.AgentsView.task_sender`)."""

    async def task_sender(
        self, name: str, thread: str, sender: str | None = None
    ) -> tuple[bool, str | None]: ...


class Owners(Protocol):
    """Whether a caller may see a task (:meth:`agentserver.http.gate.Gate.task_visible`,
    bound to the request): the authorization rule."""

    async def __call__(self, identity: Identity, name: str, thread: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class Run:
    """A run to stream: the thread of its task, and whether the task was just sent."""

    thread: str
    fresh: bool
    sub: Subscription | None


class AguiRuns:
    """Starts, finds and resumes AG-UI runs on ``agents``."""

    def __init__(
        self,
        agents: tuple[AguiAgent, ...],
        gateway: Sender,
        tasks: Tasks,
        bus: EventBus | None,
        conversations: Conversations | None = None,
    ) -> None:
        self.agents = {a.name: a for a in agents}
        self.gateway = gateway
        self.tasks = tasks
        self.bus = bus
        self.conversations = conversations
        self._parser = SafeParser()
        # One start at a time per run thread: the check for the run's task and its send
        # are two awaits, so two first POSTs of one run would both send (http/sendonce.py).
        self._starting = SendOnce()

    def _subscribe(self) -> Subscription | None:
        if self.bus is None:
            return None
        try:
            return self.bus.subscribe(BUFFER)
        except RuntimeError:
            return None  # too many subscribers: this run is polled (its text whole)

    async def start(
        self,
        identity: Identity,
        agent: AguiAgent,
        run_input: dict[str, Any],
        visible: Owners,
    ) -> Run:
        """The run ``run_input`` names: resumed (its ``resume`` entries decided), found
        (posted before: a reconnection), or started (its task sent). Raises
        :class:`RunProblem`."""
        thread_id, run_id = run_input["threadId"], run_input["runId"]
        for value in (thread_id, run_id):
            if not value or len(value) > MAX_ID:
                raise RunProblem(
                    422, "bad-run-input", f"threadId and runId are 1 to {MAX_ID} characters"
                )
        if run_input.get("resume"):
            return await self._resume(identity, agent, run_input["resume"], visible)
        owner = identity.name or ""
        thread = run_thread(owner, agent.name, thread_id, run_id)
        async with self._starting.hold(thread):
            return await self._start_or_find(identity, agent, run_input, owner, thread)

    async def _start_or_find(
        self,
        identity: Identity,
        agent: AguiAgent,
        run_input: dict[str, Any],
        owner: str,
        thread: str,
    ) -> Run:
        thread_id = run_input["threadId"]
        sub = self._subscribe()
        try:
            # The thread is the caller's own (derived from its name): a task on it is
            # this run's, posted again (a reconnection): the rest of the run.
            found, _sender = await self.tasks.task_sender(agent.name, thread)
            if found:
                return Run(thread, False, sub)
            try:
                payload = agent.payload(last_user_text(run_input.get("messages") or []))
            except RunRefused as exc:
                raise RunProblem(422, "bad-run-input", str(exc)) from None
            if agent.memory and self.conversations is not None:
                # Each AG-UI thread is a conversation the agent remembers.
                self.conversations.expect_fork(agent.name, thread, f"agui:{owner}:{thread_id}")
            outcome = await self.gateway.send(
                identity, agent.name, etree.tostring(payload), wait=False, thread=thread
            )
            if outcome.kind == "refused":
                raise RunRefusedByPump(outcome.refusal)

            # The task reaches the store after the send returns (the pump delivers it to
            # the agent): the next start of this run, which waits for this one, must find
            # it there, so the start ends once the store has it (bounded).
            async def stored() -> bool:
                return (await self.tasks.task_sender(agent.name, thread))[0]

            await until_stored(stored)
        except BaseException:
            if sub is not None:
                sub.close()
            raise
        return Run(thread, True, sub)

    async def _resume(
        self, identity: Identity, agent: AguiAgent, entries: list[Any], visible: Owners
    ) -> Run:
        """Decide each approval the resume entries answer; the run streams their Turn."""
        from agentserver.http.agui.stream import read_interrupt_id

        threads = set()
        decided: list[tuple[str, ApprovalDecision]] = []
        for entry in entries:
            if not isinstance(entry, dict):
                raise RunProblem(422, "bad-run-input", "each resume entry is an object")
            named = str(entry.get("interruptId", ""))
            found = read_interrupt_id(named)
            if found is None or not await visible(identity, agent.name, found[0]):
                # Another caller's interrupt answers exactly as a missing one.
                raise RunProblem(404, "not-found", f"No interrupt {named} is pending.")
            thread, request = found
            threads.add(thread)
            decided.append((named, self._decision(request, entry)))
        if len(threads) != 1:
            raise RunProblem(422, "bad-run-input", "resume entries answer one run's interrupts")
        sub = self._subscribe()
        try:
            for named, decision in decided:
                outcome = await self.gateway.send(
                    identity, agent.name, model_xml(decision), wait=True
                )
                status = None
                if outcome.kind == "reply":
                    root = self._parser.parse(outcome.reply)
                    if len(root) > 1 and root[1].tag == _ACK:
                        status = root[1].get("status")
                if status == "unknown":
                    raise RunProblem(404, "not-found", f"No interrupt {named} is pending.")
                if status not in ("applied", "duplicate"):
                    raise RunProblem(
                        409,
                        "interrupt-not-answered",
                        f"The answer to interrupt {named} was not applied: "
                        f"{'you are not its approver' if status == 'not-yours' else status or 'no answer'}.",
                    )
        except BaseException:
            if sub is not None:
                sub.close()
            raise
        return Run(threads.pop(), False, sub)

    @staticmethod
    def _decision(request: str, entry: dict[str, Any]) -> ApprovalDecision:
        """The approval decision a resume entry gives: ``cancelled`` denies;
        ``resolved`` takes ``{"grant": bool, "reason": str}`` (or a bare boolean)."""
        if entry.get("status") == "cancelled":
            return ApprovalDecision(request=request, grant=False, reason="cancelled")
        payload = entry.get("payload")
        if isinstance(payload, bool):
            payload = {"grant": payload}
        grant = payload.get("grant") if isinstance(payload, dict) else None
        if entry.get("status") != "resolved" or not isinstance(grant, bool):
            raise RunProblem(
                422,
                "bad-run-input",
                'answer an approval interrupt with {"status": "resolved", "payload": '
                '{"grant": true|false, "reason": "..."}} or {"status": "cancelled"}',
            )
        reason = payload.get("reason", "") if isinstance(payload, dict) else ""
        return ApprovalDecision(
            request=request, grant=grant, reason=str(reason if reason is not None else "")[:2000]
        )
