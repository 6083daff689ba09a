"""The agents of a running server, as parts: :class:`AgentService` (the runtime and the
tasks that run beside it, built once), :class:`LateHandler` (an agent listener's handler
bound once the runtime exists), the LLM port of boot.xml's ``<llm>`` (:func:`open_llm`)
and the retention the pruner applies (:func:`effective_retention`).

The composition root builds them in order and passes each its parts
(:func:`agentserver.app.agents.start_agents`, called from ``app/root.py``): every
listener declared with ``agent="true"`` is run by the runtime: its pump handler only
does intake (:func:`agentserver.agents.edge.bridge.agent_handler`), its Turns run in the
worker, its model calls go through the LLM router built from boot.xml's ``<llm>``, and its
state lives in the store of ``<store>`` (default ``state/agents.sqlite3`` next to
boot.xml).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio
from lxml import etree

from agentserver.agents.edge.bridge import PumpPorts
from agentserver.agents.edge.llm_adapter import RouterLLM
from agentserver.agents.errors import LLMUnavailable
from agentserver.agents.governance.budgets import Budgets, WorstPrice
from agentserver.agents.ports import LLMCompletion, LLMPort, LLMRequest
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.retention import (
    AgentRetention,
    HasRetention,
    RetentionSettings,
)
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.runtime import AgentRuntime
from agentserver.agents.store.sql_store import SqlAgentStore
from agentserver.core.listener import Handler, HandlerMetadata, HandlerResult
from agentserver.llm.config import RouterConfig
from agentserver.observability import LLMTelemetry, Metrics, Tracing

if TYPE_CHECKING:
    from agentserver.llm.router import Router

log = logging.getLogger(__name__)


class LateHandler:
    """A listener handler bound after the pump starts (the agent runtime needs the running
    pump's generated ``usage_instructions``). Until bound it refuses (the caller gets one
    ``<huh>``); the server binds every agent before it accepts connections."""

    __slots__ = ("name", "target")

    def __init__(self, name: str) -> None:
        self.name = name
        #: The handler it calls once bound (read only: :meth:`bind` sets it).
        self.target: Handler | None = None

    def bind(self, target: Handler) -> None:
        """Call ``target`` from now on (once the agent runtime runs)."""
        self.target = target

    async def __call__(self, payload: etree._Element, meta: HandlerMetadata) -> HandlerResult:
        if self.target is None:
            raise RuntimeError(f"agent {self.name!r} is not running")
        return await self.target(payload, meta)


class NoLLM:
    """The LLM port when boot.xml declares no ``<llm>``: every call fails, clearly."""

    async def complete(self, request: LLMRequest) -> LLMCompletion:
        raise LLMUnavailable(
            "config: no LLM backend is configured (declare one in boot.xml's <llm> section)",
            kind="config",
        )


#: A task run beside the runtime (started with no arguments, cancelled when it ends).
Helper = Callable[[], Awaitable[object]]


@dataclass
class AgentService:
    """The agents of one server process: built once, by the composition root, from the
    parts it made; :meth:`run` runs them."""

    runtime: AgentRuntime
    ports: PumpPorts
    profiles: Mapping[str, AgentProfile]
    #: The runtime's store as opened: the webhooks and the outbox use its roles beyond
    #: the agents' (``AgentStore``).
    store: SqlAgentStore
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: The LLM router (None without ``<llm>``), for status and readiness.
    router: Router | None = None
    #: The spend budgets (None: none declared), for the API, the CLI and the console.
    budgets: Budgets | None = None
    #: Run beside the runtime while it runs, in this order (the metrics' store figures,
    #: the pruner, the budgets' figures, the forwarding of replies kept for clients).
    helpers: Sequence[Helper] = ()

    def stop(self) -> None:
        """Stop the worker and watchdog (their work is durable and resumes on restart)."""
        self.scope.cancel()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the runtime and its helpers until :meth:`stop` or a cancel (the work is
        durable and resumes at the next start); started once the runtime recovered."""
        with self.scope:
            async with trio.open_nursery() as inner:
                for helper in self.helpers:
                    inner.start_soon(helper)
                await self.runtime.run(task_status=task_status)
                inner.cancel_scope.cancel()  # the runtime ended: so do its helpers


def worst_price(config: RouterConfig | None) -> WorstPrice:
    """The dearest input and output prices of ``config``'s backends (zero without any
    ``<price>``: cost budgets then never grow)."""
    prices = [b.price for b in (config.backends if config else ()) if b.price is not None]
    return WorstPrice(
        max((p.input_per_million for p in prices), default=0.0),
        max((p.output_per_million for p in prices), default=0.0),
    )


async def open_llm(
    config: RouterConfig | None,
    resources: contextlib.AsyncExitStack,
    environ: Mapping[str, str],
    *,
    tracing: Tracing | None = None,
    metrics: Metrics | None = None,
) -> LLMPort:
    """The agents' LLM port: the router of ``config`` (boot.xml's ``<llm>``; API keys read
    from ``environ`` now), closed with ``resources``; without ``config``, :class:`NoLLM`."""
    if config is None:
        return NoLLM()
    from agentserver.llm import Router

    telemetry = LLMTelemetry(
        tracing or Tracing(), metrics, {b.name: b.provider.value for b in config.backends}
    )
    router = Router(config, environ=environ, telemetry=telemetry)
    if metrics is not None:
        metrics.bind_router(router)
    await resources.enter_async_context(router)
    for backend, reason in router.skipped.items():
        # A backend standing aside by its unless-env is the configuration working.
        stands_aside = router.config_of(backend).unless_env is not None and "unless-env" in reason
        (log.info if stands_aside else log.warning)("LLM backend %s skipped: %s", backend, reason)
    return RouterLLM(router)


def effective_retention(
    store: StoreSettings, profiles: Mapping[str, HasRetention]
) -> RetentionSettings | None:
    """The retention the pruner applies: ``<store><retention>`` with each agent's
    ``<retention>`` over it; an agent's alone switches it on for that agent only (the
    store's values are then ``none``). None: nothing configured, no pruner."""
    overrides = {n: p.retention for n, p in profiles.items() if p.retention is not None}
    settings = store.retention
    if settings is None:
        if not overrides:
            return None
        settings = RetentionSettings(
            defaults=AgentRetention(None, None, None),
            step_log_s=None,
            acknowledged_replies_s=None,
            tombstones_s=None,
            deliveries_s=None,
        )
    return settings.with_overrides(overrides)


def retention_pruner(
    store: StoreSettings, profiles: Mapping[str, AgentProfile], agent_store: Any
) -> Any:
    """The store's :class:`~agentserver.agents.store.pruner.Pruner` if retention is
    configured (:func:`effective_retention`); None otherwise (no task, nothing spent)."""
    settings = effective_retention(store, profiles)
    if settings is None:
        return None
    from agentserver.agents.store.pruner import Pruner

    return Pruner(agent_store, settings, tuple(profiles))


def with_context_windows(
    profiles: Mapping[str, AgentProfile], llm: LLMPort
) -> dict[str, AgentProfile]:
    """``profiles`` with each one's context window: ``<agent context-window>`` wins; else
    the model's ``<model context-window>`` (when ``llm`` is a router that knows it); else
    the profile's default (128k)."""
    window_of = getattr(llm, "context_window", None)
    if window_of is None:
        return dict(profiles)
    return {
        name: p
        if p.context_window is not None or (w := window_of(p.model)) is None
        else dataclasses.replace(p, context_window=w)
        for name, p in profiles.items()
    }


def store_with_retention(
    store: StoreSettings, profiles: Mapping[str, AgentProfile]
) -> StoreSettings:
    """``store`` as the store is opened: with an agent's ``<retention>`` alone (none in
    ``<store>``), the effective retention, so the SQLite file is made INCREMENTAL all the
    same."""
    retention = effective_retention(store, profiles)
    if retention is not None and store.retention is None:
        return dataclasses.replace(store, retention=retention)
    return store


def listener_approvers(
    profiles: Mapping[str, AgentProfile], clients: Collection[str]
) -> tuple[str, ...]:
    """The approvers the profiles' policies name that are listeners, not declared
    ``clients`` (their requests are sent again after a restart)."""
    return tuple(
        sorted(
            {
                r.approver
                for p in profiles.values()
                if p.policy is not None
                for r in p.policy.rules
                if r.approver and r.approver not in clients
            }
        )
    )
