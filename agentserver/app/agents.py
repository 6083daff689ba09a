"""A topology's agents: the agent runtime's parts, built from the
:class:`~agentserver.config.topology.Topology` and the running pump.

:func:`build_profiles` turns each agent listener's ``<agent>`` settings, its peers and its
payload types into the runtime's :class:`AgentProfile`; :func:`start_agents` is the
agents' part of the composition root (``app/root.py`` calls it once the pump runs): it
builds the parts in dependency order, passes each its collaborators when it is made, and
builds the one :class:`~agentserver.agents.service.AgentService` (docs/architecture.md,
"The composition root").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Mapping

import trio

from agentserver.agents.clock import SystemClock
from agentserver.agents.edge.bridge import PumpPorts, agent_handler
from agentserver.agents.events import EventBus, counting
from agentserver.agents.governance.approvals import DECISION_TAG, REQUEST_TAG
from agentserver.agents.governance.budgets import Budgets
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.config import profile_from_settings
from agentserver.agents.profile.settings import AgentSettings
from agentserver.agents.runtime import AgentRuntime, open_agent_store, served_versions
from agentserver.agents.service import (
    AgentService,
    Helper,
    LateHandler,
    listener_approvers,
    open_llm,
    retention_pruner,
    store_with_retention,
    with_context_windows,
    worst_price,
)
from agentserver.agents.turn.answer import takes_failure_status
from agentserver.app.runtime_parts import runtime_parts
from agentserver.config.topology import Topology
from agentserver.config.versions import agent_versions
from agentserver.core.access import AccessRule
from agentserver.llm.grammars import agent_grammar
from agentserver.observability import Metrics, Tracing
from agentserver.primitives.core import HUH_TAG, SYSTEM_ERROR_TAG
from agentserver.pump.pump import Pump

# The logger these warnings have always had (docs name logger names; they stay).
log = logging.getLogger("agentserver.agents.service")


def agent_names(topology: Topology) -> tuple[str, ...]:
    return tuple(spec.name for spec in topology.listeners if spec.agent)


def build_profiles(
    topology: Topology, pump: Pump, environ: Mapping[str, str]
) -> dict[str, AgentProfile]:
    """One profile per agent listener, from its ``<agent>`` settings and the topology
    (each model is resolved against ``environ`` now). Raises ``AgentConfigError``."""
    tag_of = {p.model: p.tag for p in pump.payloads}
    ptype_of = {p.tag: p for p in pump.payloads}
    versions = agent_versions(topology)
    profiles = {}
    for spec in topology.listeners:
        if not spec.agent:
            continue
        peers: dict[str, str] = {}
        quotable = [HUH_TAG, SYSTEM_ERROR_TAG]  # what the model reads: results, refusals
        for peer in spec.peers:
            for model in topology.listener(peer).accepts:
                if tag_of[model] not in (REQUEST_TAG, DECISION_TAG):  # approvals, not tools
                    peers[tag_of[model]] = peer
            quotable += (tag_of[m] for m in topology.listener(peer).responds if m in tag_of)
        profile = profile_from_settings(
            spec.agent_profile or AgentSettings(),
            name=spec.name,
            own_roots=tuple(tag_of[m] for m in spec.accepts if tag_of[m] != DECISION_TAG),
            peers=peers,
            usage_instructions=pump.usage_instructions(spec.name),
            answer_tag=tag_of[spec.responds[0]] if spec.responds else "",
            environ=environ,
        )
        profile = dataclasses.replace(
            profile,
            quotable=tuple(dict.fromkeys(quotable)),
            policy=spec.agent_policy,
            guardrails=tuple(spec.agent_guardrails),
            version=versions[spec.name].version,
            digest=versions[spec.name].digest,
            versioning=versions[spec.name].versioning,
            # The pump's own compiled payload types: the grammar and validation share them.
            reply_grammar=agent_grammar(
                spec.name, profile.model, [ptype_of[t] for t in peers], topology.llm
            ),
        )
        reply_type = ptype_of.get(profile.answer_tag)
        if reply_type is not None and takes_failure_status(profile, reply_type.is_valid):
            profile = dataclasses.replace(profile, failure_status=True)
        else:
            log.warning(
                "agent %s: its reply type %s declares no status attribute, so its failed "
                'answers cannot say status="failed"',
                spec.name,
                profile.answer_tag,
            )
        profiles[spec.name] = profile
    return profiles


async def start_agents(
    topology: Topology,
    pump: Pump,
    handlers: Mapping[str, LateHandler],
    nursery: trio.Nursery,
    resources: contextlib.AsyncExitStack,
    *,
    environ: Mapping[str, str] | None = None,
    tracing: Tracing | None = None,
    metrics: Metrics | None = None,
    access: AccessRule | None = None,
) -> AgentService | None:
    """Start ``topology``'s agents on the running ``pump``: build them
    (:func:`build_agents`) and run the service in ``nursery``. Returns None if the
    topology has no agents. The store and router are closed by ``resources``; cancelling
    ``nursery`` stops the runtime, whose work is durable and resumes at the next start."""
    if not agent_names(topology):
        return None
    service = await build_agents(
        topology,
        pump,
        handlers,
        resources,
        environ=os.environ if environ is None else environ,
        tracing=tracing,
        metrics=metrics,
        access=access,
    )
    await nursery.start(service.run)
    where = service.runtime.settings.where
    log.info("agents running: %s (store %s)", ", ".join(service.profiles), where)
    return service


async def build_agents(
    topology: Topology,
    pump: Pump,
    handlers: Mapping[str, LateHandler],
    resources: contextlib.AsyncExitStack,
    *,
    environ: Mapping[str, str],
    tracing: Tracing | None = None,
    metrics: Metrics | None = None,
    access: AccessRule | None = None,
) -> AgentService:
    """The agent runtime's parts, each made once and given what it uses when it is
    made (no callback is set on any of them afterwards), in this order: the profiles;
    the LLM port, then the profiles with the models' context windows; the clock; the
    store (closed by ``resources`` at once, even if what follows fails); the pump ports
    (the runtime's tools and replies: made with the store); the event bus; the budgets
    (if declared); the runtime; its helpers (metrics' figures, pruner, budgets' figures,
    kept replies' forwarding); the agent listeners' handlers bound to it; and the
    service that holds them (built once). Raises ``AgentConfigError`` (a profile)."""
    declared = build_profiles(topology, pump, environ)  # first: a bad <agent> opens nothing
    llm_port = await open_llm(topology.llm, resources, environ, tracing=tracing, metrics=metrics)
    profiles = with_context_windows(declared, llm_port)
    clients = frozenset(c.name for c in topology.clients)
    clock = SystemClock()
    settings = store_with_retention(topology.store, profiles)
    # One object, the store's and the worker's: what this process serves, and whether
    # it drains (docs/deploy.md).
    served = served_versions(profiles)
    store = open_agent_store(settings, profiles, clock=clock, served=served)
    resources.push_async_callback(store.aclose)
    ports = PumpPorts(
        pump,
        store=store,
        named_clients=set(clients),
        # The server's own console routers: their approval decisions are the operator's.
        operators=frozenset(s.name for s in topology.listeners if s.builtin == "console-router"),
        access=access,
    )
    events = EventBus()
    budgets = None
    if topology.budgets:
        budgets = Budgets(
            store, clock, topology.budgets, price=worst_price(topology.llm), events=events
        )
    runtime = AgentRuntime(
        runtime_parts(
            store=store,
            profiles=profiles,
            settings=settings,
            clock=clock,
            llm=llm_port,
            tools=ports,
            replies=ports,
            tracing=tracing,
            send_approval=ports.send_approval,
            listener_approvers=listener_approvers(profiles, clients),
            # Listeners whose steps may be retried: their calls a restart interrupted are
            # sent again (``idempotent``).
            retryable_tools=[s.name for s in topology.listeners if s.idempotent],
            events=events,
            budgets=budgets,
            schedules=topology.schedules,
            served=served,
        )
    )
    helpers: list[Helper] = []
    if metrics is not None:
        # A snapshot refreshed by its own task: a scrape never waits on the store,
        # whichever backend it is.
        from agentserver.agents.store.figures import StoreFigures

        figures = StoreFigures(store, clock)
        events.observe(counting(metrics.bind_agents(figures, tuple(profiles))))
        helpers.append(figures.run)
    pruner = retention_pruner(settings, profiles, store)
    if pruner is not None:
        helpers.append(pruner.run)
    if budgets is not None and metrics is not None:
        metrics.bind_budgets(budgets)
        helpers.append(budgets.run)
    kept = store.client_replies
    if kept is not None and ports.clients is not None:
        # A shared store: replies other processes keep for clients here.
        from agentserver.agents.edge.named_clients import forward_kept

        helpers.append(functools.partial(forward_kept, kept, ports.clients))
    for name in profiles:
        handlers[name].bind(agent_handler(runtime, pump, name, ports))
    return AgentService(
        runtime,
        ports,
        profiles,
        store,
        router=getattr(llm_port, "router", None),
        budgets=budgets,
        helpers=tuple(helpers),
    )
