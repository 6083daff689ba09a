"""Read-only views of the agent store for the HTTP API and ``agentserver status``.

Each call is one read through the store (:mod:`agentserver.agents.store.sql.views`, the same SQL
on SQLite and PostgreSQL): on SQLite inline on the store's connection, as its own
transactions run; on PostgreSQL one thread hop of the store's executor, so the trio
thread never waits on the database.
"""

from __future__ import annotations

from typing import Any

from agentserver.agents.store.base import ViewStore
from agentserver.agents.store.sql import governance, views
from agentserver.agents.store.sql.views import ERROR_TEXT_CHARS

__all__ = ["ERROR_TEXT_CHARS", "AgentsView"]


class AgentsView:
    """The agents ``agents`` (boot.xml's order) of ``store`` (its
    :class:`~agentserver.agents.store.base.ViewStore` role)."""

    def __init__(self, store: ViewStore, agents: tuple[str, ...]) -> None:
        self.store = store
        self.agents = agents

    async def reachable(self) -> bool:
        return await self.store.reachable()

    async def agent_list(self, names: tuple[str, ...] | list[str] | None = None) -> list[dict]:
        """Head state, active Turn, queue length and last error of each of ``names`` (all
        agents by default), in one read."""
        return await self.store.read(views.agents, self.agents if names is None else names)

    async def agent(self, name: str) -> dict[str, Any]:
        (one,) = await self.store.read(views.agents, [name])
        return one

    async def task(
        self, name: str, thread: str, sender: str | None = None
    ) -> dict[str, Any] | None:
        """The latest task of agent ``name`` sent on ``thread`` (the caller's thread, or
        the hop thread the agent was called on), of client ``sender`` if given: status,
        steps, usage. None if none."""
        return await self.store.read(views.task, name, thread, sender)

    async def task_reading(
        self, name: str, thread: str, sender: str | None = None
    ) -> dict[str, Any] | None:
        """What a person reads of that task (the web console), of client ``sender`` if
        given: its text, outcome, answer
        (:func:`agentserver.agents.store.sql.views.reading`). None if none."""
        return await self.store.read(views.task_reading, name, thread, sender)

    async def turn_thread(self, turn: str) -> tuple[str | None, str | None]:
        """(caller thread, hop thread) of the task a Turn runs, for event filtering."""
        return await self.store.read(views.turn_thread, turn)

    async def recent_tasks(
        self, name: str, limit: int = 20, sender: str | None = None
    ) -> list[dict[str, Any]]:
        """The newest ``limit`` tasks of agent ``name`` (only those ``sender`` sent, if
        given), newest first (the web console)."""
        return await self.store.read(views.recent_tasks, name, limit, sender)

    async def task_sender(
        self, name: str, thread: str, sender: str | None = None
    ) -> tuple[bool, str | None]:
        """Whether agent ``name`` has a task on ``thread`` (pruned ones count), and the
        client that sent it (None: none declared; ``sender`` when it sent one there): what
        the authorization rule reads."""
        return await self.store.read(views.task_sender, name, thread, sender)

    async def turn_task(self, turn: str) -> tuple[str | None, str | None, str | None]:
        """(caller thread, hop thread, sender) of the task a Turn runs (event filtering)."""
        return await self.store.read(views.turn_task, turn)

    async def turn_log(self, turn: str) -> dict[str, Any]:
        """A Turn's cards, governance decisions and approvals (the web console)."""
        return await self.store.read(views.turn_log, turn)

    async def pending_approvals(self) -> list[Any]:
        """Every approval request waiting for a decision, oldest first
        (:class:`~agentserver.agents.governance.approvals.PendingApproval`)."""
        return await self.store.read(governance.pending_approvals)
