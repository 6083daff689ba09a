"""Where a model's reply quotes code, in the Markdown it writes (pure; no I/O).

Markup inside a quote is *mentioned*, not written: the payload finder
(:mod:`agentserver.agents.reading.parsing`) never takes an unknown element there for an attempt
to send something. Quotes are

- inline code spans: a run of N backticks up to the next run of exactly N (CommonMark);
  a run with no partner is a literal backtick;
- fenced code blocks (a line of 3+ backticks or tildes, up to 3 spaces of indentation, up
  to a line of the same character at least as long, or the end of the text) whose info
  string names a language other than XML, such as ```` ```html ```` or ```` ```python ````.

A fence with no info string or with ``xml`` is not a quote: that is how models write
the XML they mean to send. Backticks inside any fenced block are literal (Markdown).
"""

from __future__ import annotations

import re
from bisect import bisect_right

__all__ = ["QuotedSpans", "quoted_spans"]

_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})([^\n]*)$", re.MULTILINE)
_BACKTICKS = re.compile(r"`+")
_SENDABLE_FENCES = frozenset({"", "xml"})


class QuotedSpans:
    """Sorted, disjoint ``[start, end)`` ranges of quoted text."""

    __slots__ = ("_ends", "_starts")

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        spans.sort()
        self._starts = [s for s, _ in spans]
        self._ends = [e for _, e in spans]

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, int):
            return False
        i = bisect_right(self._starts, index) - 1
        return i >= 0 and index < self._ends[i]

    def as_list(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))


def _fences(text: str) -> list[tuple[int, int, bool]]:
    """``(start, end, quoted)`` of every fenced block, in order."""
    blocks: list[tuple[int, int, bool]] = []
    pos = 0
    while (m := _FENCE_OPEN.search(text, pos)) is not None:
        marker, info = m.group(1), m.group(2)
        if marker[0] == "`" and "`" in info:
            pos = m.end()  # not a fence (CommonMark): an inline span's backticks
            continue
        closing = re.compile(
            r"^ {0,3}" + re.escape(marker[0]) + "{" + str(len(marker)) + r",}[ \t]*$",
            re.MULTILINE,
        )
        close = closing.search(text, m.end())
        end = len(text) if close is None else close.end()
        words = info.strip().split()
        language = words[0].lower() if words else ""
        blocks.append((m.start(), end, language not in _SENDABLE_FENCES))
        pos = end
    return blocks


def _inline_spans(text: str, start: int, end: int, out: list[tuple[int, int]]) -> None:
    runs = [(m.start(), m.end()) for m in _BACKTICKS.finditer(text, start, end)]
    # The next run of the same length, for each run: one pass from the end keeps this
    # linear however many unmatched runs a reply has.
    partner: list[int | None] = [None] * len(runs)
    seen: dict[int, int] = {}
    for i in range(len(runs) - 1, -1, -1):
        n = runs[i][1] - runs[i][0]
        partner[i] = seen.get(n)
        seen[n] = i
    i = 0
    while i < len(runs):
        j = partner[i]
        if j is None:
            i += 1  # no partner: a literal run of backticks
            continue
        out.append((runs[i][0], runs[j][1]))
        i = j + 1


def quoted_spans(text: str) -> QuotedSpans:
    """The quoted parts of ``text`` (see the module docstring)."""
    spans: list[tuple[int, int]] = []
    pos = 0
    for start, end, quoted in _fences(text):
        _inline_spans(text, pos, start, spans)
        if quoted:
            spans.append((start, end))
        pos = end
    _inline_spans(text, pos, len(text), spans)
    return QuotedSpans(spans)
