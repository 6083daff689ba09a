"""Agents in a running server: the agent listeners → one AgentRuntime on the pump.

Every listener declared with ``agent="true"`` is run by the runtime: its pump handler only
does intake (:func:`agentserver.agents.edge.bridge.agent_handler`), its Turns run in the
worker, its model calls go through the LLM router built from boot.xml's ``<llm>``, and its
state lives in the store of ``<store>`` (default ``state/agents.sqlite3`` next to
boot.xml). This module takes typed settings; :mod:`agentserver.app.agents` derives them
from a topology.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio
from lxml import etree

from agentserver.agents.clock import SystemClock
from agentserver.agents.edge.bridge import PumpPorts, agent_handler
from agentserver.agents.edge.llm_adapter import RouterLLM
from agentserver.agents.errors import LLMUnavailable
from agentserver.agents.events import EventBus, counting
from agentserver.agents.governance.budgets import Budgets, WorstPrice
from agentserver.agents.policy.budget import BudgetSpec
from agentserver.agents.ports import LLMCompletion, LLMPort, LLMRequest
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.retention import AgentRetention, RetentionSettings
from agentserver.agents.profile.schedule import ScheduleSpec
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.runtime import AgentRuntime, open_agent_store
from agentserver.core.access import AccessRule
from agentserver.core.listener import Handler, HandlerMetadata
from agentserver.llm.config import RouterConfig
from agentserver.observability import LLMTelemetry, Metrics, Tracing
from agentserver.pump.pump import Pump

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

    async def __call__(self, payload: etree._Element, meta: HandlerMetadata) -> None:
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


@dataclass
class AgentService:
    """The agents of one server process."""

    runtime: AgentRuntime
    ports: PumpPorts
    profiles: Mapping[str, AgentProfile]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: The LLM router (None without ``<llm>``), for status and readiness.
    router: Router | None = None
    #: The spend budgets (None: none declared), for the API, the CLI and the console.
    budgets: Budgets | None = None

    def stop(self) -> None:
        """Stop the worker and watchdog (their work is durable and resumes on restart)."""
        self.scope.cancel()


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
    store: StoreSettings, profiles: Mapping[str, AgentProfile]
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


async def start_agent_service(
    pump: Pump,
    handlers: Mapping[str, LateHandler],
    nursery: trio.Nursery,
    resources: contextlib.AsyncExitStack,
    *,
    store: StoreSettings,
    profiles: Mapping[str, AgentProfile],
    llm: RouterConfig | None,
    clients: Collection[str] = (),
    operators: Collection[str] = (),
    environ: Mapping[str, str] | None = None,
    tracing: Tracing | None = None,
    metrics: Metrics | None = None,
    access: AccessRule | None = None,
    retryable_tools: Collection[str] = (),
    budgets: Sequence[BudgetSpec] = (),
    schedules: Sequence[ScheduleSpec] = (),
) -> AgentService:
    """Open the store of ``store`` and the router of ``llm``, bind the agent listeners
    (``handlers``, one per name in ``profiles``) and start the runtime in ``nursery``. Call
    once the pump runs. ``clients`` are the declared clients' names, ``operators`` the
    listeners whose approval decisions are the operator's, for any request (the server's
    own console routers); ``retryable_tools`` the listeners whose steps may be retried
    (``idempotent``: their calls a restart interrupted are sent again); ``budgets`` the
    declared spend budgets (none: nothing of them is built); ``schedules`` boot.xml's
    (docs/runs.md). The store and router
    are closed by ``resources``; cancelling ``nursery`` stops the runtime, whose work is
    durable and resumes at the next start."""
    env = os.environ if environ is None else environ
    llm_port = await open_llm(llm, resources, env, tracing=tracing, metrics=metrics)
    window_of = getattr(llm_port, "context_window", None)
    if window_of is not None:
        # <agent context-window> wins; else the model's <model context-window>; else 128k.
        profiles = {
            name: p
            if p.context_window is not None or (w := window_of(p.model)) is None
            else dataclasses.replace(p, context_window=w)
            for name, p in profiles.items()
        }
    named = set(clients)
    clock = SystemClock()
    # The store first: the ports (the runtime's tools and replies) are made with it.
    retention = effective_retention(store, profiles)
    if retention is not None and store.retention is None:
        # An agent's retention alone: the SQLite file is made INCREMENTAL all the same.
        store = dataclasses.replace(store, retention=retention)
    agent_store = open_agent_store(store, profiles, clock=clock)
    # At once (it is all runtime.aclose does): closed even if what follows fails.
    resources.push_async_callback(agent_store.aclose)
    ports = PumpPorts(
        pump,
        store=agent_store,
        named_clients=named,
        operators=frozenset(operators),
        access=access,
    )
    events = EventBus()
    spend = None
    if budgets:
        spend = Budgets(agent_store, clock, budgets, price=worst_price(llm), events=events)
    runtime = AgentRuntime(
        store=agent_store,
        profiles=profiles,
        settings=store,
        clock=clock,
        llm=llm_port,
        tools=ports,
        replies=ports,
        tracing=tracing,
        send_approval=ports.send_approval,
        listener_approvers=tuple(
            sorted(
                {
                    r.approver
                    for p in profiles.values()
                    if p.policy is not None
                    for r in p.policy.rules
                    if r.approver and r.approver not in named
                }
            )
        ),
        retryable_tools=retryable_tools,
        events=events,
        budgets=spend,
        schedules=schedules,
    )
    figures = None
    if metrics is not None:
        # A snapshot refreshed by its own task (run below): a scrape never waits on the
        # store, whichever backend it is.
        from agentserver.agents.store.figures import StoreFigures

        figures = StoreFigures(runtime.store, runtime.clock)
        runtime.events.observe(counting(metrics.bind_agents(figures, tuple(profiles))))
    if metrics is not None and spend is not None:
        metrics.bind_budgets(spend)
    for name in profiles:
        handlers[name].bind(agent_handler(runtime, pump, name, ports))
    service = AgentService(runtime, ports, profiles, router=getattr(llm_port, "router", None))
    pruner = retention_pruner(store, profiles, agent_store)
    service = AgentService(
        runtime, ports, profiles, router=getattr(llm_port, "router", None), budgets=spend
    )

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with service.scope:
            kept = runtime.store.client_replies
            async with trio.open_nursery() as inner:
                if figures is not None:
                    inner.start_soon(figures.run)
                if pruner is not None:
                    inner.start_soon(pruner.run)
                if spend is not None and metrics is not None:
                    inner.start_soon(spend.run)
                if kept is not None and ports.clients is not None:
                    # A shared store: replies other processes keep for clients here.
                    from agentserver.agents.edge.named_clients import forward_kept

                    inner.start_soon(forward_kept, kept, ports.clients)
                await runtime.run(task_status=task_status)
                inner.cancel_scope.cancel()  # the runtime ended: so do its helpers

    await nursery.start(run)
    log.info("agents running: %s (store %s)", ", ".join(profiles), store.where)
    return service
