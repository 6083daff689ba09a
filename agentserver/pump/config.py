"""PumpConfig: a pump's limits and timeouts, fixed for its life."""

from __future__ import annotations

from dataclasses import dataclass

from agentserver.core.xmlsafe import DEFAULT_MAX_MESSAGE_BYTES
from agentserver.pump.endpoint import DEFAULT_BUFFER_BYTES


@dataclass(frozen=True, slots=True)
class PumpConfig:
    organism: str = "organism"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_threads: int = 100_000
    #: Threads the conversations of one endpoint may hold (its share of ``max_threads``).
    max_threads_per_endpoint: int = 1024
    thread_idle_ttl: float = 3600.0
    expire_interval: float = 30.0
    delivery_timeout: float = 10.0
    endpoint_buffer: int = 256
    endpoint_buffer_bytes: int = DEFAULT_BUFFER_BYTES
    drain_timeout: float = 5.0
    #: ``run --explain-refusals``: every ``<huh>`` carries the logged reason in
    #: ``<detail>`` (development only: it tells a sender about the topology).
    explain_refusals: bool = False
