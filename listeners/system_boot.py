"""The system boot listener: receives the ``<boot>`` primitive the server injects at start
on the root thread ``system.<organism>``.

It logs the boot and, when a console is attached, sends the console its first prompt
(routed by root tag to the boot listener's peer that takes ``<prompt>``).
"""

from __future__ import annotations

import logging

from agentserver.core.listener import HandlerMetadata, HandlerResponse
from agentserver.listeners.console import Prompt
from agentserver.primitives.core import Boot

log = logging.getLogger("agentserver.boot")


class SystemBoot:
    """Handler of the boot listener (accepts the core :class:`Boot`)."""

    def __init__(self, *, start_console: bool, banner: list[str] | None = None) -> None:
        self._start_console = start_console
        self._banner = list(banner or ())

    async def __call__(self, payload: Boot, meta: HandlerMetadata) -> HandlerResponse | None:
        if meta.from_id != "system":
            # Only the pump sends boot primitives; anything else is ignored.
            return None
        log.info(
            "organism %s booted at %s with %d listeners",
            payload.organism,
            payload.timestamp,
            payload.listener_count,
        )
        if self._start_console:
            return HandlerResponse(Prompt(lines=self._banner))
        return None
