"""The backend-neutral agent store: :class:`SqlAgentStore` runs any
:mod:`agentserver.agents.store.sql` function (``fn(tx, env, *args)``) in one transaction
of its backend, typed end to end: ``await store.run(turns.complete_step, token, ...)``
checks the arguments against the function's signature. The SQL modules are the store's
API; there is no method per call.

The entry points: :meth:`SqlAgentStore.run` (one transaction: it commits, or rolls back
and re-raises), :meth:`SqlAgentStore.read` (a call that writes nothing: the backend may
skip the transaction) and :meth:`SqlAgentStore.run1` (a call that runs exactly one
statement: the backend may run it in autocommit). A backend supplies them (``run``
at least) and :meth:`SqlAgentStore.aclose`; PostgreSQL's ``run`` takes the one-trip form
of a hot call where it has one (``pg/store.py``'s ``ONE_TRIP``). What is still a method
here differs between the backends (``claim_next``, ``recover_running``) or is not one
store function (``reachable``, the pruner's page and WAL hooks).
"""

from __future__ import annotations

import abc
import sqlite3
from collections.abc import Mapping
from typing import ParamSpec, TypeVar

from agentserver.agents.clock import Clock
from agentserver.agents.errors import StoreError
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import Claimed, LostCalls, TurnToken
from agentserver.agents.store.served import ServedVersions
from agentserver.agents.store.sql import claims, views, watchdog
from agentserver.agents.store.sql.budgets import HoldFor
from agentserver.agents.store.sql.db import StoreEnv, StoreFn

T = TypeVar("T")
P = ParamSpec("P")


class SqlAgentStore(abc.ABC):
    """The store's calls over a backend's transactions (see the module docstring). A
    backend supplies :meth:`run` and :meth:`aclose`; it cannot be instantiated without."""

    def __init__(
        self,
        clock: Clock,
        settings: StoreSettings,
        tool_result_caps: Mapping[str, int] | None = None,
        served: ServedVersions | None = None,
    ) -> None:
        self.env = StoreEnv(
            clock, settings, dict(tool_result_caps or {}), served or ServedVersions()
        )
        self.settings = settings

    @property
    def _clock(self) -> Clock:
        return self.env.clock

    @property
    def tool_result_caps(self) -> dict[str, int]:
        """agent id → the most tokens one tool result is shown with (given at creation)."""
        return self.env.tool_result_caps

    # -- the entry points (the backend's) ---------------------------------------------------
    @abc.abstractmethod
    async def run(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Call ``fn(tx, env, *args, **kwargs)`` in one transaction; commit, or roll back
        and raise."""

    async def read(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """A call that writes nothing (the backend may skip the transaction)."""
        return await self.run(fn, *args, **kwargs)

    async def run1(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """A call that runs exactly one statement, so it is atomic by itself (the backend
        may run it in autocommit, saving the ``BEGIN``/``COMMIT`` round trips)."""
        return await self.run(fn, *args, **kwargs)

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the backend's connections (and, for SQLite, the file's lock)."""

    # -- what differs between the backends --------------------------------------------------
    async def claim_next(
        self,
        agent_id: str,
        max_steps: int,
        guardrails: bool,
        check: claims.TaskCheck,
        hold_for: HoldFor | None = None,
    ) -> Claimed | None:
        """Claim the agent's next due row and take its first step in the same
        transaction (:func:`~agentserver.agents.store.sql.claims.claim_next`; PostgreSQL
        only claims, returning a bare :class:`Claimed`), with the step's first model
        call's reservation when ``hold_for`` asks for one. Raises what the step raises,
        with nothing claimed."""
        return await self.run(claims.claim_next, agent_id, max_steps, guardrails, check, hold_for)

    async def recover_running(self, lost_calls: LostCalls | None = None) -> list[TurnToken]:
        """Recover the running Turns left by a restart; a shared store also takes over
        a dead process's work, handing its suspended Turns' calls to ``lost_calls``
        (None: they are all reported lost). Unused here: one process, none to take over."""
        return await self.run(watchdog.recover_running)

    async def announce(self) -> None:
        """Tell the other processes what this one serves: nothing to do alone (SQLite)."""
        return None

    async def reachable(self) -> bool:
        """Whether the store answers a query now (``/readyz``)."""
        try:
            await self.read(views.ping)
        except (StoreError, sqlite3.Error):
            return False
        return True

    async def reclaim_pages(self, max_pages: int) -> int:
        """Give up to ``max_pages`` free pages back to the file system; how many went.
        Only SQLite with ``auto_vacuum=INCREMENTAL`` has any (PostgreSQL leaves bloat to
        autovacuum): 0 here."""
        return 0

    async def checkpoint_after_prune(self) -> None:
        """After a prune run: copy the write-ahead log back so it can start over (SQLite,
        :class:`~agentserver.agents.store.sqlite_store.SqliteAgentStore`). PostgreSQL's
        WAL is the server's own business: nothing here."""
        return None
