"""Spend budgets in the store: one row per budget and period (``budget_spend``: limits,
spent, reserved, refusals), one row per budget a reservation holds (``budget_holds``).

A hold belongs to the Turn's step that made the call (its agent, Turn, epoch and step:
migration 16), not to a process: when a Turn's run is fenced out (a restart's recovery, or
another process taking over a dead one's Turns), its holds are released in the same
transaction (:func:`release_turn`), and the watchdog releases any hold whose Turn is no
longer running at that epoch (:func:`release_expired`). The expiry stays as the backstop
for holds without an owner.

The promise (docs/budgets.md): a reservation is admitted only if every budget it pays into
has room for its worst case, and it is taken in all of them or in none. On PostgreSQL that
is ONE statement (:data:`_PG_RESERVE`: the rows locked in key order, checked, raised and
the holds written), so concurrent reservations of any number of processes serialize on the
rows; on SQLite the check and the writes run inside the store's single-writer transaction
(``BEGIN IMMEDIATE``). Settling, releasing and the watchdog's release of expired holds are
ordinary transactions: they only ever lower ``reserved``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agentserver.agents.store import outbox
from agentserver.agents.store.rows import HoldOwner, HoldRequest, StepHold, StepStart
from agentserver.agents.store.sql.db import POSTGRESQL, StoreEnv, Tx, marks
from agentserver.agents.store.states import HeadStatus

MIGRATION = """
CREATE TABLE budget_spend (
    bkey TEXT PRIMARY KEY,
    budget TEXT NOT NULL,
    period TEXT NOT NULL,
    period_start REAL NOT NULL,
    period_end REAL,
    limit_tokens BIGINT,
    limit_cost REAL,
    soft REAL,
    spent_tokens BIGINT NOT NULL DEFAULT 0,
    spent_cost REAL NOT NULL DEFAULT 0,
    reserved_tokens BIGINT NOT NULL DEFAULT 0,
    reserved_cost REAL NOT NULL DEFAULT 0,
    refusals BIGINT NOT NULL DEFAULT 0,
    soft_at REAL,
    updated_at REAL NOT NULL
);
CREATE INDEX budget_spend_budget ON budget_spend (budget, period_start);
CREATE TABLE budget_holds (
    hold_id TEXT NOT NULL,
    bkey TEXT NOT NULL,
    tokens BIGINT NOT NULL,
    cost REAL NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (hold_id, bkey)
);
CREATE INDEX budget_holds_expiry ON budget_holds (expires_at);
"""

#: Migration 12: the budgets changed at run time (``PUT /v1/budgets/...``), so that a
#: change holds across processes, restarts and periods: whichever process opens a
#: budget's next period takes its limits, period, soft mark and time zone from here.
OVERRIDES_MIGRATION = """
CREATE TABLE budget_overrides (
    budget TEXT PRIMARY KEY,
    period TEXT NOT NULL,
    timezone TEXT NOT NULL,
    limit_tokens BIGINT,
    limit_cost REAL,
    soft REAL,
    updated_at REAL NOT NULL
);
"""


#: Migration 16: a hold names the Turn's step that made its call, so that the hold goes
#: with that run of the Turn (released when the run is fenced out), not with the process.
HOLDS_MIGRATION = """
ALTER TABLE budget_holds ADD COLUMN agent_id TEXT;
ALTER TABLE budget_holds ADD COLUMN agent_turn_id TEXT;
ALTER TABLE budget_holds ADD COLUMN turn_epoch INTEGER;
ALTER TABLE budget_holds ADD COLUMN step_id TEXT;
CREATE INDEX budget_holds_turn ON budget_holds (agent_id, agent_turn_id);
"""


@dataclass(slots=True)
class Spend:
    """A model call's spend, settled in the transaction that writes its step's results
    (``complete_step``, ``suspend``, ``finish``: ``spends=``), not in one of its own.
    ``events(crossed)``: the outbox rows of the ``budget.soft`` marks it crosses, written
    with them; :attr:`crossed` holds those rows once the transaction has run (set again
    by each attempt, so a rerun transaction leaves the last one's), for the caller to
    publish after the commit. :attr:`committed`: set by the caller once a transaction
    that settled it has committed (a spend whose step was not written is settled by
    itself, once)."""

    hold_id: str
    keys: tuple[str, ...]
    tokens: int
    cost: float
    events: Callable[[list[SpendRow]], Sequence[outbox.OutboxItem]] | None = None
    crossed: list[SpendRow] = field(default_factory=list)
    committed: bool = False


def settle_spends(tx: Tx, env: StoreEnv, spends: Sequence[Spend]) -> None:
    """Each of ``spends`` settled (:func:`settle`) in the caller's transaction."""
    for s in spends:
        s.crossed = settle(tx, env, s.hold_id, s.keys, s.tokens, s.cost, s.events)


#: The reservation of the first call of a step just opened, from the Turn's reply
#: reference (as stored: JSON) and the step (None: no budget applies, or the call
#: reserves by itself). Pure, no I/O: it runs in the transaction that opens the step.
HoldFor = Callable[[str | None, StepStart], HoldRequest | None]


def hold_step(
    tx: Tx, env: StoreEnv, ref_json: str | None, step: StepStart, hold_for: HoldFor | None
) -> StepStart:
    """``step`` (just opened in this transaction) with its first call's reservation
    taken here too, if ``hold_for`` asks for one (:func:`reserve`: all or nothing). A
    refusal writes nothing: the call reserves by itself, and meets it there with its
    refusal counted and explained."""
    if hold_for is None or step.step_id is None:
        return step
    req = hold_for(ref_json, step)
    if req is None:
        return step
    granted = reserve(
        tx, env, req.keys, req.tokens, req.cost, req.hold_id, req.expires_at, req.owner
    )
    return replace(step, hold=StepHold(req, granted))


def row_key(budget: str, period_start: float) -> str:
    """The row of ``budget`` in the period starting at ``period_start``."""
    return f"{budget}|{period_start:.0f}"


@dataclass(frozen=True, slots=True)
class PeriodRow:
    """What a new period's row starts with."""

    budget: str
    period: str
    start: float
    end: float
    limit_tokens: int | None
    limit_cost: float | None
    soft: float | None
    timezone: str = "UTC"

    @property
    def key(self) -> str:
        return row_key(self.budget, self.start)


@dataclass(frozen=True, slots=True)
class Override:
    """A budget as last changed at run time (``budget_overrides``): it replaces the
    boot.xml declaration of ``budget`` in every process, from the period each opens next."""

    budget: str
    period: str
    timezone: str
    limit_tokens: int | None
    limit_cost: float | None
    soft: float | None


@dataclass(frozen=True, slots=True)
class SpendRow:
    """One budget's row as read (``GET /v1/budgets``, ``agentserver budget show``)."""

    budget: str
    period: str
    period_start: float
    period_end: float
    limit_tokens: int | None
    limit_cost: float | None
    soft: float | None
    spent_tokens: int
    spent_cost: float
    reserved_tokens: int
    reserved_cost: float
    refusals: int
    soft_at: float | None

    def remaining(self) -> tuple[int | None, float | None]:
        """Tokens and cost left (None: not limited); never below zero."""
        tokens = cost = None
        if self.limit_tokens is not None:
            tokens = max(0, self.limit_tokens - self.spent_tokens - self.reserved_tokens)
        if self.limit_cost is not None:
            cost = max(0.0, self.limit_cost - self.spent_cost - self.reserved_cost)
        return tokens, cost

    def used(self) -> float:
        """The larger used fraction (spent + reserved over limit) of its dimensions."""
        parts = []
        if self.limit_tokens:
            parts.append((self.spent_tokens + self.reserved_tokens) / self.limit_tokens)
        if self.limit_cost:
            parts.append((self.spent_cost + self.reserved_cost) / self.limit_cost)
        return max(parts, default=0.0)


_COLUMNS = (
    "budget, period, period_start, period_end, limit_tokens, limit_cost, soft, spent_tokens,"
    " spent_cost, reserved_tokens, reserved_cost, refusals, soft_at"
)


def _spend(r: tuple[Any, ...]) -> SpendRow:
    """A ``budget_spend`` row (``_COLUMNS``) as read: the driver's values, typed here."""
    end = r[3]
    return SpendRow(
        str(r[0]),
        str(r[1]),
        float(r[2]),
        math.inf if end is None else float(end),
        None if r[4] is None else int(r[4]),
        None if r[5] is None else float(r[5]),
        None if r[6] is None else float(r[6]),
        int(r[7]),
        float(r[8]),
        int(r[9]),
        float(r[10]),
        int(r[11]),
        None if r[12] is None else float(r[12]),
    )


def overrides(tx: Tx, env: StoreEnv) -> list[Override]:
    """Every budget changed at run time (one row per budget name: a handful)."""
    return [
        Override(
            str(r[0]),
            str(r[1]),
            str(r[2]),
            None if r[3] is None else int(r[3]),
            None if r[4] is None else float(r[4]),
            None if r[5] is None else float(r[5]),
        )
        for r in tx.all(
            "SELECT budget, period, timezone, limit_tokens, limit_cost, soft"
            " FROM budget_overrides ORDER BY budget"
        )
    ]


def _insert_row(tx: Tx, p: PeriodRow, now: float) -> None:
    tx.execute(
        "INSERT INTO budget_spend (bkey, budget, period, period_start, period_end,"
        " limit_tokens, limit_cost, soft, updated_at) VALUES (?,?,?,?,?,?,?,?,?)"
        " ON CONFLICT (bkey) DO NOTHING",
        (
            p.key,
            p.budget,
            p.period,
            p.start,
            None if math.isinf(p.end) else p.end,
            p.limit_tokens,
            p.limit_cost,
            p.soft,
            now,
        ),
    )


def ensure_rows(tx: Tx, env: StoreEnv, rows: Sequence[PeriodRow]) -> list[Override]:
    """The periods' rows, created if missing (another process may have made them), with
    the limits of the budget's run-time override when it has one (else the row's own).
    Returns every override, read in the same transaction, for the caller to adopt: a row
    whose period or time zone the override changed was computed from stale bounds, so it
    is not created, and the caller ensures the right one next."""
    now = env.clock.now()
    changed = overrides(tx, env)
    by_name = {o.budget: o for o in changed}
    for p in rows:
        o = by_name.get(p.budget)
        if o is not None and (o.period, o.timezone) != (p.period, p.timezone):
            continue
        if o is not None:
            p = PeriodRow(
                p.budget, p.period, p.start, p.end, o.limit_tokens, o.limit_cost, o.soft, o.timezone
            )
        _insert_row(tx, p, now)
    return changed


@functools.lru_cache(maxsize=16)
def _pg_reserve(n: int) -> str:
    """The one PostgreSQL statement of a reservation into ``n`` rows. ``SELECT … FOR
    UPDATE`` under READ COMMITTED waits for a concurrent holder and returns the row as it
    committed, so the check sees every earlier reservation; the ``UPDATE`` then applies
    to that latest version (rows locked in key order: no deadlock between two)."""
    keys = marks(n)
    return f"""
WITH locked AS (
    SELECT bkey, limit_tokens, limit_cost, spent_tokens, spent_cost,
           reserved_tokens, reserved_cost
    FROM budget_spend WHERE bkey IN ({keys}) ORDER BY bkey FOR UPDATE
), verdict AS (
    SELECT count(*) = CAST(? AS BIGINT) AS ok FROM locked
    WHERE (limit_tokens IS NULL OR spent_tokens + reserved_tokens + CAST(? AS BIGINT)
           <= limit_tokens)
      AND (limit_cost IS NULL OR spent_cost + reserved_cost + CAST(? AS DOUBLE PRECISION)
           <= limit_cost)
), raised AS (
    UPDATE budget_spend b
    SET reserved_tokens = b.reserved_tokens + CAST(? AS BIGINT),
        reserved_cost = b.reserved_cost + CAST(? AS DOUBLE PRECISION)
    FROM verdict WHERE verdict.ok AND b.bkey IN ({keys})
    RETURNING b.bkey
), held AS (
    INSERT INTO budget_holds (hold_id, bkey, tokens, cost, expires_at, agent_id,
                              agent_turn_id, turn_epoch, step_id)
    SELECT CAST(? AS TEXT), bkey, CAST(? AS BIGINT), CAST(? AS DOUBLE PRECISION),
           CAST(? AS DOUBLE PRECISION), CAST(? AS TEXT), CAST(? AS TEXT),
           CAST(? AS BIGINT), CAST(? AS TEXT)
    FROM raised
    RETURNING 1
)
SELECT ok, (SELECT count(*) FROM held) FROM verdict
"""


def _fits(n: int) -> str:
    return (
        f"SELECT count(*) FROM budget_spend WHERE bkey IN ({marks(n)})"
        " AND (limit_tokens IS NULL OR spent_tokens + reserved_tokens + ? <= limit_tokens)"
        " AND (limit_cost IS NULL OR spent_cost + reserved_cost + ? <= limit_cost)"
    )


def reserve(
    tx: Tx,
    env: StoreEnv,
    keys: Sequence[str],
    tokens: int,
    cost: float,
    hold_id: str,
    expires_at: float,
    owner: HoldOwner | None = None,
) -> bool:
    """Hold ``tokens``/``cost`` in every row of ``keys`` if all have room for them; else
    nothing. Atomic (see the module docstring); False: refused, nothing written.
    ``owner``: the Turn's step the hold belongs to (None: only its expiry frees it)."""
    n = len(keys)
    who = (
        (owner.agent_id, owner.agent_turn_id, owner.turn_epoch, owner.step_id)
        if owner is not None
        else (None, None, None, None)
    )
    if tx.dialect == POSTGRESQL:
        row = tx.one(
            _pg_reserve(n),
            [
                *keys,
                n,
                tokens,
                cost,
                tokens,
                cost,
                *keys,
                hold_id,
                tokens,
                cost,
                expires_at,
                *who,
            ],
        )
        return bool(row and row[0])
    # SQLite: inside BEGIN IMMEDIATE, so nothing else writes between check and writes.
    row = tx.one(_fits(n), [*keys, tokens, cost])
    if row is None or int(row[0]) != n:
        return False
    tx.execute(
        "UPDATE budget_spend SET reserved_tokens = reserved_tokens + ?,"
        f" reserved_cost = reserved_cost + ? WHERE bkey IN ({marks(n)})",
        [tokens, cost, *keys],
    )
    tx.executemany(
        "INSERT INTO budget_holds (hold_id, bkey, tokens, cost, expires_at, agent_id,"
        " agent_turn_id, turn_epoch, step_id) VALUES (?,?,?,?,?,?,?,?,?)",
        [(hold_id, k, tokens, cost, expires_at, *who) for k in keys],
    )
    return True


def refused(
    tx: Tx, env: StoreEnv, keys: Sequence[str], tokens: int, cost: float
) -> SpendRow | None:
    """After a refused reservation: count the refusal on the rows without room, and
    return the first of them as it stands (None: room was made meanwhile)."""
    rows = tx.all(
        f"SELECT bkey, {_COLUMNS} FROM budget_spend WHERE bkey IN ({marks(len(keys))}) AND NOT ("
        "(limit_tokens IS NULL OR spent_tokens + reserved_tokens + ? <= limit_tokens)"
        " AND (limit_cost IS NULL OR spent_cost + reserved_cost + ? <= limit_cost))"
        " ORDER BY bkey",
        [*keys, tokens, cost],
    )
    full = [str(r[0]) for r in rows]
    if full:
        tx.execute(
            f"UPDATE budget_spend SET refusals = refusals + 1 WHERE bkey IN ({marks(len(full))})",
            full,
        )
    return _spend(rows[0][1:]) if rows else None


def _unhold(tx: Tx, hold_ids: Sequence[str]) -> int:
    """The holds deleted and what they held given back. DELETE … RETURNING, not a read
    then a delete: two releases of one hold at once (a settle and another process's
    watchdog, on PostgreSQL) lower ``reserved`` once, as the second delete waits for the
    first's row lock and then finds nothing. Every release locks its holds first (in
    ``hold_id`` order) and then the spend rows (in key order, as a reservation does), so
    two releases never wait for each other in a cycle. Returns how many of the holds
    were still there (the others: released meanwhile)."""
    if not hold_ids:
        return 0
    ids = sorted(hold_ids)
    gone: dict[str, tuple[int, float]] = {}
    found: set[str] = set()
    for hold_id, bkey, tokens, cost in tx.all(
        f"DELETE FROM budget_holds WHERE hold_id IN ({marks(len(ids))})"
        " RETURNING hold_id, bkey, tokens, cost",
        ids,
    ):
        found.add(str(hold_id))
        t, c = gone.get(str(bkey), (0, 0.0))
        gone[str(bkey)] = (t + int(tokens), c + float(cost))
    for bkey in sorted(gone):
        tokens, cost = gone[bkey]
        tx.execute(
            "UPDATE budget_spend SET reserved_tokens = reserved_tokens - ?,"
            " reserved_cost = reserved_cost - ? WHERE bkey = ?",
            (tokens, cost, bkey),
        )
    return len(found)


def settle(
    tx: Tx,
    env: StoreEnv,
    hold_id: str,
    keys: Sequence[str],
    tokens: int,
    cost: float,
    events: Callable[[list[SpendRow]], Sequence[outbox.OutboxItem]] | None = None,
) -> list[SpendRow]:
    """The hold released (if the watchdog has not already) and ``tokens``/``cost`` spent
    in every row of ``keys``. Returns the rows that crossed their soft mark just now
    (marked, so each fires once per period). ``events(crossed)``: their ``budget.soft``
    outbox rows, written with the mark (a crash after the commit loses no event: the mark
    and the event commit together)."""
    _unhold(tx, [hold_id])
    now = env.clock.now()
    tx.execute(
        "UPDATE budget_spend SET spent_tokens = spent_tokens + ?, spent_cost = spent_cost + ?,"
        f" updated_at = ? WHERE bkey IN ({marks(len(keys))})",
        [tokens, cost, now, *keys],
    )
    crossed = tx.all(
        f"UPDATE budget_spend SET soft_at = ? WHERE bkey IN ({marks(len(keys))})"
        " AND soft IS NOT NULL AND soft_at IS NULL AND ("
        "(limit_tokens IS NOT NULL AND spent_tokens >= soft * limit_tokens)"
        " OR (limit_cost IS NOT NULL AND spent_cost >= soft * limit_cost))"
        f" RETURNING {_COLUMNS}",
        [now, *keys],
    )
    rows = [_spend(r) for r in crossed]
    if rows and events is not None and (items := events(rows)):
        outbox.enqueue(tx, env, items)
    return rows


def release(tx: Tx, env: StoreEnv, hold_id: str) -> None:
    """The hold given back untouched (the call failed, timed out or was cancelled)."""
    _unhold(tx, [hold_id])


def release_turn(tx: Tx, env: StoreEnv, agent_id: str, agent_turn_id: str, epoch: int) -> int:
    """The holds of a Turn's runs up to ``epoch`` released: that run is fenced out (its
    process died; the Turn re-runs its step under a new epoch and reserves again). Their
    calls' usage is unknown and nothing is spent for them. Called in the transaction that
    fences the run (``sql/watchdog.recover_turn``). Returns how many reservations."""
    ids = [
        str(r[0])
        for r in tx.all(
            "SELECT DISTINCT hold_id FROM budget_holds WHERE agent_id = ? AND agent_turn_id = ?"
            " AND turn_epoch <= ?",
            (agent_id, agent_turn_id, epoch),
        )
    ]
    return _unhold(tx, ids)


#: The holds whose Turn's run is no longer under way: their Turn is not ``running`` at
#: the hold's epoch any more (ended, or fenced out), so no live call of that run can
#: settle them. A run is fenced before its Turn leaves ``running`` and an epoch never
#: comes back, so a hold found here stays orphaned.
_ORPHANS = (
    "SELECT DISTINCT h.hold_id FROM budget_holds h WHERE h.agent_turn_id IS NOT NULL"
    " AND NOT EXISTS (SELECT 1 FROM agent_state_head a WHERE a.agent_id = h.agent_id"
    " AND a.active_agent_turn_id = h.agent_turn_id AND a.turn_epoch = h.turn_epoch"
    " AND a.status = ?) LIMIT 256"
)


def release_expired(tx: Tx, env: StoreEnv) -> int:
    """The watchdog's pass: holds whose Turn's run is over (see :data:`_ORPHANS`: a dead
    process's run, or one ended while its call was under way) and holds past their expiry
    (those without an owner: a live call is bounded by its timeout, which the expiry
    exceeds) released. Returns how many reservations."""
    ids = [str(r[0]) for r in tx.all(_ORPHANS, (HeadStatus.RUNNING,))]
    ids += [
        str(r[0])
        for r in tx.all(
            "SELECT DISTINCT hold_id FROM budget_holds WHERE expires_at < ? LIMIT 256",
            (env.clock.now(),),
        )
    ]
    return _unhold(tx, list(dict.fromkeys(ids)))


def rows_of(tx: Tx, env: StoreEnv, keys: Sequence[str]) -> list[SpendRow]:
    """The rows of ``keys`` (each budget's current period, as its process computes it:
    after a run-time change of period, the newest row need not be the current one)."""
    if not keys:
        return []
    rows = tx.all(
        f"SELECT {_COLUMNS} FROM budget_spend WHERE bkey IN ({marks(len(keys))}) ORDER BY budget",
        list(keys),
    )
    return [_spend(r) for r in rows]


def set_budget(tx: Tx, env: StoreEnv, override: Override, row: PeriodRow) -> None:
    """A budget changed at run time (``PUT /v1/budgets/...``): the override stored (every
    process opens the budget's next periods with it) and ``row``, the current period's,
    created if missing and given the new limits (every process's reservations check it
    from now on). One transaction: both or neither."""
    now = env.clock.now()
    o = override
    tx.execute(
        "INSERT INTO budget_overrides (budget, period, timezone, limit_tokens, limit_cost,"
        " soft, updated_at) VALUES (?,?,?,?,?,?,?) ON CONFLICT (budget) DO UPDATE SET"
        " period = excluded.period, timezone = excluded.timezone,"
        " limit_tokens = excluded.limit_tokens, limit_cost = excluded.limit_cost,"
        " soft = excluded.soft, updated_at = excluded.updated_at",
        (o.budget, o.period, o.timezone, o.limit_tokens, o.limit_cost, o.soft, now),
    )
    _insert_row(tx, row, now)
    tx.execute(
        "UPDATE budget_spend SET limit_tokens = ?, limit_cost = ?, soft = ?, updated_at = ?"
        " WHERE bkey = ?",
        (o.limit_tokens, o.limit_cost, o.soft, now, row.key),
    )


def reset(tx: Tx, env: StoreEnv, key: str) -> None:
    """The current period's spend, refusals and soft mark set back to zero (holds stay:
    the calls under way settle into the fresh spend)."""
    tx.execute(
        "UPDATE budget_spend SET spent_tokens = 0, spent_cost = 0, refusals = 0,"
        " soft_at = NULL, updated_at = ? WHERE bkey = ?",
        (env.clock.now(), key),
    )
