"""Tunables of the agent store, worker and watchdog (boot.xml ``<store>``) and of one
agent (boot.xml ``<agent>``), as boot.xml's loader hands them over."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentserver.agents.profile import ResultField


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
    #: ``<store url>`` (or its ``url-env`` variable): the agents' store is this PostgreSQL
    #: database instead of the SQLite file at ``path`` (docs/deploy.md).
    url: str | None = None
    #: PostgreSQL only: how long a process's claim on a Turn lasts without a heartbeat,
    #: and how often each process renews the claims it holds.
    lease_s: float = 10.0
    heartbeat_s: float = 3.0
    #: PostgreSQL only: connections (and so store transactions in flight) per process.
    pool_size: int = 8

    def __post_init__(self) -> None:
        if self.worker_concurrency < 1:
            raise ValueError("worker_concurrency must be >= 1")
        for name in ("watchdog_interval_s", "processing_timeout_s", "dispatch_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_running_s <= 0 or self.retry_base_s < 0 or self.max_retries < 0:
            raise ValueError("invalid retry or running limits")
        if self.heartbeat_s <= 0 or self.lease_s <= self.heartbeat_s:
            raise ValueError(
                f"lease ({self.lease_s}s) must be longer than heartbeat ({self.heartbeat_s}s) > 0"
            )
        if self.pool_size < 1:
            raise ValueError("pool_size must be >= 1")

    @property
    def backend(self) -> str:
        """``"postgresql"`` with a URL, else ``"sqlite"``."""
        return "postgresql" if self.url else "sqlite"

    @property
    def where(self) -> str:
        """The store as a log line may show it (never a password)."""
        if self.url is None:
            return str(self.path)
        from agentserver.agents.pg.url import redact

        return redact(self.url)


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """What boot.xml's ``<agent>`` element says about one agent (``AgentProfileType``).

    Defaults equal :class:`~agentserver.agents.profile.AgentProfile`'s. The model is
    named here as written (``model``, and ``model_env``, the variable that overrides it):
    it is resolved against the environment when the agent starts, with
    :func:`agentserver.agents.config.profile_from_settings`.
    """

    model: str | None = None
    model_env: str | None = None
    #: None: the profile's default prompt.
    system_prompt: str | None = None
    max_steps: int = 12
    resume_deadline_s: float = 60.0
    llm_timeout_s: float = 300.0
    max_tokens: int | None = None
    step_retries: int = 3
    step_retry_base_s: float = 2.0
    max_retry_after_s: float = 60.0
    context_window: int | None = None
    context_reserve: int = 8192
    keep_recent: int = 16384
    tool_result_share: float = 0.25
    memory: str = "none"
    must_end_with: tuple[str, ...] = ()
    result_fields: tuple[ResultField, ...] = ()
    terminate_tools: tuple[str, ...] = ()
    loop_warn: int = 2
    loop_block: int = 5
