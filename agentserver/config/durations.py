"""Every duration attribute of boot.xml (issue 45): which they are, what bounds each has,
and the errors a bad one gets. Pure.

The schemas give every one of them one grammar (:mod:`agentserver.core.durations`), so a
value of the wrong form fails validation; :func:`schema_message` turns that validation
error into one that names the element, the attribute and the accepted forms, never the
schema's internal type. Bounds a pattern cannot say (longer than 0, at most a day) are
checked by :func:`check_durations` once the document is valid. Each section's reader then
reads its durations with :func:`~agentserver.core.durations.parse_duration`.
"""

from __future__ import annotations

import enum
import re

from lxml import etree

from agentserver.config.problems import Report
from agentserver.core.durations import FORMS, DurationError, parse_duration


class Bound(enum.Enum):
    """What a duration attribute admits beyond its form."""

    #: Longer than 0.
    POSITIVE = "longer than 0"
    #: 0 allowed (it means "none" or "forever", as the attribute's doc says).
    NON_NEGATIVE = "0 or longer"
    #: Longer than 0 and at most a day (the HTTP gateway's bounded reply keeping).
    UP_TO_A_DAY = "longer than 0 and at most 1d"
    #: Longer than 0, or ``none`` (retention: kept forever).
    POSITIVE_OR_NONE = "longer than 0, or none"


_P, _Z, _D, _N = Bound.POSITIVE, Bound.NON_NEGATIVE, Bound.UP_TO_A_DAY, Bound.POSITIVE_OR_NONE

#: Element local name → its duration attributes and their bounds: every attribute of a
#: duration type in schemas/boot*.xsd (tests/test_durations.py holds the two together).
DURATIONS: dict[str, dict[str, Bound]] = {
    "http": {"reply-ttl": _D, "wait-timeout": _D, "ui-session-ttl": _D},
    "limits": {
        "inflight-ttl": _P,
        "read-timeout": _P,
        "write-timeout": _P,
        "hello-timeout": _P,
        "idle-timeout": _Z,
        "drain-timeout": _Z,
        "delivery-timeout": _P,
        "thread-ttl": _P,
    },
    "listener": {"timeout": _P, "step-timeout": _P},
    "mcp": {"timeout": _P, "connect-timeout": _P},
    "a2a": {"timeout": _P, "step-timeout": _P, "connect-timeout": _P},
    "webhook": {
        "first-delay": _P,
        "max-delay": _P,
        "retry-for": _P,
        "timeout": _P,
        "disable-after": _P,
    },
    "schedule": {"catchup-window": _Z, "jitter": _Z},
    "store": {
        "watchdog-interval": _P,
        "processing-timeout": _P,
        "dispatch-timeout": _P,
        "max-running": _P,
        "retry-base": _P,
        "lease": _P,
        "heartbeat": _P,
    },
    "agent": {
        "resume-deadline": _P,
        "llm-timeout": _P,
        "step-retry-base": _P,
        "max-retry-after": _P,
    },
    "retention": {
        "finished-tasks": _N,
        "step-log": _N,
        "events": _N,
        "acknowledged-replies": _N,
        "tombstones": _N,
        "deliveries": _N,
        "interval": _N,
    },
    "llm": {"timeout": _P},
    "retry": {"base-delay": _Z, "max-delay": _Z, "max-retry-after": _Z},
    "breaker": {"cooldown": _Z},
    "backend": {"timeout": _P},
}

_DAY = 86400.0


def bad_duration(element: str, attr: str, value: str) -> str:
    """The error for a value of the wrong form, e.g. ``<listener timeout="5x">``."""
    extra = " or none" if DURATIONS.get(element, {}).get(attr) is Bound.POSITIVE_OR_NONE else ""
    return f'<{element} {attr}="{value}">: not a duration: write {FORMS}{extra}'


def out_of_bounds(element: str, attr: str, value: str, bound: Bound) -> str:
    return f'<{element} {attr}="{value}">: the duration must be {bound.value}'


def check_durations(report: Report, root: etree._Element) -> None:
    """Report every duration attribute of the (valid) document outside its bounds."""
    for el in root.iter(etree.Element):
        attrs = DURATIONS.get(etree.QName(el).localname)
        if not attrs:
            continue
        for attr, bound in attrs.items():
            raw = el.get(attr)
            if raw is None or (bound is Bound.POSITIVE_OR_NONE and raw.strip() == "none"):
                continue
            local = etree.QName(el).localname
            try:
                seconds = parse_duration(raw)
            except DurationError:
                report.error(el.sourceline, bad_duration(local, attr, raw))
                continue
            if bound is Bound.NON_NEGATIVE:
                continue
            if seconds <= 0 or (bound is Bound.UP_TO_A_DAY and seconds > _DAY):
                report.error(el.sourceline, out_of_bounds(local, attr, raw, bound))


# libxml2's message for an attribute its pattern refuses (a type built on a number would
# add "... is not a valid value of the atomic type 'X'", naming the internal type).
_ATTR_ERROR = re.compile(
    r"^Element '(?:\{[^}]*\})?(?P<el>[^']+)', attribute '(?P<attr>[^']+)': "
    r"(?:\[facet 'pattern'\] The value '(?P<v1>.*)' is not accepted by the pattern|"
    r"'(?P<v2>.*)' is not a valid value of the atomic type)"
)


def schema_message(message: str) -> str | None:
    """The message to print for a schema validation message about a duration attribute;
    None for any other message."""
    m = _ATTR_ERROR.match(message)
    if m is None:
        return None
    element, attr = m["el"], m["attr"]
    if attr not in DURATIONS.get(element, {}):
        return None
    value = m["v1"] if m["v1"] is not None else m["v2"]
    return bad_duration(element, attr, value)
