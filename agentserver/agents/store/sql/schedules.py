"""Schedules in the store (docs/runs.md): their definitions, the claim of a tick and the
run it starts, in one transaction each.

Exactly once: a tick is claimed by one ``UPDATE schedules SET next_tick = <the next>
WHERE name = ? AND next_tick = <this tick>`` (the compare-and-set of one statement: of
two processes, one matches), and the run's task is queued in the same transaction with a
``schedule_runs`` row keyed (schedule, tick). A crash before the commit leaves the tick
unclaimed (it fires on start, within the catch-up window); after it, claimed and queued.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentserver.agents.errors import StoreError
from agentserver.agents.ports import ReplyRef
from agentserver.agents.profile.schedule import ScheduleSpec
from agentserver.agents.store.rows import Finished, Fired, ScheduleRow, TaskStatus
from agentserver.agents.store.sql import head, turn_end
from agentserver.agents.store.sql.common import inbox_move
from agentserver.agents.store.sql.db import StoreEnv, Tx, marks, new_id
from agentserver.agents.store.sql.inbox import queue
from agentserver.agents.store.states import ACTIVE_HEAD, HeadStatus, InboxEvent, InboxStatus

FIRED = "fired"
MANUAL = "triggered"
SKIPPED_OVERLAP = "skipped: the previous run has not ended"
SKIPPED_BUFFER = "skipped: a run is buffered already"

_COLS = (
    "name, agent_id, cron, timezone, overlap, catchup_window, jitter, payload, paused, "
    "next_tick, last_tick, last_outcome, last_inbox_id, fired, skipped, source"
)


class ScheduleExists(StoreError):
    """A schedule of that name exists already (nothing written)."""


class NoSuchSchedule(StoreError):
    """No schedule of that name (nothing written)."""


def _row(r: Any) -> ScheduleRow:
    spec = ScheduleSpec(
        name=r[0],
        agent=r[1],
        cron=r[2],
        timezone=r[3],
        overlap=r[4],
        catchup_window_s=float(r[5]),
        jitter_s=float(r[6]),
        payload=bytes(r[7]),
    )
    return ScheduleRow(spec, bool(r[8]), r[9], r[10], r[11], r[12], int(r[13]), int(r[14]), r[15])


def _definition(spec: ScheduleSpec) -> tuple[Any, ...]:
    return (
        spec.agent,
        spec.cron,
        spec.timezone,
        spec.overlap,
        spec.catchup_window_s,
        spec.jitter_s,
        spec.payload,
    )


def put_schedule(
    tx: Tx, env: StoreEnv, spec: ScheduleSpec, source: str, next_tick: float, *, new: bool
) -> bool:
    """Create schedule ``spec`` (``new``: ScheduleExists if its name is taken), or
    update its definition; an unchanged definition keeps its state (its next tick: a tick
    missed while the server was down is still due). True when something was written."""
    now = env.clock.now()
    found = tx.one(
        "SELECT agent_id, cron, timezone, overlap, catchup_window, jitter, payload "
        "FROM schedules WHERE name = ?",
        (spec.name,),
    )
    if found is not None and new:
        raise ScheduleExists(f"schedule {spec.name!r} exists")
    if found is None:
        tx.execute(
            "INSERT INTO schedules (name, agent_id, cron, timezone, overlap, catchup_window, "
            "jitter, payload, source, paused, next_tick, fired, skipped, created_at, "
            "updated_at) VALUES (?,?,?,?,?,?,?,?,?,0,?,0,0,?,?)",
            (spec.name, *_definition(spec), source, next_tick, now, now),
        )
        return True
    if (*found[:6], bytes(found[6])) == _definition(spec):
        return False
    tx.execute(
        "UPDATE schedules SET agent_id = ?, cron = ?, timezone = ?, overlap = ?, "
        "catchup_window = ?, jitter = ?, payload = ?, source = ?, next_tick = ?, "
        "updated_at = ? WHERE name = ?",
        (*_definition(spec), source, next_tick, now, spec.name),
    )
    return True


def drop_boot_schedules(tx: Tx, env: StoreEnv, keep: Sequence[str]) -> int:
    """Schedules boot.xml declared once but no longer does are deleted (with their runs'
    records); those made at run time stay. How many."""
    rows = tx.all("SELECT name FROM schedules WHERE source = ?", ("boot",))
    gone = [r[0] for r in rows if r[0] not in set(keep)]
    for name in gone:
        delete_schedule(tx, env, name)
    return len(gone)


def delete_schedule(tx: Tx, env: StoreEnv, name: str) -> None:
    tx.execute("DELETE FROM schedules WHERE name = ?", (name,))
    if not tx.rowcount:
        raise NoSuchSchedule(f"no schedule {name!r}")
    tx.execute("DELETE FROM schedule_runs WHERE schedule = ?", (name,))


def set_paused(
    tx: Tx, env: StoreEnv, name: str, paused: bool, next_tick: float | None
) -> ScheduleRow:
    """Pause (its ticks pass unclaimed: none fire, none are counted) or resume (from
    ``next_tick``, the first after now: a pause is not caught up)."""
    sets = "paused = ?, updated_at = ?" + ("" if paused else ", next_tick = ?")
    params: tuple[Any, ...] = (int(paused), env.clock.now())
    if not paused:
        params += (next_tick,)
    tx.execute(f"UPDATE schedules SET {sets} WHERE name = ?", (*params, name))
    if not tx.rowcount:
        raise NoSuchSchedule(f"no schedule {name!r}")
    return get_schedule(tx, env, name)


def get_schedule(tx: Tx, env: StoreEnv, name: str) -> ScheduleRow:
    found = tx.one(f"SELECT {_COLS} FROM schedules WHERE name = ?", (name,))
    if found is None:
        raise NoSuchSchedule(f"no schedule {name!r}")
    return _row(found)


def list_schedules(tx: Tx, env: StoreEnv) -> list[ScheduleRow]:
    return [_row(r) for r in tx.all(f"SELECT {_COLS} FROM schedules ORDER BY name", ())]


def skip_missed(
    tx: Tx, env: StoreEnv, name: str, tick: float, next_tick: float, count: int
) -> bool:
    """Ticks missed by more than the catch-up window: counted skipped, the schedule moved
    on to ``next_tick`` (the same compare-and-set as a claim). False if another process
    moved it first."""
    tx.execute(
        "UPDATE schedules SET next_tick = ?, skipped = skipped + ?, last_outcome = ?, "
        "updated_at = ? WHERE name = ? AND next_tick = ? AND paused = 0",
        (
            next_tick,
            count,
            f"skipped: {count} tick(s) missed beyond the catch-up window",
            env.clock.now(),
            name,
            tick,
        ),
    )
    return tx.rowcount == 1


def _unended_runs(tx: Tx, name: str) -> list[tuple[str, str]]:
    """The runs of schedule ``name`` not ended: (inbox id, its status), queued or whose
    Turn holds its agent's head."""
    return [
        (r[0], r[1])
        for r in tx.all(
            "SELECT r.inbox_id, i.status FROM schedule_runs r "
            "JOIN agent_inbox i ON i.inbox_id = r.inbox_id WHERE r.schedule = ? AND "
            "(i.status = ? OR EXISTS (SELECT 1 FROM agent_state_head h WHERE "
            f"h.turn_inbox_id = r.inbox_id AND h.status IN ({marks(len(ACTIVE_HEAD))})))",
            (name, InboxStatus.QUEUED, *ACTIVE_HEAD),
        )
    ]


def fire(
    tx: Tx,
    env: StoreEnv,
    name: str,
    tick: float,
    next_tick: float | None,
    reply_ref: ReplyRef,
    conversation: str | None,
    cancelled_answer: bytes,
) -> Fired | None:
    """Claim ``tick`` of ``name`` (moving it to ``next_tick``) and start its run, in one
    transaction; None when the tick is not this call's to claim (another process did, or
    the schedule is paused, changed or gone). ``next_tick`` None: a manual trigger
    (``tick`` is now; nothing is claimed). Overlap applies against the schedule's runs
    that have not ended."""
    now = env.clock.now()
    if next_tick is None:
        found = tx.one("SELECT agent_id, payload, overlap FROM schedules WHERE name = ?", (name,))
        if found is None:
            raise NoSuchSchedule(f"no schedule {name!r}")
        tick = now
    else:
        found = tx.one(
            "UPDATE schedules SET next_tick = ?, last_tick = ?, updated_at = ? "
            "WHERE name = ? AND next_tick = ? AND paused = 0 RETURNING agent_id, payload, overlap",
            (next_tick, tick, now, name, tick),
        )
        if found is None:
            return None
    agent_id, payload, overlap = found[0], bytes(found[1]), found[2]
    busy = _unended_runs(tx, name) if overlap != "allow" else []
    outcome = MANUAL if next_tick is None else FIRED
    if busy and overlap == "skip":
        outcome = SKIPPED_OVERLAP
    elif busy and overlap == "buffer-one" and any(s == InboxStatus.QUEUED for _, s in busy):
        outcome = SKIPPED_BUFFER
    inbox_id = None
    leased = False
    ended: Finished | None = None
    if not outcome.startswith("skipped"):
        inbox_id = new_id()
        state = tx.one("SELECT status FROM agent_state_head WHERE agent_id = ?", (agent_id,))
        if state is None:
            head.ensure(tx, env, agent_id)
        queue(tx, env, inbox_id, agent_id, payload, json.dumps(reply_ref), conversation)
        if busy and overlap == "cancel-other":
            ended = _cancel_others(
                tx, env, agent_id, busy, (inbox_id, payload, conversation), cancelled_answer
            )
        if ended is not None:
            leased = ended.next_leased
        elif state is None or state[0] == HeadStatus.IDLE:
            leased = head.lease_next(tx, env, agent_id)
    tx.execute(
        "INSERT INTO schedule_runs (schedule, tick, inbox_id, outcome, at) VALUES (?,?,?,?,?)",
        (name, tick, inbox_id, outcome, now),
    )
    counter = "skipped" if inbox_id is None else "fired"
    tx.execute(
        f"UPDATE schedules SET last_outcome = ?, last_inbox_id = ?, {counter} = {counter} + 1 "
        "WHERE name = ?",
        (outcome, inbox_id, name),
    )
    return Fired(name, tick, outcome, inbox_id, leased, ended)


def _cancel_others(
    tx: Tx,
    env: StoreEnv,
    agent_id: str,
    busy: list[tuple[str, str]],
    next_row: tuple[str, bytes, str | None],
    answer: bytes,
) -> Finished | None:
    """cancel-other: the schedule's queued runs are skipped, its running one force-ended
    (stopped; the head leased to ``next_row``)."""
    for inbox_id, status in busy:
        if status == InboxStatus.QUEUED:
            inbox_move(tx, env, inbox_id, InboxEvent.CANCEL, defer_reason="cancel-other")
    running = tx.one(
        "SELECT active_agent_turn_id FROM agent_state_head WHERE agent_id = ? AND "
        f"turn_inbox_id IN ({marks(len(busy))})",
        (agent_id, *(i for i, _ in busy)),
    )
    if running is None:
        return None
    return turn_end.force_end(
        tx,
        env,
        agent_id,
        TaskStatus.STOPPED,
        "cancelled: the schedule's next run started (overlap cancel-other)",
        answer,
        agent_turn_id=running[0],
        metadata={"overlap": "cancel-other"},
        next_row=next_row,
    )


def runs(
    tx: Tx, env: StoreEnv, name: str | None = None
) -> list[tuple[str, float, str | None, str]]:
    """Every run recorded: (schedule, tick, inbox id, outcome), in tick order."""
    where, params = ("WHERE schedule = ?", (name,)) if name else ("", ())
    return [
        (r[0], float(r[1]), r[2], r[3])
        for r in tx.all(
            f"SELECT schedule, tick, inbox_id, outcome FROM schedule_runs {where} "
            "ORDER BY tick, schedule",
            params,
        )
    ]
