"""A process's drain (``agentserver drain``, ``POST /v1/drain``; docs/deploy.md,
"Deploying with Turns in flight"): it takes no new work, finishes or hands over what it
holds, and then shuts down as at a stop, so that ``agentserver run`` exits 0."""

from __future__ import annotations

import logging
from typing import Any

import trio

from agentserver.agents.runtime import AgentRuntime, Holding

log = logging.getLogger("agentserver.drain")


class Drain:
    """This process's drain: started once (:meth:`start`), it runs in ``nursery`` and
    sets ``shutdown`` when the process holds nothing (at once without agents)."""

    def __init__(
        self, runtime: AgentRuntime | None, shutdown: trio.Event, nursery: trio.Nursery
    ) -> None:
        self._runtime = runtime
        self._shutdown = shutdown
        self._nursery = nursery
        self._started = False
        self._done = False
        self._holding = Holding()

    def start(self) -> dict[str, Any]:
        """Begin draining (again: nothing more); returns :meth:`state`. Never blocks."""
        if not self._started:
            self._started = True
            log.warning("draining: no new work is taken; exiting once nothing is held")
            self._nursery.start_soon(self._run)
        return self.state()

    def state(self) -> dict[str, Any]:
        """Whether the process drains, is done, and what it still holds."""
        return {
            "draining": self._started,
            "done": self._done,
            "holding": {"turns": self._holding.turns, "tool_calls": self._holding.calls},
        }

    def _seen(self, holding: Holding) -> None:
        if holding != self._holding:
            log.info(
                "draining: %d turn(s) running, %d tool call(s) out", holding.turns, holding.calls
            )
        self._holding = holding

    async def _run(self) -> None:
        if self._runtime is not None:
            await self._runtime.drain(self._seen)
        self._holding = Holding()
        self._done = True
        log.warning("drained: nothing held; shutting down")
        self._shutdown.set()
