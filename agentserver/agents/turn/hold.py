"""A run's hold on its Turn: :meth:`TurnHold.fence` (is the Turn still this run's, and
running?) and :meth:`TurnHold.finish` (end it from inside its run).

One per runtime, shared by the worker and its parts (:class:`~.model_step.ModelStep`,
:class:`~.tool_dispatch.ToolDispatch`), so that none of them calls back into the worker.
Both are plain store calls: a fence is one head read, a finish one compare-and-set
transaction followed by what the end sets off (:meth:`~.delivery.TurnEnder.after`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace

from agentserver.agents.errors import StaleTurn
from agentserver.agents.governance.budgets import spent
from agentserver.agents.ports import LLMCompletion
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.store.base import AgentStore, Head, NewCard, Spend, TaskStatus, TurnToken
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.sql import turn_end
from agentserver.agents.store.states import HeadStatus
from agentserver.agents.turn.answer import answer_bytes
from agentserver.agents.turn.delivery import TurnEnder
from agentserver.observability.tracing import Tracing, record_error

#: The last step completed with a Turn's end: (step id, completion, its cards).
LastStep = tuple[str, LLMCompletion, list[NewCard], tuple[Spend, ...]]


@dataclass(frozen=True, slots=True)
class TurnHold:
    """Fences and finishes Turns for the runs that hold them. Holds only infrastructure."""

    ender: TurnEnder
    tracing: Tracing

    @property
    def store(self) -> AgentStore:
        return self.ender.store

    async def fence(self, token: TurnToken, status: HeadStatus = HeadStatus.RUNNING) -> Head:
        """The Turn's head while ``token`` still holds it in ``status`` (running, or
        suspended on the calls a run is sending); else StaleTurn.

        One head read (no write, so nothing to undo on cancel). A later write of the run
        is fenced again by the store's own compare-and-set: this check only keeps the
        run from sending anything new (a tool call, a model call) once fenced out."""
        head = await self.store.read(sql_head.read, token.agent_id)
        if head.token != token or head.status != status:
            raise StaleTurn(f"{token} is no longer {status}")
        return head

    async def finish(
        self,
        token: TurnToken,
        profile: AgentProfile,
        status: str,
        text: str,
        metadata: Mapping[str, object] | None = None,
        step: LastStep | None = None,
    ) -> None:
        """End the Turn with ``text``, answering its caller; ``step``: the last step to
        complete in the same transaction (its model calls settled in their budgets with
        it).

        The end is one compare-and-set transaction (``turn_end.finish``: the deliverable, the
        reply in the outbox, the head released), atomic: StaleTurn when the Turn was no
        longer ``token``'s, with nothing written. Then its TaskEvent and reply
        (:meth:`TurnEnder.after`). Cancelled after the commit, the reply is left pending
        in the outbox, which the watchdog sends."""
        if self.tracing.enabled:
            span = trace.get_current_span()
            span.set_attribute("agentserver.task.status", status)
            if status != TaskStatus.SUCCEEDED:
                record_error(span, str(status))
        reply = answer_bytes(profile, text, failed=status != TaskStatus.SUCCEEDED)
        step_id, completion, cards, spends = step or (None, None, [], ())
        # Other Turns' replies sent meanwhile are marked so in this transaction.
        sent = self.ender.marks.take()
        try:
            fin = await self.store.run(
                turn_end.finish,
                token,
                status,
                text,
                dict(metadata or {}),
                reply,
                step_id=step_id,
                completion=completion,
                cards=cards,
                sent=sent,
                spends=spends,
            )
        except BaseException:
            self.ender.marks.give_back(sent)
            raise
        spent(self.ender.events, spends)
        await self.ender.after(fin)
