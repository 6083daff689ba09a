"""Spend budgets as data (pure): what boot.xml's ``<budget>`` declares, which budgets a
model call pays into, the period a moment falls in, and the stable refusal text.

A budget is named by its scope (docs/budgets.md):

- ``organism``: every model call of the server;
- ``agent:NAME``: every call of the agent ``NAME``;
- ``client:NAME``: every call made for tasks sent by the named client ``NAME``;
- ``client:NAME@agent:AGENT``: the client's tasks on that one agent.

Periods are calendar periods in the budget's time zone: ``day`` starts at local midnight,
``week`` on Monday at midnight, ``month`` on the 1st at midnight; ``total`` never resets.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import zoneinfo
from dataclasses import dataclass

__all__ = [
    "PERIODS",
    "BudgetSpec",
    "Need",
    "Shortfall",
    "applicable",
    "budget_name",
    "period_bounds",
    "refusal_text",
]

PERIODS = ("day", "week", "month", "total")
ORGANISM = "organism"


def budget_name(*, client: str | None = None, agent: str | None = None) -> str:
    """The name of the budget of a scope (see the module docstring)."""
    if client and agent:
        return f"client:{client}@agent:{agent}"
    if client:
        return f"client:{client}"
    if agent:
        return f"agent:{agent}"
    return ORGANISM


_NAME = re.compile(r"^(organism|agent:[^@:]+|client:[^@:]+(@agent:[^@:]+)?)$")


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


@dataclass(frozen=True, slots=True)
class BudgetSpec:
    """One declared budget. ``tokens``/``cost`` None: that dimension is not limited
    (at least one is set). ``soft``: the fraction (0..1] at which the soft event fires."""

    name: str
    tokens: int | None = None
    cost: float | None = None
    period: str = "month"
    soft: float | None = None
    timezone: str = "UTC"
    line: int = 0

    def __post_init__(self) -> None:
        if self.period not in PERIODS:
            raise ValueError(f"period must be one of {', '.join(PERIODS)}, not {self.period!r}")
        if self.tokens is None and self.cost is None:
            raise ValueError("a budget limits tokens, cost or both")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError("tokens must be at least 1")
        if self.cost is not None and not (self.cost > 0 and math.isfinite(self.cost)):
            raise ValueError("cost must be a positive number")
        if self.soft is not None and not 0 < self.soft <= 1:
            raise ValueError("soft must be a percentage in (0, 100]")
        if not valid_name(self.name):
            raise ValueError(f"not a budget name: {self.name!r}")
        zone(self.timezone)


def zone(name: str) -> dt.tzinfo:
    """The time zone ``name`` (IANA), or ValueError."""
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"unknown time zone {name!r}") from exc


def parse_soft(text: str) -> float:
    """``"80%"`` → 0.8 (ValueError otherwise)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%\s*", text)
    if not m:
        raise ValueError(f"soft must be a percentage like 80%, not {text!r}")
    return float(m.group(1)) / 100


def period_bounds(period: str, timezone: str, now: float) -> tuple[float, float]:
    """The period holding ``now`` (epoch seconds): its start and the next one's start
    (``inf`` for ``total``, whose start is 0)."""
    if period == "total":
        return 0.0, math.inf
    tz = zone(timezone)
    local = dt.datetime.fromtimestamp(now, tz)
    start = local.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        nxt = start.date() + dt.timedelta(days=1)
    elif period == "week":
        start = start - dt.timedelta(days=start.weekday())
        nxt = start.date() + dt.timedelta(days=7)
    else:
        start = start.replace(day=1)
        nxt = (start.date() + dt.timedelta(days=32)).replace(day=1)
    start = dt.datetime.combine(start.date(), dt.time(), tz)
    end = dt.datetime.combine(nxt, dt.time(), tz)
    return start.timestamp(), end.timestamp()


def applicable(declared: set[str] | frozenset[str], agent: str, client: str | None) -> list[str]:
    """The declared budgets a call of ``agent`` for ``client`` pays into, sorted (the
    order rows are locked in, so that two reservations never deadlock)."""
    names = [ORGANISM, budget_name(agent=agent)]
    if client:
        names += [budget_name(client=client), budget_name(client=client, agent=agent)]
    return sorted(n for n in names if n in declared)


@dataclass(frozen=True, slots=True)
class Need:
    """A call's worst case: tokens and cost."""

    tokens: int
    cost: float


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Why a call did not fit a budget that is not spent: its worst case (``needed``)
    is more than what ``remains`` (neither spent nor reserved) in ``unit``
    (``tokens`` or ``cost``)."""

    needed: float
    remains: float
    unit: str = "tokens"


def refusal_text(
    name: str, period: str, resets_at: float, shortfall: Shortfall | None = None
) -> str:
    """The stable reason a task or Turn is refused for: it names the budget and when it
    resets (ISO 8601, UTC), or says it never does. A budget with something left but
    less than the call's worst case (``shortfall``) says so, with both figures: "this
    call needs up to 1,405 tokens; 1,000 remain of client:alice (day)"; one with nothing
    left "is spent"."""
    if math.isinf(resets_at):
        when = "it never resets (period total)"
    else:
        stamp = dt.datetime.fromtimestamp(resets_at, dt.UTC).isoformat().replace("+00:00", "Z")
        when = f"it resets at {stamp}"
    if shortfall is not None and shortfall.remains > 0:
        if shortfall.unit == "tokens":
            needed, left = f"{int(shortfall.needed):,} tokens", f"{int(shortfall.remains):,}"
        else:
            needed, left = f"{shortfall.needed:.4g} in cost", f"{shortfall.remains:.4g}"
        return (
            f"budget exhausted: this call needs up to {needed}; {left} remain of"
            f" {name} ({period}); {when}"
        )
    return f"budget exhausted: {name} ({period}) is spent; {when}"
