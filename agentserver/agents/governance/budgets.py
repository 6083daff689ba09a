"""Spend budgets as applied: each model call reserves its worst case in every budget it
pays into before it is made, and settles to the reported usage when it returns
(docs/budgets.md).

:class:`Budgets` holds the declared budgets (changed at run time by ``PUT /v1/budgets``)
and talks to the store; :class:`BudgetedLLM` wraps the worker's LLM port for one Turn's
calls. A refused reservation raises :class:`BudgetSpent`, whose text is the stable reason
the Turn ends ``failed`` with. Without any declared budget none of this is built: a Turn
pays nothing.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

import trio

from agentserver.agents.clock import Clock
from agentserver.agents.events import BudgetEvent, EventBus
from agentserver.agents.policy.budget import (
    BudgetSpec,
    Need,
    Shortfall,
    applicable,
    period_bounds,
    refusal_text,
)
from agentserver.agents.ports import LLMCompletion, LLMPort, LLMRequest
from agentserver.agents.profile.agent import DEFAULT_MAX_OUTPUT
from agentserver.agents.store.base import StoreCalls
from agentserver.agents.store.outbox import OutboxItem
from agentserver.agents.store.sql import budgets as sql_budgets
from agentserver.agents.store.sql.budgets import (
    HoldOwner,
    HoldRequest,
    Override,
    PeriodRow,
    Spend,
    SpendRow,
    StepHold,
    row_key,
)
from agentserver.llm.tokens import PER_REQUEST, estimate_message_tokens
from agentserver.observability.tracing import annotate_current

log = logging.getLogger(__name__)

__all__ = [
    "BudgetSpent",
    "BudgetedLLM",
    "Budgets",
    "Hold",
    "HoldOwner",
    "Spend",
    "WorstPrice",
    "spent",
]


class BudgetSpent(Exception):
    """A reservation was refused: ``str(exc)`` is the stable reason (budget and reset)."""

    def __init__(self, reason: str, budget: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.budget = budget


def shortfall(row: SpendRow, need: Need) -> Shortfall:
    """Which of ``row``'s limits the call's worst case ``need`` did not fit, and what
    remained of it (tokens first)."""
    if row.limit_tokens is not None and (
        row.spent_tokens + row.reserved_tokens + need.tokens > row.limit_tokens
    ):
        left = row.limit_tokens - row.spent_tokens - row.reserved_tokens
        return Shortfall(need.tokens, max(left, 0), "tokens")
    left_cost = (row.limit_cost or 0.0) - row.spent_cost - row.reserved_cost
    return Shortfall(need.cost, max(left_cost, 0.0), "cost")


def soft_event(agent: str, turn: str | None, r: SpendRow) -> BudgetEvent:
    """The ``budget.soft`` event of row ``r`` crossing its mark on ``agent``'s call."""
    return BudgetEvent(
        agent,
        turn,
        r.budget,
        r.period,
        r.period_start,
        r.spent_tokens,
        r.spent_cost,
        r.limit_tokens,
        r.limit_cost,
    )


@dataclass(frozen=True, slots=True)
class WorstPrice:
    """The highest prices per million tokens of any backend (a call is reserved at the
    price of the dearest backend it could land on)."""

    input_per_million: float = 0.0
    output_per_million: float = 0.0

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (
            prompt_tokens * self.input_per_million + completion_tokens * self.output_per_million
        ) / 1_000_000


@dataclass(slots=True)
class _SoftMarks:
    """The outbox rows of the ``budget.soft`` events a settle's crossed marks raise,
    rendered in its transaction (the mark and its event's rows commit together,
    docs/webhooks.md; pure: it runs off trio). :attr:`written`: some were."""

    render: Callable[[BudgetEvent], Sequence[OutboxItem]]
    agent: str
    turn: str | None
    written: bool = False

    def event(self, r: SpendRow) -> BudgetEvent:
        return soft_event(self.agent, self.turn, r)

    def __call__(self, crossed: list[SpendRow]) -> Sequence[OutboxItem]:
        out = [item for r in crossed for item in self.render(self.event(r))]
        self.written = bool(out)
        return out


def spent(events: EventBus | None, spends: Sequence[Spend]) -> None:
    """``spends`` committed (with a step's results, or by themselves): marked so, and
    ``budget.soft`` published for each mark they crossed (their outbox rows, if any,
    committed with them). Call it as soon as the transaction returns."""
    for s in spends:
        s.committed = True
        if events is not None and isinstance(s.events, _SoftMarks):
            for r in s.crossed:
                events.publish(s.events.event(r), written=s.events.written)


@dataclass(frozen=True, slots=True)
class Hold:
    """One call's reservation: its id, the rows it holds and its worst case."""

    hold_id: str
    keys: tuple[str, ...]
    need: Need
    budgets: tuple[str, ...]


#: A hold outlives its call's timeout by this much before the watchdog may release it.
HOLD_MARGIN_S = 10.0


class Budgets:
    """The declared budgets and their reservations (one per server process)."""

    def __init__(
        self,
        store: StoreCalls,
        clock: Clock,
        specs: Sequence[BudgetSpec],
        *,
        price: WorstPrice | None = None,
        events: EventBus | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.specs: dict[str, BudgetSpec] = {s.name: s for s in specs}
        self.price = price or WorstPrice()
        self.events = events
        #: Row keys this process has made sure exist (a new period adds one statement).
        self._ensured: set[str] = set()
        #: Each budget's current row, with the spec it was made of (one per declared
        #: budget).
        self._current: dict[str, tuple[BudgetSpec, PeriodRow]] = {}
        #: Refusals seen by this process, by budget (for the metrics).
        self.refusals: dict[str, int] = {}
        #: Every budget's current row as last read by :meth:`run` (None: not yet, or the
        #: store failing), for the metrics: a scrape never waits on the store.
        self.snapshot: list[SpendRow] | None = None

    async def run(self, period_s: float = 5.0) -> None:
        """Refresh :attr:`snapshot` every ``period_s`` until cancelled (a failed read
        drops the snapshot until one succeeds)."""
        while True:
            try:
                self.snapshot = await self.rows()
            except Exception as exc:
                if self.snapshot is not None:
                    log.warning("budget figures unavailable: %s", exc)
                self.snapshot = None
            await trio.sleep(period_s)

    # -- the call's side --------------------------------------------------------------
    def need(self, request: LLMRequest) -> Need:
        """The worst case of ``request``: its counted prompt plus ``max_tokens``, priced
        at the dearest backend's prices."""
        prompt = PER_REQUEST + sum(estimate_message_tokens(m.content) for m in request.messages)
        out = request.max_tokens or DEFAULT_MAX_OUTPUT
        return Need(prompt + out, self.price.cost(prompt, out))

    def _rows(self, names: Sequence[str], now: float) -> list[PeriodRow]:
        return [self._row_of(self.specs[name], now) for name in names]

    def _row_of(self, s: BudgetSpec, now: float) -> PeriodRow:
        """``s``'s row of the period holding ``now`` (kept while ``now`` is in it: the
        period's bounds are worked out once per period, not per call)."""
        kept = self._current.get(s.name)
        if kept is not None and kept[0] is s and kept[1].start <= now < kept[1].end:
            return kept[1]
        start, end = period_bounds(s.period, s.timezone, now)
        row = PeriodRow(s.name, s.period, start, end, s.tokens, s.cost, s.soft, s.timezone)
        self._current[s.name] = (s, row)
        return row

    def _adopt(self, overrides: Sequence[Override]) -> None:
        """The budgets changed at run time (by any process) replace this process's."""
        for o in overrides:
            old = self.specs.get(o.budget)
            try:
                spec = BudgetSpec(
                    o.budget,
                    o.limit_tokens,
                    o.limit_cost,
                    o.period,
                    o.soft,
                    o.timezone,
                    old.line if old is not None else 0,
                )
            except ValueError as exc:  # (written by set(), so valid; never trusted blindly)
                log.warning("budget override %s ignored: %s", o.budget, exc)
                continue
            if spec != old:
                self.specs[o.budget] = spec

    async def _open(self, names: Sequence[str], now: float) -> list[PeriodRow]:
        """The current rows of ``names``; those this process has not opened yet are
        created (one store call, which also reads the run-time overrides and adopts them;
        a second one only if an override moved a period's bounds). Cancelled: nothing
        this process remembers changes before the store call returns."""
        rows = self._rows(names, now)
        missing = [r for r in rows if r.key not in self._ensured]
        if not missing:
            return rows
        self._adopt(await self.store.run(sql_budgets.ensure_rows, missing))
        self._ensured.update(r.key for r in missing)
        names = [n for n in names if n in self.specs]
        rows = self._rows(names, now)
        missing = [r for r in rows if r.key not in self._ensured]
        if missing:  # an override changed the period or the time zone
            self._adopt(await self.store.run(sql_budgets.ensure_rows, missing))
            self._ensured.update(r.key for r in missing)
        return rows

    async def reserve(
        self,
        agent: str,
        client: str | None,
        need: Need,
        timeout_s: float,
        owner: HoldOwner | None = None,
    ) -> Hold | None:
        """Hold ``need`` in every budget the call pays into (None: none applies). Raises
        :class:`BudgetSpent` when one has no room; one store statement otherwise (two at
        the first call of a period). Cancelled before it commits: nothing is held.
        ``owner``: the Turn's step making the call; its hold is released when that run
        of the Turn is fenced out (a dead process's), else only at its expiry."""
        names = applicable(frozenset(self.specs), agent, client)
        if not names:
            return None
        now = self.clock.now()
        rows = await self._open(names, now)
        keys = tuple(r.key for r in rows)
        hold_id = uuid.uuid4().hex
        expires = now + timeout_s + HOLD_MARGIN_S
        if await self.store.run(
            sql_budgets.reserve, keys, need.tokens, need.cost, hold_id, expires, owner
        ):
            self._annotate(hold_id, names, need)
            return Hold(hold_id, keys, need, tuple(names))
        full = await self.store.run(sql_budgets.refused, keys, need.tokens, need.cost)
        by_key = {r.key: r for r in rows}
        row = by_key.get(row_key(full.budget, full.period_start) if full else "", rows[0])
        self.refusals[row.budget] = self.refusals.get(row.budget, 0) + 1
        annotate_current({"agentserver.budget.refused": row.budget})
        text = refusal_text(
            row.budget, row.period, row.end, shortfall(full, need) if full else None
        )
        raise BudgetSpent(text, row.budget)

    def spend(
        self, hold: Hold, completion: LLMCompletion | None, *, agent: str, turn: str | None
    ) -> Spend:
        """What settling ``hold`` writes: what the call reported (its worst case if it
        reported no usage, never zero), and the ``budget.soft`` outbox rows of the marks
        it crosses. No I/O: the caller writes it, by itself (:meth:`settle`) or with the
        step's results (``spends=``), then calls :func:`spent`."""
        tokens, cost = hold.need.tokens, hold.need.cost
        if completion is not None and not completion.usage.estimated:
            u = completion.usage
            used = u.total_tokens or (u.prompt_tokens + u.completion_tokens)
            if used > 0:
                tokens, cost = used, completion.cost
        marks = None
        if self.events is not None:
            marks = _SoftMarks(self.events.outbox_render(), agent, turn)
        return Spend(hold.hold_id, hold.keys, tokens, cost, marks)

    def hold_request(
        self, agent: str, client: str | None, need: Need, timeout_s: float, owner: HoldOwner
    ) -> HoldRequest | None:
        """``need`` as a reservation the transaction opening a step takes with it
        (``agents/store/sql/budgets.py`` ``hold_step``): None when no budget applies, or
        when this process has not opened one of their current periods yet (the call then
        reserves by itself, opening it). Pure, no I/O."""
        names = applicable(frozenset(self.specs), agent, client)
        if not names:
            return None
        now = self.clock.now()
        keys = tuple(r.key for r in self._rows(names, now))
        if not self._ensured.issuperset(keys):
            return None
        expires = now + timeout_s + HOLD_MARGIN_S
        return HoldRequest(keys, need.tokens, need.cost, uuid.uuid4().hex, expires, owner)

    def taken(self, req: HoldRequest, agent: str, client: str | None) -> Hold:
        """The hold a step's transaction took (:meth:`hold_request`, granted), as a
        reservation this process made (its span carries it as :meth:`reserve`'s)."""
        names = applicable(frozenset(self.specs), agent, client)
        self._annotate(req.hold_id, names, Need(req.tokens, req.cost))
        return Hold(req.hold_id, req.keys, Need(req.tokens, req.cost), tuple(names))

    @staticmethod
    def _annotate(hold_id: str, names: Sequence[str], need: Need) -> None:
        # The span of the Turn's run carries its reservations (the last one's).
        annotate_current(
            {
                "agentserver.budget.hold": hold_id,
                "agentserver.budget.names": ",".join(names),
                "agentserver.budget.reserved_tokens": need.tokens,
                "agentserver.budget.reserved_cost": need.cost,
            }
        )

    async def settle(
        self, hold: Hold, completion: LLMCompletion | None, *, agent: str, turn: str | None
    ) -> None:
        """Settle ``hold`` by itself (:meth:`spend`, one transaction), and publish the
        marks it crossed. Shielded: a cancel arriving now cannot leak the hold."""
        await self.settle_spends([self.spend(hold, completion, agent=agent, turn=turn)])

    async def settle_spends(self, spends: Sequence[Spend]) -> None:
        """Those of ``spends`` not committed yet, each written in a transaction of its
        own (no step's results carried them: a step that failed after its calls, a run
        fenced out before its step was written), then published. Shielded, as
        :meth:`settle`; a spend whose transaction fails is left to the watchdog (its
        hold is released once its run is over: nothing spent)."""
        left = [s for s in spends if not s.committed]
        with trio.CancelScope(shield=True):
            for s in left:
                s.crossed = await self.store.run(
                    sql_budgets.settle, s.hold_id, s.keys, s.tokens, s.cost, s.events
                )
                spent(self.events, [s])

    async def release(self, hold: Hold) -> None:
        """The hold given back (failure, timeout, cancel). Shielded; a store failure is
        logged and left to the watchdog (the hold expires)."""
        with trio.CancelScope(shield=True):
            try:
                await self.store.run(sql_budgets.release, hold.hold_id)
            except Exception:
                log.exception("budget hold %s not released; the watchdog will", hold.hold_id)

    def port(
        self,
        llm: LLMPort,
        agent: str,
        client: str | None,
        turn: str | None,
        timeout_s: float,
        owner: HoldOwner | None = None,
        defer: list[Spend] | None = None,
        first: StepHold | None = None,
    ) -> LLMPort:
        """``llm`` with every call reserved and settled in the budgets of ``agent`` and
        ``client`` (``llm`` itself when none applies). ``timeout_s``: the bound of one
        call, which a hold's expiry exceeds by :data:`HOLD_MARGIN_S`. ``owner``: the
        Turn's step whose calls these are (their holds belong to it). ``defer``: a
        call that returns is not settled but its :meth:`spend` appended there, for the
        caller to write with the step's results. ``first``: the reservation the step's
        transaction took for its first call (used by that call if it covers its worst
        case; else given back, and the call reserves by itself)."""
        if not applicable(frozenset(self.specs), agent, client):
            return llm
        return BudgetedLLM(llm, self, agent, client, turn, timeout_s, owner, defer, first)

    # -- the operator's side ----------------------------------------------------------
    async def release_expired(self) -> int:
        """The watchdog's pass: holds of Turn runs that are over (a dead process's,
        fenced out) and expired holds released."""
        return await self.store.run(sql_budgets.release_expired)

    async def rows(self) -> list[SpendRow]:
        """Each declared budget's current period (created if this is its first look)."""
        now = self.clock.now()
        rows = await self._open(sorted(self.specs), now)
        if len(rows) < len(self.specs):  # another process declared one at run time
            rows = await self._open(sorted(self.specs), now)
        return await self.store.read(sql_budgets.rows_of, [r.key for r in rows])

    async def set(self, spec: BudgetSpec) -> None:
        """Declare or change ``spec`` at run time, durably: stored as the budget's
        override (every process, this one after a restart included, opens the budget's
        next periods with it) and applied to its current period's row (every process's
        reservations check it at once). One store transaction; cancelled before it
        commits, nothing changes, here or in the store."""
        row = self._row_of(spec, self.clock.now())
        override = Override(
            spec.name, spec.period, spec.timezone, spec.tokens, spec.cost, spec.soft
        )
        await self.store.run(sql_budgets.set_budget, override, row)
        self.specs[spec.name] = spec
        self._ensured.add(row.key)

    async def reset(self, name: str) -> None:
        """The current period's spend of ``name`` back to zero. KeyError: not declared."""
        spec = self.specs[name]
        start, _ = period_bounds(spec.period, spec.timezone, self.clock.now())
        await self.store.run(sql_budgets.reset, row_key(name, start))

    def with_spec(self, name: str, **changes: object) -> BudgetSpec:
        """``name``'s spec with ``changes`` (ValueError from the spec's checks)."""
        return replace(self.specs[name], **changes)  # type: ignore[arg-type]


class BudgetedLLM:
    """An :class:`LLMPort` whose calls are reserved before and settled after."""

    def __init__(
        self,
        llm: LLMPort,
        budgets: Budgets,
        agent: str,
        client: str | None,
        turn: str | None,
        timeout_s: float,
        owner: HoldOwner | None = None,
        defer: list[Spend] | None = None,
        first: StepHold | None = None,
    ) -> None:
        self.llm = llm
        self.budgets = budgets
        self.agent = agent
        self.client = client
        self.turn = turn
        #: The bound a call of this Turn runs under (the hold's expiry exceeds it).
        self.timeout_s = timeout_s
        #: The Turn's step whose calls these are (None: the holds only expire).
        self.owner = owner
        #: Where a returned call's spend goes, unsettled (None: settled at once).
        self.defer = defer
        #: The first call's reservation, taken with its step (None: used, or none).
        self.first = first

    async def _reserve(self, request: LLMRequest) -> Hold | None:
        """The call's hold: the step's own if it covers the call's worst case, else one
        reserved now (:meth:`Budgets.reserve`; BudgetSpent when there is no room)."""
        need = self.budgets.need(request)
        first, self.first = self.first, None
        if first is not None and first.granted:
            req = first.request
            if req.tokens >= need.tokens and req.cost >= need.cost:
                return self.budgets.taken(req, self.agent, self.client)
            await self.budgets.release(Hold(req.hold_id, req.keys, Need(req.tokens, req.cost), ()))
        return await self.budgets.reserve(self.agent, self.client, need, self.timeout_s, self.owner)

    async def _settle(self, hold: Hold, done: LLMCompletion | None) -> None:
        if self.defer is not None:
            self.defer.append(self.budgets.spend(hold, done, agent=self.agent, turn=self.turn))
        else:
            await self.budgets.settle(hold, done, agent=self.agent, turn=self.turn)

    def context_window(self, model: str) -> int | None:
        window_of = getattr(self.llm, "context_window", None)
        return window_of(model) if window_of is not None else None

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        hold = await self._reserve(request)
        if hold is None:
            return await self.llm.complete(request)
        try:
            done = await self.llm.complete(request)
        except BaseException:
            await self.budgets.release(hold)
            raise
        await self._settle(hold, done)
        return done

    @property
    def stream(self):  # type: ignore[no-untyped-def]
        """The port's ``stream`` with reservation, or None when the port has none."""
        inner = getattr(self.llm, "stream", None)
        if inner is None:
            return None
        return self._stream

    @contextlib.asynccontextmanager
    async def _stream(
        self, request: LLMRequest
    ) -> AsyncIterator[AsyncIterator[str | LLMCompletion]]:
        """Streamed: the hold settles when the stream ends (at the worst case if no final
        usage came), and is released if it fails or is cancelled first."""
        hold = await self._reserve(request)
        final: list[LLMCompletion] = []

        async def watch(
            items: AsyncIterator[str | LLMCompletion],
        ) -> AsyncIterator[str | LLMCompletion]:
            async for item in items:
                if isinstance(item, LLMCompletion):
                    final.append(item)
                yield item

        try:
            async with self.llm.stream(request) as items:  # type: ignore[attr-defined]
                yield watch(items)
        except BaseException:
            if hold is not None:
                await self.budgets.release(hold)
            raise
        if hold is not None:
            await self._settle(hold, final[-1] if final else None)


def near_limit(rows: Sequence[SpendRow], fraction: float = 0.8) -> list[SpendRow]:
    """The rows whose spend and reservations reach ``fraction`` of a limit."""
    return [r for r in rows if r.used() >= fraction]
