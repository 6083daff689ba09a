"""The agent store's protocols: :class:`StoreCalls`, the typed entry points every store
call goes through, and the few roles that add what is not one store function.

A store call is one function of :mod:`agentserver.agents.store.sql` (or of
:mod:`.outbox`, :mod:`.webhook_rows`, :mod:`.step_log`), run by the store:
``await store.run(turns.complete_step, token, step_id, completion, cards)`` in one
transaction, ``store.read(...)`` for a call that writes nothing, ``store.run1(...)`` for a
call of one statement. The checker matches the arguments to the function's signature
(:data:`~agentserver.agents.store.sql.db.StoreFn`). The roles: the worker's Turn
(:class:`TurnStore`), replies handed between processes (:class:`ReplyStore`), restart
recovery (:class:`WatchdogStore`), named clients' doorbell (:class:`ClientReplyStore`),
the readiness probe (:class:`ViewStore`) and the store's life in the process
(:class:`StoreLifecycle`, with the capabilities that differ between one process and
several on a shared store). The composition root (the runtime) holds :class:`AgentStore`;
both backends (``sqlite_store.SqliteAgentStore``, ``pg.store.PostgresAgentStore``)
satisfy it whole.

Every call is one atomic transaction: it either commits fully or raises with nothing
written. Calls that act on a Turn take a :class:`TurnToken` and perform a
compare-and-set on the head (``agent_id`` + ``active_agent_turn_id`` + ``turn_epoch`` +
expected status); when it matches no row they raise
:class:`~agentserver.agents.errors.StaleTurn` and write nothing, including cards. Calls
are ``async`` so a networked store (PostgreSQL) can implement the same interface; the
SQLite store runs its short transactions inline on the trio thread. A cancelled call
commits nothing, or all of it (a cancel that lands while ``COMMIT`` is in flight).

The row types are in :mod:`.rows`, re-exported here under the names the package has
always imported them by.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ParamSpec, Protocol, TypeVar

import trio

from agentserver.agents.doorbell import Doorbell
from agentserver.agents.store.rows import BoxSwap as BoxSwap
from agentserver.agents.store.rows import Card as Card
from agentserver.agents.store.rows import CardType as CardType
from agentserver.agents.store.rows import Claimed as Claimed
from agentserver.agents.store.rows import ClientReply as ClientReply
from agentserver.agents.store.rows import DoubleText as DoubleText
from agentserver.agents.store.rows import EnqueueResult as EnqueueResult
from agentserver.agents.store.rows import Finished as Finished
from agentserver.agents.store.rows import Fired as Fired
from agentserver.agents.store.rows import Head as Head
from agentserver.agents.store.rows import InboxRow as InboxRow
from agentserver.agents.store.rows import MultitaskAnswers as MultitaskAnswers
from agentserver.agents.store.rows import NewCard as NewCard
from agentserver.agents.store.rows import PendingReply as PendingReply
from agentserver.agents.store.rows import ReportOutcome as ReportOutcome
from agentserver.agents.store.rows import ScheduleRow as ScheduleRow
from agentserver.agents.store.rows import StepStart as StepStart
from agentserver.agents.store.rows import TaskStatus as TaskStatus
from agentserver.agents.store.rows import ToolCallRecord as ToolCallRecord
from agentserver.agents.store.rows import TurnToken as TurnToken
from agentserver.agents.store.rows import caller_key as caller_key
from agentserver.agents.store.sql.budgets import HoldFor as HoldFor
from agentserver.agents.store.sql.budgets import Spend as Spend
from agentserver.agents.store.sql.db import StoreFn

#: What a shared store does with the calls of a dead process's suspended Turn
#: (``await lost(token, reason)``: the runtime's ``lost_calls``), handed to the store's
#: :meth:`~StoreLifecycle.serve` and ``recover_running`` by the runtime that runs them.
LostCalls = Callable[[TurnToken, str], Awaitable[int]]

T = TypeVar("T")
P = ParamSpec("P")


class StoreCalls(Protocol):
    """The store's typed entry points: ``fn(tx, env, *args, **kwargs)`` of a store
    function, run by the backend (see the module docstring)."""

    async def run(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """In one transaction: it commits, or rolls back and raises."""
        ...

    async def read(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """A call that writes nothing (the backend may skip the transaction)."""
        ...

    async def run1(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """A call of exactly one statement (the backend may run it in autocommit)."""
        ...


class TurnStore(StoreCalls, Protocol):
    """The worker's Turn: claims, steps, tool waits, its own end (the worker, its model
    step and tool dispatch, the compactor)."""

    @property
    def others_alive(self) -> bool:
        """Whether another process may be using the store now (a Turn's end taken there
        must be watched for during a model call); always False on SQLite."""
        ...

    async def claim_next(
        self,
        agent_id: str,
        max_steps: int,
        guardrails: bool,
        check: Callable[[InboxRow], str | None],
        hold_for: HoldFor | None = None,
    ) -> Claimed | None:
        """Claim the agent's next due row and take its first step in the same
        transaction (:func:`~agentserver.agents.store.sql.claims.claim_next`; a backend
        may only claim, returning a bare :class:`Claimed`). Raises what the step
        raises, with nothing claimed."""
        ...


class ReplyStore(StoreCalls, Protocol):
    """A Turn's end from outside (stop, watchdog) and the reply outbox (the Turn's
    ender): replies sent, retried, handed to the process that holds the caller."""

    @property
    def replies_here(self) -> Doorbell | None:
        """Rings when a reply may be waiting for an anonymous caller connected here
        (:meth:`pending_replies_here`); None on SQLite, where every reply is this
        process's."""
        ...

    async def hand_over_reply(self, agent_turn_id: str, process: str) -> bool:
        """Leave a reply for its caller's process ``process`` and ring it (True), or give
        it up if that process is gone (False; always, on SQLite: one process)."""
        ...

    async def pending_replies_here(self, limit: int = 256) -> list[PendingReply]:
        """The pending replies other processes left for the anonymous callers connected
        to this one (none on SQLite)."""
        ...


class WatchdogStore(StoreCalls, Protocol):
    """The watchdog and restart recovery: stuck rows, deadlines, lost tool calls, the
    calls to idempotent listeners sent again, replies left unsent."""

    async def recover_running(self, lost_calls: LostCalls | None = None) -> list[TurnToken]:
        """Recover the running Turns left by a restart; a shared store also takes over
        a dead process's work, handing its suspended Turns' calls to ``lost_calls``
        (None: they are all reported lost)."""
        ...


class ClientReplyStore(StoreCalls, Protocol):
    """Named clients' durable replies: kept until the client acknowledges them."""

    @property
    def client_replies(self) -> Doorbell | None:
        """Rings when some process kept a reply for a named client (None on SQLite: only
        this process keeps them, and it offers them itself)."""
        ...


class ViewStore(StoreCalls, Protocol):
    """Read-only views (HTTP API, metrics, replay's record) and the runner step log."""

    async def reachable(self) -> bool:
        """Whether the store answers a query now (``/readyz``)."""
        ...


class StoreLifecycle(StoreCalls, Protocol):
    """The store's life in this process, and what differs when several processes share
    it (PostgreSQL) from one process owning it (SQLite, which answers the one-process
    values: not shared, nobody else alive, nothing handed over)."""

    @property
    def shared(self) -> bool:
        """Other processes may use this store: recovery at start takes over only the work
        of processes that are gone, and a caller's reply names the process that holds
        the caller's connection."""
        ...

    @property
    def owner(self) -> str:
        """This process's id in the store (the rows it owns, its lease on a shared
        store)."""
        ...

    async def serve(
        self,
        doorbell: Doorbell,
        lost_calls: LostCalls | None = None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The store's own background work until cancelled (PostgreSQL: rings from other
        processes, the lease, and the takeover of a dead process's work, whose suspended
        Turns' calls go to ``lost_calls`` (None: all reported lost); SQLite: WAL
        checkpoints off the trio thread, ``lost_calls`` unused: no other process can
        die)."""
        ...

    async def announce(self) -> None:
        """Tell the other processes now what this one serves and whether it drains
        (PostgreSQL: its lease row, at once rather than at the next heartbeat; SQLite:
        nothing, no other process)."""
        ...

    async def aclose(self) -> None: ...


class AgentStore(
    TurnStore,
    ReplyStore,
    WatchdogStore,
    ClientReplyStore,
    ViewStore,
    StoreLifecycle,
    Protocol,
):
    """The whole store, every role: what the composition root (the runtime) holds and
    hands out by role; see the module docstring for the guarantees."""
