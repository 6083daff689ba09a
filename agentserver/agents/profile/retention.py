"""Retention (boot.xml ``<retention>``, issue 38): how long the store keeps what a Turn
left behind, globally (inside ``<store>``) and per agent (inside ``<agent>``). Pure.

Without a ``<retention>`` element the store keeps everything, as before, and no pruner
runs. With one, each attribute left out takes its default (:data:`DEFAULTS`); the value
``none`` keeps that kind of row forever. An agent's ``<retention>`` overrides the global
``finished-tasks``, ``keep-last`` and ``events`` for that agent's rows (the step log,
the acknowledged replies, the tombstones, the deliveries and the interval are the
store's, global only). An agent's ``finished-tasks`` also bounds its schedules' run
records and its A2A tasks' records.

Durations are written ``90``, ``90s``, ``15m``, ``1h``, ``7d`` or ``250ms``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from lxml import etree

from agentserver.core.durations import DurationError
from agentserver.core.durations import parse_duration as core_duration

NONE = "none"


def parse_duration(text: str, what: str) -> float | None:
    """Seconds of ``text`` (None for ``none``). Raises ValueError naming ``what``."""
    if text.strip() == NONE:
        return None
    try:
        seconds = core_duration(text)
    except DurationError as exc:
        raise ValueError(f"{what}: {exc}, or none") from None
    if seconds <= 0:
        raise ValueError(f"{what}: {text!r} must be longer than 0")
    return seconds


def parse_count(text: str, what: str) -> int | None:
    """A count of ``text`` (None for ``none``). Raises ValueError naming ``what``."""
    if text.strip() == NONE:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a count or none") from None
    if value < 0:
        raise ValueError(f"{what}: {value} must be >= 0")
    return value


@dataclass(frozen=True, slots=True)
class AgentRetention:
    """The part of retention an agent may set for its own rows (None: kept forever)."""

    #: A finished task (its Turn: inbox rows, steps, cards, decisions, approvals, reply)
    #: older than this goes, unless it is among the newest ``keep_last`` of its
    #: conversation (for an agent without memory, of its caller).
    finished_tasks_s: float | None = 30 * 86400.0
    keep_last: int | None = 50
    #: Execution edges (the store's audit events) older than this go.
    events_s: float | None = 86400.0


@dataclass(frozen=True, slots=True)
class RetentionSettings:
    """The store's retention: the global values, each agent's overrides, the interval."""

    defaults: AgentRetention = field(default_factory=AgentRetention)
    #: Rows of the remote step log whose step has had no event for this long go.
    step_log_s: float | None = 7 * 86400.0
    #: Turn replies delivered (``sent``/``undeliverable``) this long ago go (a reply still
    #: ``pending`` never does; a named client's kept replies go only when it acknowledges).
    acknowledged_replies_s: float | None = 3600.0
    #: A pruned task's tombstone (what makes a read of its thread answer "pruned" rather
    #: than "not found") goes this long after the task was pruned.
    tombstones_s: float | None = 30 * 86400.0
    #: Webhook (and A2A push) deliveries done (delivered, expired, cancelled) this long ago
    #: go, and with a conversation's last one its sequence counter (its next event would
    #: be numbered from 1 again). Without retention the sender keeps them a day.
    deliveries_s: float | None = 86400.0
    #: How often the pruner runs.
    interval_s: float = 300.0
    agents: Mapping[str, AgentRetention] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("retention interval must be > 0")

    def for_agent(self, agent_id: str) -> AgentRetention:
        return self.agents.get(agent_id, self.defaults)

    def with_overrides(self, overrides: Mapping[str, RetentionOverride]) -> RetentionSettings:
        """These settings with each agent's ``<retention>`` applied over the globals."""
        return replace(self, agents={name: o.over(self.defaults) for name, o in overrides.items()})


#: Each attribute's default, as boot.xml would write it (docs/operations.md).
DEFAULTS = {
    "finished-tasks": "30d",
    "keep-last": "50",
    "step-log": "7d",
    "events": "1d",
    "acknowledged-replies": "1h",
    "tombstones": "30d",
    "deliveries": "1d",
    "interval": "5m",
}


def retention_from_element(el: etree._Element | None) -> RetentionSettings | None:
    """The store's ``<retention>`` (None: no element, keep everything, no pruner).
    Raises ValueError for a value it cannot use."""
    if el is None:
        return None

    def get(name: str) -> str:
        return el.get(name, DEFAULTS[name])

    interval = parse_duration(get("interval"), "retention interval")
    return RetentionSettings(
        defaults=(agent_retention_from_element(el) or RetentionOverride()).over(AgentRetention()),
        step_log_s=parse_duration(get("step-log"), "retention step-log"),
        acknowledged_replies_s=parse_duration(
            get("acknowledged-replies"), "retention acknowledged-replies"
        ),
        tombstones_s=parse_duration(get("tombstones"), "retention tombstones"),
        deliveries_s=parse_duration(get("deliveries"), "retention deliveries"),
        interval_s=interval if interval is not None else 300.0,
    )


@dataclass(frozen=True, slots=True)
class RetentionOverride:
    """What an ``<agent>``'s ``<retention>`` wrote: (attribute, value) pairs, applied over
    the store's global values (an attribute left out inherits them)."""

    values: tuple[tuple[str, float | int | None], ...] = ()

    def over(self, base: AgentRetention) -> AgentRetention:
        out = base
        for name, value in self.values:
            if name == "finished-tasks":
                out = replace(out, finished_tasks_s=value)
            elif name == "keep-last":
                out = replace(out, keep_last=None if value is None else int(value))
            elif name == "events":
                out = replace(out, events_s=value)
        return out


class HasRetention(Protocol):
    """What carries an agent's ``<retention>``: its profile as the server runs it, or its
    settings as boot.xml wrote them (``agentserver store`` reads those)."""

    @property
    def retention(self) -> RetentionOverride | None: ...


def agent_retention_from_element(el: etree._Element | None) -> RetentionOverride | None:
    """An ``<agent>``'s ``<retention>`` (None without one). Raises ValueError."""
    if el is None:
        return None
    values: list[tuple[str, float | int | None]] = []
    if (v := el.get("finished-tasks")) is not None:
        values.append(("finished-tasks", parse_duration(v, "retention finished-tasks")))
    if (v := el.get("keep-last")) is not None:
        values.append(("keep-last", parse_count(v, "retention keep-last")))
    if (v := el.get("events")) is not None:
        values.append(("events", parse_duration(v, "retention events")))
    return RetentionOverride(tuple(values))
