"""A schedule's settings (``<schedule>`` in boot.xml, ``POST /v1/schedules``) and its
ticks: when it fires, computed by cronsim (no cron parser here). Pure: time passed in.

Ticks are whole seconds since the epoch (floats with no fraction), computed in the
schedule's time zone, so daylight-saving transitions are cronsim's (docs/runs.md): a
wall-clock time that does not exist that day fires at the first second after the gap; one
that exists twice fires once, at its first occurrence.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import zoneinfo
from collections.abc import Iterator
from dataclasses import dataclass

from cronsim import CronSim, CronSimError

#: How a tick meets a previous run of the same schedule that has not ended (docs/runs.md).
OVERLAPS = ("skip", "buffer-one", "buffer-all", "cancel-other", "allow")
#: A schedule's name: what the HTTP API and the CLI address it by.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: How many missed ticks are counted one by one after an outage (the rest at once).
MAX_COUNTED = 100_000


class ScheduleInvalid(ValueError):
    """A schedule's settings are not usable; the message says which and why."""


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """One schedule: ``agent`` gets ``payload`` (one XML element, as bytes) at each tick
    of ``cron`` in ``timezone``. ``catchup_window_s``: a tick missed (the server down) by
    at most this much still fires on start, else it is counted skipped. ``jitter_s``: each
    tick starts up to this much later (the same offset in every process)."""

    name: str
    agent: str
    cron: str
    payload: bytes
    timezone: str = "UTC"
    overlap: str = "skip"
    catchup_window_s: float = 60.0
    jitter_s: float = 0.0

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise ScheduleInvalid(f"schedule name {self.name!r}: letters, digits, . _ - (64)")
        if self.overlap not in OVERLAPS:
            raise ScheduleInvalid(f"overlap must be one of {', '.join(OVERLAPS)}")
        if self.catchup_window_s < 0 or self.jitter_s < 0:
            raise ScheduleInvalid("catchup-window and jitter must be >= 0")
        try:
            zone(self.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ScheduleInvalid(f"unknown time zone {self.timezone!r}") from None
        try:
            next(CronSim(self.cron, datetime.datetime.now(datetime.UTC)))
        except (CronSimError, StopIteration) as exc:
            raise ScheduleInvalid(f"cron {self.cron!r}: {exc}") from None

    def ticks_after(self, t: float) -> Iterator[float]:
        """The ticks strictly after time ``t`` (seconds since the epoch), in order."""
        start = datetime.datetime.fromtimestamp(int(t), zone(self.timezone))
        for when in CronSim(self.cron, start):
            yield float(int(when.timestamp()))

    def next_tick(self, t: float) -> float:
        return next(self.ticks_after(t))

    def offset(self, tick: float) -> float:
        """This tick's jitter: the same in every process (a hash of name and tick)."""
        if not self.jitter_s:
            return 0.0
        digest = hashlib.blake2b(f"{self.name}@{tick:.0f}".encode(), digest_size=8).digest()
        return self.jitter_s * int.from_bytes(digest) / 2**64


def zone(name: str) -> datetime.tzinfo:
    return datetime.UTC if name in ("UTC", "Etc/UTC") else zoneinfo.ZoneInfo(name)


def missed(spec: ScheduleSpec, since: float, until: float) -> tuple[int, float]:
    """How many ticks in ``[since, until]`` (counted up to :data:`MAX_COUNTED`) and the
    first tick after ``until``."""
    count = 0
    tick = since
    for tick in spec.ticks_after(since - 1):
        if tick > until or count >= MAX_COUNTED:
            break
        count += 1
    if tick <= until:
        tick = spec.next_tick(until)
    return count, tick
