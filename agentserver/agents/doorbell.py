"""The in-process doorbell (the seeds' NATS wakeup): a wake-up with no content.

Ringing is idempotent and never blocks: rings that arrive while nobody waits collapse into
one. The inbox is the source of truth, so a lost or merged ring costs at most one
watchdog interval.
"""

from __future__ import annotations

import trio


class Doorbell:
    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = trio.Event()

    def ring(self) -> None:
        """Wake the waiter (call from the trio thread)."""
        self._event.set()

    async def wait(self) -> None:
        """Wait, cancellably, for a ring since the last wait returned."""
        await self._event.wait()
        self._event = trio.Event()
