"""Tunables of the agent store, worker and watchdog (boot.xml ``<store>``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Defaults are safe for one server process on one SQLite file.

    Durations are seconds. ``processing_timeout_s`` must exceed the longest time a worker
    holds an inbox row in ``processing`` (a single short transaction plus one ``await``),
    ``max_running_s`` the longest legitimate model step.
    """

    path: Path = Path("state/agents.sqlite3")
    worker_concurrency: int = 4
    watchdog_interval_s: float = 1.0
    processing_timeout_s: float = 30.0
    dispatch_timeout_s: float = 60.0
    max_running_s: float = 900.0
    retry_base_s: float = 0.05
    max_retries: int = 8
    claim_batch: int = 32
    client_replies_max: int = 256
    reply_max_attempts: int = 10

    def __post_init__(self) -> None:
        if self.worker_concurrency < 1:
            raise ValueError("worker_concurrency must be >= 1")
        for name in ("watchdog_interval_s", "processing_timeout_s", "dispatch_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_running_s <= 0 or self.retry_base_s < 0 or self.max_retries < 0:
            raise ValueError("invalid retry or running limits")
