"""The chaos bench's schedules (docs/runs.md): two schedules in the generated boot.xml,
firing every few seconds while servers are SIGKILLed and restarted, and their checker:
every tick from a schedule's creation to its next tick is accounted for exactly once (a
run, fired or skipped by overlap, or a missed tick counted), every fired run's task is in
the inbox, and every fired run older than the drain has ended.

:func:`check_schedules` reads the store; :func:`check_runs` is the sans-IO check
(tests/test_chaos_checker.py)."""

from __future__ import annotations

import datetime
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cronsim import CronSim

#: A fixed nonce: the scheduled tasks' plan (their tools) is the model's as for any task.
NONCE = "5c4ed0c0ffee0001"
SCHEDULES = (
    # name, agent, cron, overlap, catch-up window
    ("tick-gamma", "gamma", "*/3 * * * * *", "buffer-one", 10),
    ("tick-beta", "beta", "*/5 * * * * *", "skip", 4),
)
#: A fired run must have ended this long after its tick (the drain gives it time).
ENDED_WITHIN_S = 90.0

SCHEDULES_XML = (
    "<schedules>"
    + "".join(
        f'<schedule name="{name}" agent="{agent}" cron="{cron}" overlap="{overlap}" '
        f'catchup-window="{window}"><task xmlns="urn:chaos:{agent}"><text>Scheduled: '
        f"handle NONCE[{NONCE}] with your tools.</text></task></schedule>"
        for name, agent, cron, overlap, window in SCHEDULES
    )
    + "</schedules>"
)


@dataclass(frozen=True)
class Sched:
    name: str
    cron: str
    created_at: float
    next_tick: float
    #: every tick skipped: by overlap (each also a run record) and missed while down
    skipped: int


@dataclass(frozen=True)
class Run:
    schedule: str
    tick: float
    outcome: str
    #: the run's task in the inbox: None when skipped, "" when its row is missing,
    #: "pruned" when retention removed it (its tombstone)
    inbox_status: str | None
    #: its Turn still holds its agent (the head's active Turn)
    running: bool


def ticks_between(cron: str, after: float, before: float) -> int:
    """Ticks of ``cron`` (UTC) strictly after ``after`` and strictly before ``before``."""
    n = 0
    start = datetime.datetime.fromtimestamp(int(after), datetime.UTC)
    for when in CronSim(cron, start):
        if when.timestamp() >= before:
            return n
        n += 1
    return n


def check_runs(scheds: list[Sched], runs: list[Run], now: float) -> tuple[dict, list[str]]:
    """The counts and the violations (sans-IO)."""
    violations: list[str] = []
    fired = skipped_overlap = missed = 0
    for s in scheds:
        mine = [r for r in runs if r.schedule == s.name]
        ticks = [r.tick for r in mine]
        if len(ticks) != len(set(ticks)):
            violations.append(f"schedule {s.name}: a tick fired twice")
        expected = ticks_between(s.cron, s.created_at, s.next_tick)
        lost = s.skipped - sum(1 for r in mine if r.inbox_status is None)
        missed += lost
        if len(ticks) + lost != expected:
            violations.append(
                f"schedule {s.name}: {expected} ticks due, {len(ticks)} runs + "
                f"{lost} missed accounted for"
            )
        for r in mine:
            if r.outcome in ("fired", "triggered"):
                fired += 1
                if r.inbox_status == "":
                    violations.append(f"schedule {s.name} tick {r.tick:.0f}: fired, no task")
                elif now - r.tick > ENDED_WITHIN_S and (
                    r.inbox_status in ("queued", "pending", "processing") or r.running
                ):
                    violations.append(f"schedule {s.name} tick {r.tick:.0f}: never ended")
            else:
                skipped_overlap += 1
    counts = {
        "schedule_runs_fired": fired,
        "schedule_ticks_skipped_overlap": skipped_overlap,
        "schedule_ticks_missed": missed,
    }
    return counts, violations


_SCHEDS = "SELECT name, cron, created_at, next_tick, skipped FROM schedules"
_TOMBSTONES = "SELECT inbox_id FROM pruned_turns WHERE inbox_id IS NOT NULL"
_RUNS = (
    "SELECT r.schedule, r.tick, r.outcome, r.inbox_id, "
    # A task retention pruned (chaos.py --retention) left its tombstone: it was there.
    "coalesce(i.status, (SELECT 'pruned' FROM pruned_turns p WHERE p.inbox_id = r.inbox_id)), "
    "(SELECT count(*) FROM agent_state_head h WHERE h.turn_inbox_id = r.inbox_id "
    "AND h.status IN ('dispatched', 'running', 'suspended')) "
    "FROM schedule_runs r LEFT JOIN agent_inbox i ON i.inbox_id = r.inbox_id"
)


def check_schedules(
    sqlite_path: Path | None,
    pg_url: str | None,
    now: float,
    pruned: frozenset[str] | set[str] = frozenset(),
    seen_runs: Mapping[tuple[str, float], tuple[str, str | None]] | None = None,
) -> tuple[dict, list]:
    """Read the store and :func:`check_runs` it (blocking: call in a thread). ``pruned``:
    inbox ids of tasks whose tombstones were seen during the run, and ``seen_runs`` the
    run records seen ((schedule, tick) → (outcome, inbox id)): with retention the store
    prunes both (chaos_retention.py)."""
    # Both reads in one snapshot: the servers still run, and a tick firing between them
    # would be a run past the ``next_tick`` read first (seed 9, PostgreSQL: "20 ticks due,
    # 21 runs").
    if pg_url is not None:
        import psycopg

        with psycopg.connect(pg_url, connect_timeout=10) as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            scheds, runs = conn.execute(_SCHEDS).fetchall(), conn.execute(_RUNS).fetchall()
            stones = conn.execute(_TOMBSTONES).fetchall()
    else:
        if sqlite_path is None or not sqlite_path.exists():
            return {}, ["schedules: no store"]
        conn = sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True, timeout=30)
        try:
            conn.execute("BEGIN")  # a read transaction: one WAL snapshot for both
            scheds, runs = conn.execute(_SCHEDS).fetchall(), conn.execute(_RUNS).fetchall()
            stones = conn.execute(_TOMBSTONES).fetchall()
            conn.rollback()
        finally:
            conn.close()

    # A run record seen earlier may be gone now with its task, whose tombstone the run's
    # samples did not catch yet: the store's own tombstones count too.
    pruned = set(pruned) | {str(r[0]) for r in stones}

    def status(inbox_id: str | None, found: str | None) -> str | None:
        return None if inbox_id is None else (found or ("pruned" if inbox_id in pruned else ""))

    kept = [Run(r[0], float(r[1]), r[2], status(r[3], r[4]), bool(r[5])) for r in runs]
    have = {(r.schedule, r.tick) for r in kept}
    gone = [
        Run(name, tick, outcome, status(inbox_id, None), False)
        for (name, tick), (outcome, inbox_id) in (seen_runs or {}).items()
        if (name, tick) not in have
    ]
    return check_runs(
        [Sched(r[0], r[1], float(r[2]), float(r[3]), int(r[4])) for r in scheds],
        kept + gone,
        now,
    )
