"""The connection and message limits of a server (boot.xml ``<limits>``), as plain data.

Here, below :mod:`agentserver.config`, because the TCP server applies them; the boot.xml
loader fills them in and :mod:`agentserver.config.topology` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentserver.core.xmlsafe import DEFAULT_MAX_MESSAGE_BYTES
from agentserver.pump.endpoint import DEFAULT_BUFFER_BYTES


@dataclass(frozen=True, slots=True)
class Limits:
    """Connection and message limits (boot.xml ``<limits>``; seconds unless stated)."""

    max_connections: int = 256
    max_inflight: int = 64
    max_inflight_bytes: int = DEFAULT_BUFFER_BYTES
    inflight_ttl: float = 120.0
    outgoing_buffer: int = 256
    outgoing_buffer_bytes: int = DEFAULT_BUFFER_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    read_timeout: float = 10.0
    write_timeout: float = 10.0
    hello_timeout: float = 5.0
    #: 0 means connections may stay idle forever.
    idle_timeout: float = 0.0
    drain_timeout: float = 5.0
    delivery_timeout: float = 10.0
    max_threads: int = 100_000
    #: Threads the conversations of one connection may hold: one client alone cannot
    #: fill the registry.
    max_threads_per_connection: int = 1024
    thread_ttl: float = 3600.0
