"""The store's budget calls (:class:`BudgetStore`), mixed into ``SqlAgentStore``: each one
function of ``agents/store/sql/budgets.py`` in one transaction of the backend."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

from agentserver.agents.store.outbox import OutboxItem
from agentserver.agents.store.sql import budgets as sql
from agentserver.agents.store.sql.budgets import HoldOwner, Override, PeriodRow, SpendRow
from agentserver.agents.store.sql.db import StoreFn

T = TypeVar("T")
P = ParamSpec("P")


class BudgetStore(abc.ABC):
    """Budget rows and holds. Every method is one transaction (``reserve`` on
    PostgreSQL one statement); a cancel before it commits leaves nothing written.
    ``SqlAgentStore`` supplies ``_run`` and ``_read`` (its ``run`` and ``read``); these
    methods are to become ``store.run(budgets.fn, ...)`` calls too."""

    @abc.abstractmethod
    async def _run(self, fn: StoreFn[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(tx, env, *args)`` in one write transaction of the backend."""

    @abc.abstractmethod
    async def _read(self, fn: StoreFn[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(tx, env, *args)`` in one read-only transaction of the backend."""

    async def budget_ensure(self, rows: Sequence[PeriodRow]) -> list[Override]:
        """The rows created if missing (with the overrides' limits); every override."""
        return await self._run(sql.ensure_rows, list(rows))

    async def budget_reserve(
        self,
        keys: Sequence[str],
        tokens: int,
        cost: float,
        hold_id: str,
        expires_at: float,
        owner: HoldOwner | None = None,
    ) -> bool:
        """Hold the worst case in every row or none; ``owner``: the Turn's step the hold
        belongs to (released when that run is fenced out)."""
        return await self._run(sql.reserve, list(keys), tokens, cost, hold_id, expires_at, owner)

    async def budget_refused(
        self, keys: Sequence[str], tokens: int, cost: float
    ) -> SpendRow | None:
        """The refusal counted; the first row without room, as it stands (or None)."""
        return await self._run(sql.refused, list(keys), tokens, cost)

    async def budget_settle(
        self,
        hold_id: str,
        keys: Sequence[str],
        tokens: int,
        cost: float,
        events: Callable[[list[SpendRow]], Sequence[OutboxItem]] | None = None,
    ) -> list[SpendRow]:
        """Settle a hold; ``events``: the crossed rows' outbox rows, in the same
        transaction (pure: it runs in the backend's transaction)."""
        return await self._run(sql.settle, hold_id, list(keys), tokens, cost, events)

    async def budget_release(self, hold_id: str) -> None:
        await self._run(sql.release, hold_id)

    async def budget_release_expired(self) -> int:
        return await self._run(sql.release_expired)

    async def budget_rows(self, keys: Sequence[str]) -> list[SpendRow]:
        """The rows of ``keys`` (row keys: ``row_key(budget, period_start)``)."""
        return await self._read(sql.rows_of, list(keys))

    async def budget_set(self, override: Override, row: PeriodRow) -> None:
        """The budget's override stored and its current row's limits changed, together."""
        await self._run(sql.set_budget, override, row)

    async def budget_reset(self, key: str) -> None:
        await self._run(sql.reset, key)
