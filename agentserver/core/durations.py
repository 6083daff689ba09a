"""Durations as boot.xml writes them, everywhere in it: a number of seconds (``30``,
``2.5``) or a number with a unit, ``ms``, ``s``, ``m``, ``h`` or ``d`` (``250ms``,
``30s``, ``5m``, ``24h``, ``7d``). The one parser of them all (issue 45): the schemas'
duration types carry :data:`XSD_PATTERN`, the same grammar, so a value the schema lets
through always parses here. Pure."""

from __future__ import annotations

import re

#: The accepted forms, as an error message names them.
FORMS = "a number of seconds (30, 2.5) or a number with a unit: ms, s, m, h or d (250ms, 30s, 5m, 24h, 7d)"

#: Seconds per unit; no unit is seconds.
UNITS: dict[str | None, float] = {
    None: 1.0,
    "ms": 0.001,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
}

#: The grammar as the schemas write it (an XSD pattern is anchored at both ends); a test
#: holds the schemas' duration types to it, and to what :func:`parse_duration` accepts.
XSD_PATTERN = r"\s*([0-9]+(\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h|d)?\s*"
# XML Schema's \s is these four; Python's would take Unicode spaces the schema refuses.
_DURATION = re.compile(XSD_PATTERN.replace(r"\s", "[ \t\n\r]"))


class DurationError(ValueError):
    """``text`` is not a duration; the message names the accepted forms."""

    def __init__(self, text: str) -> None:
        super().__init__(f"{text!r} is not a duration: write {FORMS}")
        self.text = text


def parse_duration(text: str) -> float:
    """Seconds of ``text`` (``"5m"`` → 300.0). Raises :class:`DurationError`."""
    m = _DURATION.fullmatch(text)
    if m is None:
        raise DurationError(text)
    seconds = float(m.group(1)) * UNITS[m.group(3)]
    if seconds == float("inf"):  # hundreds of digits: no duration anyone means
        raise DurationError(text)
    return seconds


def is_duration(text: str) -> bool:
    """Whether :func:`parse_duration` accepts ``text``."""
    return _DURATION.fullmatch(text) is not None
