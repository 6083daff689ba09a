"""The PostgreSQL backend of :class:`~agentserver.agents.store.sql_store.SqlAgentStore`.

Every store call is one transaction on the store's executor (:mod:`.trio_executor` on
the trio thread, or :mod:`.executor`'s worker threads: :func:`executor_class`); claims lock
with ``FOR UPDATE SKIP LOCKED`` so processes sharing the database take disjoint rows;
every Turn write is fenced by the head's epoch (the compare-and-set of ``agents/sql``),
so a process whose Turn was taken over writes nothing. Transactions that make work due
somewhere ``NOTIFY`` the other processes (:mod:`.notify`); the leases of
:mod:`.leases` give the Turns of a dead process to the living.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import trio

from agentserver.agents.clock import Clock, SystemClock
from agentserver.agents.doorbell import Doorbell
from agentserver.agents.errors import StaleTurn, StoreError
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.store.base import Claimed, LostCalls, PendingReply, TurnToken
from agentserver.agents.store.pg import callers, leases, one_trip_ends, one_trip_turn
from agentserver.agents.store.pg.executor import PgExecutor
from agentserver.agents.store.pg.notify import (
    CLIENT_REPLIES_CHANNEL,
    REPLIES_CHANNEL,
    WAKE_CHANNEL,
    PgListener,
    notify,
)
from agentserver.agents.store.pg.one_trip import Missed
from agentserver.agents.store.pg.schema import OWNER_SETTING, migrate_pg
from agentserver.agents.store.pg.trio_executor import PgTrioExecutor
from agentserver.agents.store.served import ServedVersions
from agentserver.agents.store.sql import (
    governance,
    inbox,
    multitask,
    replies,
    schedules,
    tools,
    turn_end,
    turns,
    versions,
    watchdog,
)
from agentserver.agents.store.sql.budgets import HoldFor
from agentserver.agents.store.sql.claims import TaskCheck
from agentserver.agents.store.sql.db import StoreEnv, StoreFn, Tx
from agentserver.agents.store.sql_store import SqlAgentStore

T = TypeVar("T")
P = ParamSpec("P")
log = logging.getLogger(__name__)


def executor_class(settings: StoreSettings) -> type[PgTrioExecutor] | type[PgExecutor]:
    """The one place the store's executor is chosen (``StoreSettings.pg_executor``): the
    trio thread's non-blocking pipelined one, or the worker threads' fallback."""
    return PgExecutor if settings.pg_executor == "thread" else PgTrioExecutor


#: Store functions after whose commit another process may have work to do, and the
#: channel that says so.
_NOTIFIES: dict[Callable[..., object], str] = {
    fn: WAKE_CHANNEL
    for fn in (
        inbox.enqueue_turn,
        multitask.enqueue_multitask,
        schedules.fire,
        inbox.report_tool_result,
        inbox.requeue_stuck,
        tools.suspend,
        tools.inject_timeouts,
        turn_end.finish,
        turn_end.fail_turn_row,
        turn_end.force_end,
        turns.retry_step,
        watchdog.recover_running,
        replies.cancel_queued,
        leases.reclaim,
    )
}
_NOTIFIES[replies.record_client_reply] = CLIENT_REPLIES_CHANNEL
# A reply kept again (taken for a connection that could not write it after all).
_NOTIFIES[replies.restore_client_reply] = CLIENT_REPLIES_CHANNEL

#: The hot store calls' PostgreSQL variants (agents/store/pg/one_trip.py): the one place the
#: store runs SQL of its own instead of the shared function (which a miss falls back to).
#: Keyed by function identity, so typed loosely: each variant returns what its function does.
ONE_TRIP: dict[Callable[..., object], Callable[..., Any]] = {
    inbox.enqueue_turn: one_trip_ends.enqueue_turn,
    inbox.report_tool_result: one_trip_ends.report_tool_result,
    turn_end.finish: one_trip_ends.finish,
    turns.start_turn_step: one_trip_turn.start_turn_step,
    turns.complete_step: one_trip_turn.complete_step,
    governance.complete_screened_step: one_trip_turn.complete_screened_step,
    tools.suspend: one_trip_turn.suspend,
    tools.apply_report: one_trip_turn.apply_report,
    tools.apply_tool_result: one_trip_turn.apply_tool_result,
}


def _notifying(tx: Tx, env: StoreEnv, channel: str, fn: Callable[..., T], *args: object) -> T:
    result = fn(tx, env, *args)
    notify(tx, channel)
    return result


def _bound(fn: Callable[..., T], kwargs: Mapping[str, object]) -> Callable[..., T]:
    """``fn`` with its named arguments bound: the executors pass arguments by position,
    and report a call by its function's name (which the bound call keeps)."""
    if not kwargs:
        return fn
    return functools.update_wrapper(functools.partial(fn, **kwargs), fn)


@functools.cache
def _signature(fn: Callable[..., object]) -> tuple[inspect.Signature, int]:
    """``fn``'s signature and how many arguments it takes after ``tx`` and ``env``."""
    sig = inspect.signature(fn)
    return sig, len(sig.parameters) - 2


def _positions(
    fn: Callable[..., object], args: tuple[object, ...], kwargs: Mapping[str, object]
) -> tuple[object, ...]:
    """The arguments of a call of ``fn`` (after ``tx`` and ``env``), every one by
    position: the named ones and the defaults put in their places."""
    sig, n = _signature(fn)
    if not kwargs and len(args) == n:
        return args
    bound = sig.bind(None, None, *args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.args[2:])


def _hand_over(tx: Tx, env: StoreEnv, agent_turn_id: str, process: str) -> bool:
    if callers.hand_over(tx, env, agent_turn_id, process):
        notify(tx, REPLIES_CHANNEL)
        return True
    return False


class PostgresAgentStore(SqlAgentStore):
    """The agent store on PostgreSQL. Create with :meth:`open`; close with :meth:`aclose`.
    ``owner`` identifies this process in the database (rows it owns, its lease)."""

    claim_lock = " FOR UPDATE SKIP LOCKED"
    #: Other processes use this store too: recovery at start must take over only the
    #: work of processes that are gone (their lease expired), never all of it.
    shared = True

    def __init__(
        self,
        executor: PgTrioExecutor | PgExecutor,
        clock: Clock,
        settings: StoreSettings,
        owner: str,
        *,
        tool_result_caps: Mapping[str, int] | None = None,
        served: ServedVersions | None = None,
    ) -> None:
        super().__init__(clock, settings, tool_result_caps, served)
        self.executor = executor
        self.owner = owner
        #: Rings when some process kept a reply for a named client (named_clients.py's
        #: forward_kept offers it to the connection this process holds, if any).
        self.client_replies = Doorbell()
        #: Rings when a reply may be waiting for an anonymous caller connected here
        #: (:mod:`.callers`; the runtime's ``answer_callers_here`` sends it).
        self.replies_here = Doorbell()
        #: Whether another process may be using the store: its lease was live at the
        #: last heartbeat, or a notification came (some process is there). While there
        #: is none, a transaction that makes work due rings this process's own
        #: doorbells after it commits instead of sending ``NOTIFY`` (a statement per
        #: write, and the notification's round trip back to this process's listener).
        self.others_alive = True
        #: channel → this process's own doorbell for it (set by :meth:`serve`)
        self._rings: dict[str, Callable[[], None]] = {}

    @classmethod
    def open(
        cls,
        url: str,
        *,
        clock: Clock | None = None,
        settings: StoreSettings | None = None,
        owner: str | None = None,
        tool_result_caps: Mapping[str, int] | None = None,
        served: ServedVersions | None = None,
    ) -> PostgresAgentStore:
        """Connect, then create or migrate the schema (StoreError if the server cannot be
        reached or the schema is newer than this code). Blocking, like opening the SQLite
        file: call once at start (or in a thread). ``tool_result_caps``: agent id → the
        most tokens one tool result is shown with."""
        settings = settings or StoreSettings(url=url)
        owner = owner or uuid.uuid4().hex
        executor = executor_class(settings).open_sync(
            url,
            pool_size=settings.pool_size,
            application_name=f"agentserver {owner[:8]}",
            options={OWNER_SETTING: owner},
        )
        store = cls(
            executor,
            clock or SystemClock(),
            settings,
            owner,
            tool_result_caps=tool_result_caps,
            served=served,
        )
        try:
            executor.run_sync(migrate_pg, store.env)
            # Its versions first seen before its lease names them (the newest is the
            # version first seen last: agents/store/sql/versions.py).
            for changed in executor.run_sync(versions.register, store.env):
                log.warning("%s", changed.text())
            # Registered before its first write: every row it owns has a live lease.
            others = executor.run_sync(leases.heartbeat, store.env, *store._lease_args())
            store.others_alive = others > 0
        except BaseException:
            executor.close()
            raise
        return store

    def _lease_args(self) -> tuple[str, float, str, int]:
        return (self.owner, self.settings.lease_s, socket.gethostname(), os.getpid())

    def close(self) -> None:
        """Release the lease (the others take over this process's Turns at once), close
        the connections. Blocking."""
        try:
            self.executor.run_sync(leases.release, self.env, self.owner)
        except StoreError as exc:
            log.warning("agent store: could not release the lease: %s", exc)
        self.executor.close()

    async def run(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        fast = ONE_TRIP.get(fn)
        if fast is None:
            return await self._transact(_bound(fn, kwargs), _NOTIFIES.get(fn), args)
        # The one-trip forms (and the executors) take their arguments by position: every
        # one, named or left to its default, in its place.
        at = _positions(fn, args, kwargs)
        channel = _NOTIFIES.get(fn)
        notifying = channel is not None and (self._rings.get(channel) is None or self.others_alive)
        try:
            result: T = await self.executor.run(fast, self.env, channel if notifying else None, *at)
        except Missed:
            pass  # rolled back: the shared function meets the miss (below)
        else:
            if channel is not None and not notifying:
                self._rings[channel]()
            return result
        return await self._transact(fn, channel, at)

    async def _transact(
        self, fn: Callable[..., T], channel: str | None, args: Sequence[object]
    ) -> T:
        """``fn(tx, env, *args)`` in one transaction, with ``channel``'s NOTIFY (or, alone
        on the store, this process's own ring after the commit)."""
        if channel is None:
            return await self.executor.run(fn, self.env, *args)
        ring = self._rings.get(channel)
        if ring is None or self.others_alive:
            return await self.executor.run(_notifying, self.env, channel, fn, *args)
        # Alone on the store: what the NOTIFY would do, without it (see others_alive).
        result = await self.executor.run(fn, self.env, *args)
        ring()
        return result

    async def read(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.executor.run_single(_bound(fn, kwargs), self.env, *args)

    async def run1(self, fn: StoreFn[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        if fn in _NOTIFIES:  # the NOTIFY must commit with the write
            return await self.run(fn, *args, **kwargs)
        return await self.executor.run_single(_bound(fn, kwargs), self.env, *args)

    async def claim_next(
        self,
        agent_id: str,
        max_steps: int,
        guardrails: bool,
        check: TaskCheck,
        hold_for: HoldFor | None = None,
    ) -> Claimed | None:
        """Only the claim (one statement, autocommit): the step after it is one round
        trip of its own (``ONE_TRIP``), which a shared transaction here would split into
        several. So no step is begun here, and no reservation taken with it
        (``hold_for``): the step's first call reserves by itself."""
        rows = await self.run1(inbox.claim_due, agent_id, 1)
        return Claimed(rows[0]) if rows else None

    async def pending_replies_here(self, limit: int = 256) -> list[PendingReply]:
        """The pending replies whose anonymous caller is connected to this process."""
        return await self.read(callers.pending_here, self.owner, limit)

    async def hand_over_reply(self, agent_turn_id: str, process: str) -> bool:
        """Leave a reply for its caller's process ``process`` and ring it (True), or give
        it up if that process is gone (False)."""
        return await self.executor.run(_hand_over, self.env, agent_turn_id, process)

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self.close)

    async def recover_running(self, lost_calls: LostCalls | None = None) -> list[TurnToken]:
        """Before this process's worker runs: recover its own running Turns and take over
        those of processes whose lease expired (e.g. this server's previous run); never
        those of a live process. Their suspended Turns' calls go to ``lost_calls``."""
        return await self.reclaim(lost_calls, mine=True)

    async def reclaim(
        self, lost_calls: LostCalls | None = None, *, mine: bool = False
    ) -> list[TurnToken]:
        """One round of :func:`leases.reclaim` (``mine``: this process's work too); the
        dead processes' suspended Turns' tool calls handed to ``lost_calls`` (the agent
        runtime's: re-sent to idempotent listeners), or with None all reported lost
        (timeouts). Returns the recovered running Turns."""
        got = await self.run(leases.reclaim, 8, self.owner if mine else None)
        if got.recovered or got.suspended or got.requeued:
            log.warning(
                "agent store: took over from %d stopped process(es): %d running turn(s) "
                "recovered, %d suspended, %d inbox row(s) requeued",
                len(got.owners),
                len(got.recovered),
                len(got.suspended),
                got.requeued,
            )
        for token in got.suspended:
            reason = "was lost with the process that sent it"
            try:
                if lost_calls is not None:
                    await lost_calls(token, reason)
                else:
                    await self.run(tools.inject_timeouts, token, reason)
            except StaleTurn:
                continue
        return got.recovered

    async def serve(
        self,
        doorbell: Doorbell,
        lost_calls: LostCalls | None = None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Until cancelled: ring ``doorbell`` when another process (or this one) makes work
        due, and at least every second; renew this process's lease every heartbeat and
        take over the work of processes whose lease expired (their suspended Turns'
        calls handed to ``lost_calls``, :meth:`reclaim`)."""
        rings = {
            WAKE_CHANNEL: doorbell.ring,
            CLIENT_REPLIES_CHANNEL: self.client_replies.ring,
            REPLIES_CHANNEL: self.replies_here.ring,
        }
        listener = PgListener(
            self.executor.url,
            {channel: functools.partial(self._heard, ring) for channel, ring in rings.items()},
            on_poll=rings.values(),
        )
        self._rings = rings
        async with trio.open_nursery() as nursery:
            await nursery.start(listener.run)
            nursery.start_soon(self._keep_lease, doorbell, lost_calls)
            task_status.started()

    async def announce(self) -> None:
        """Renew the lease now, with the versions served and whether this process drains
        (``env.served``): the others stop routing new work here at once."""
        others = await self.executor.run(leases.heartbeat, self.env, *self._lease_args())
        self.others_alive = others > 0

    def _heard(self, ring: Callable[[], None]) -> None:
        # A notification: another process is there (this one sends none while alone).
        self.others_alive = True
        ring()

    async def _keep_lease(self, doorbell: Doorbell, lost_calls: LostCalls | None) -> None:
        while True:
            await trio.sleep(self.settings.heartbeat_s)
            try:
                others = await self.executor.run(leases.heartbeat, self.env, *self._lease_args())
                self.others_alive = others > 0
                if await self.reclaim(lost_calls):
                    doorbell.ring()
            except StoreError as exc:
                # The database is unreachable: keep trying; if the lease runs out
                # meanwhile, another process takes these Turns over (and fences them).
                log.warning("agent store: heartbeat failed: %s", exc)
