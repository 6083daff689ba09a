"""The step log's rows and its in-memory keeper (agentserver.remote.hub records them).

Events: ``step.dispatched`` (an attempt given to a runner; detail: the runner
connection), ``step.retried``, ``step.succeeded``, ``step.failed``, ``step.timed_out``
and ``step.cancelled``. :class:`StepLog` is what the hub writes to; without an agent store
:class:`MemoryStepLog` keeps the last :data:`MEMORY_ROWS` rows (gone at restart); with one,
:class:`agentserver.agents.store.step_log.StoreStepLog` makes them durable.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

#: Rows a :class:`MemoryStepLog` keeps (oldest dropped).
MEMORY_ROWS = 4096
#: The most rows one query returns.
MAX_ROWS = 1000


# Not frozen: the log numbers a row in place (a dataclasses.replace per row cost more
# than the rest of recording it).
@dataclass(slots=True)
class StepRow:
    """One step event. ``attempt`` is 1 for the first try (0 on ``step.dispatched`` and
    ``step.cancelled``, which are not counted per attempt); ``seq`` is set by the log."""

    step: str
    listener: str
    caller: str
    attempt: int
    event: str
    detail: str = ""
    at: float = 0.0
    seq: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "step": self.step,
            "listener": self.listener,
            "caller": self.caller,
            "attempt": self.attempt,
            "event": self.event,
            "detail": self.detail,
            "at": self.at,
        }


class StepLog(Protocol):
    durable: bool

    def append(self, row: StepRow) -> StepRow:
        """Record ``row``. Never blocks: called from the hub's synchronous paths."""
        ...

    async def rows(
        self,
        *,
        step: str | None = None,
        listener: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[StepRow]:
        """Rows in ``seq`` order after ``after``, optionally of one step or listener."""
        ...

    async def flush(self) -> None:
        """Wait until the rows appended so far are kept (written, for a durable log)."""
        ...


def limit_rows(limit: int) -> int:
    return max(1, min(limit, MAX_ROWS))


class MemoryStepLog:
    """The step log of a server without an agent store: the last rows, in memory."""

    durable = False

    def __init__(self, size: int = MEMORY_ROWS) -> None:
        self._rows: collections.deque[StepRow] = collections.deque(maxlen=size)
        self._seq = 0

    async def flush(self) -> None:
        """Nothing to wait for: a row is kept as it is appended."""

    def append(self, row: StepRow) -> StepRow:
        self._seq += 1
        row.seq = self._seq
        self._rows.append(row)
        return row

    async def rows(
        self,
        *,
        step: str | None = None,
        listener: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[StepRow]:
        return self.select(step=step, listener=listener, after=after, limit=limit)

    def select(
        self,
        *,
        step: str | None = None,
        listener: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[StepRow]:
        out = []
        for row in self._rows:
            if row.seq <= after or (step and row.step != step):
                continue
            if listener and row.listener != listener:
                continue
            out.append(row)
            if len(out) >= limit_rows(limit):
                break
        return out

    def __iter__(self) -> Iterator[StepRow]:
        return iter(list(self._rows))
