"""boot.xml's ``<schedules>`` (docs/runs.md): each ``<schedule>`` read into a
:class:`~agentserver.agents.profile.schedule.ScheduleSpec`, its agent checked against the
listeners, its cron and time zone by cronsim and zoneinfo, its payload (one element)
kept as bytes. Problems are reported by line; a bad schedule is left out."""

from __future__ import annotations

from collections.abc import Callable

from lxml import etree

from agentserver.agents.profile.schedule import ScheduleInvalid, ScheduleSpec
from agentserver.config.imports import B
from agentserver.config.problems import Problem, Report
from agentserver.core.durations import parse_duration


def read_schedules(
    report: Report,
    el: etree._Element | None,
    agents: set[str],
    cause_of: Callable[[str], Problem | None] = lambda name: None,
) -> tuple[ScheduleSpec, ...]:
    """The schedules of ``<schedules>`` (``el``; None: none). ``agents``: the agent
    listeners' names; ``cause_of(name)``: the error that made a declared listener fail
    (a schedule naming it is said under that error, not as one of its own)."""
    if el is None:
        return ()
    out: list[ScheduleSpec] = []
    seen: set[str] = set()
    for item in el.iterfind(B + "schedule"):
        line = item.sourceline
        name = item.get("name", "")
        payload = [c for c in item if isinstance(c.tag, str)]
        if name in seen:
            report.error(line, f"schedule {name!r} is declared twice")
            continue
        seen.add(name)
        agent = item.get("agent", "")
        if agent not in agents:
            if (cause := cause_of(agent)) is not None:
                report.note(cause, f"(so schedule {name!r}, line {line}, has no agent)")
                continue
            report.error(line, f"schedule {name!r}: {agent!r} is not an agent listener")
            continue
        if len(payload) != 1:
            report.error(line, f"schedule {name!r}: its task is one element inside it")
            continue
        try:
            spec = ScheduleSpec(
                name=name,
                agent=agent,
                cron=item.get("cron", ""),
                payload=etree.tostring(_detached(payload[0])),
                timezone=item.get("timezone", "UTC"),
                overlap=item.get("overlap", "skip"),
                catchup_window_s=parse_duration(item.get("catchup-window", "60")),
                jitter_s=parse_duration(item.get("jitter", "0")),
            )
        except (ScheduleInvalid, ValueError) as exc:
            report.error(line, f"schedule {name!r}: {exc}")
            continue
        out.append(spec)
    return tuple(out)


def _detached(el: etree._Element) -> etree._Element:
    """A copy of ``el`` with only the namespace declarations it uses (not boot.xml's)."""
    copy = etree.fromstring(etree.tostring(el))
    etree.cleanup_namespaces(copy)
    return copy
