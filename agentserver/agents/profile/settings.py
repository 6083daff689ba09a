"""Tunables of the agent store, worker and watchdog (boot.xml ``<store>``) and of one
agent (boot.xml ``<agent>``), as boot.xml's loader hands them over."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentserver.agents.profile.agent import AgentProfile, ResultField
from agentserver.agents.profile.retention import RetentionOverride, RetentionSettings


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
    #: PostgreSQL only: how store transactions reach the server: ``"trio"`` (libpq's
    #: non-blocking API on the trio thread, pipelined; agents/store/pg/trio_executor.py) or
    #: ``"thread"`` (the blocking driver in worker threads; agents/store/pg/executor.py).
    pg_executor: str = "trio"
    #: ``<store><retention>`` (agents/profile/retention.py): None keeps everything and
    #: runs no pruner.
    retention: RetentionSettings | None = None
    #: ``<store fair-share="true">``: the next queued Turn of an agent is chosen fairly
    #: between the clients that sent them (agents/store/sql/fair.py), each client's share
    #: its ``<client weight>`` (pairs of client name and weight; unnamed clients weigh 1).
    #: None: first come, first served (and no statement added).
    fair_weights: tuple[tuple[str, float], ...] | None = None

    def __post_init__(self) -> None:
        if self.worker_concurrency < 1:
            raise ValueError("worker_concurrency must be >= 1")
        for name in ("watchdog_interval_s", "processing_timeout_s", "dispatch_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_running_s <= 0 or self.retry_base_s < 0 or self.max_retries < 0:
            raise ValueError("invalid retry or running limits")
        if self.pg_executor not in ("trio", "thread"):
            raise ValueError(f"pg_executor must be 'trio' or 'thread', not {self.pg_executor!r}")
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
        from agentserver.agents.profile.store_url import redact

        return redact(self.url)


def profile_default(name: str) -> Any:
    """:class:`~agentserver.agents.profile.agent.AgentProfile`'s default for ``name``: each
    default is written once, there, and boot.xml's settings take it when left out."""
    return AgentProfile.__dataclass_fields__[name].default


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """What boot.xml's ``<agent>`` element says about one agent (``AgentProfileType``).

    Defaults are :class:`~agentserver.agents.profile.agent.AgentProfile`'s
    (:func:`profile_default`), but for the model and the prompt. The model is named here as
    written (``model``, and ``model_env``, the variable that overrides it):
    it is resolved against the environment when the agent starts, with
    :func:`agentserver.agents.profile.config.profile_from_settings`.
    """

    model: str | None = None
    model_env: str | None = None
    #: None: the profile's default prompt.
    system_prompt: str | None = None
    max_steps: int = profile_default("max_steps")
    resume_deadline_s: float = profile_default("resume_deadline_s")
    llm_timeout_s: float = profile_default("llm_timeout_s")
    max_tokens: int | None = profile_default("max_tokens")
    step_retries: int = profile_default("step_retries")
    step_retry_base_s: float = profile_default("step_retry_base_s")
    max_retry_after_s: float = profile_default("max_retry_after_s")
    context_window: int | None = profile_default("context_window")
    context_reserve: int = profile_default("context_reserve")
    keep_recent: int = profile_default("keep_recent")
    tool_result_share: float = profile_default("tool_result_share")
    memory: str = profile_default("memory")
    multitask: str = profile_default("multitask")
    must_end_with: tuple[str, ...] = profile_default("must_end_with")
    result_fields: tuple[ResultField, ...] = profile_default("result_fields")
    terminate_tools: tuple[str, ...] = profile_default("terminate_tools")
    loop_warn: int = profile_default("loop_warn")
    loop_block: int = profile_default("loop_block")
    #: ``<agent><retention>``: this agent's overrides of the store's retention.
    retention: RetentionOverride | None = None
    #: ``<agent version>``: the version's name (None: its digest names it).
    version: str | None = None
    #: ``<agent versioning>``: what a Turn does on a process serving another version.
    versioning: str = profile_default("versioning")
