"""Agents in a running server: boot.xml's agent listeners → one AgentRuntime on the pump.

Every listener declared with ``agent="true"`` is run by the runtime: its pump handler only
does intake (:func:`agentserver.agents.bridge.agent_handler`), its Turns run in the
worker, its model calls go through the LLM router built from boot.xml's ``<llm>``, and its
state lives in the store of ``<store>`` (default ``./state/agents.sqlite3``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from lxml import etree

from agentserver.agents.answer import takes_failure_status
from agentserver.agents.approvals import DECISION_TAG, REQUEST_TAG
from agentserver.agents.bridge import PumpPorts, agent_handler
from agentserver.agents.config import profile_from_element, store_settings_from_element
from agentserver.agents.errors import LLMUnavailable
from agentserver.agents.llm_adapter import RouterLLM
from agentserver.agents.ports import LLMCompletion, LLMPort, LLMRequest
from agentserver.agents.profile import AgentProfile
from agentserver.agents.runtime import AgentRuntime
from agentserver.config.topology import Topology
from agentserver.core.listener import Handler, HandlerMetadata
from agentserver.observability import LLMTelemetry, Metrics, Tracing
from agentserver.primitives.core import HUH_TAG, SYSTEM_ERROR_TAG
from agentserver.pump.pump import Pump

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
    router: Any = None

    def stop(self) -> None:
        """Stop the worker and watchdog (their work is durable and resumes on restart)."""
        self.scope.cancel()


def agent_names(topology: Topology) -> tuple[str, ...]:
    return tuple(spec.name for spec in topology.listeners if spec.agent)


def build_profiles(
    topology: Topology, pump: Pump, environ: Mapping[str, str]
) -> dict[str, AgentProfile]:
    """One profile per agent listener, from its ``<agent>`` settings and the topology."""
    tag_of = {p.model: p.tag for p in pump.payloads}
    ptype_of = {p.tag: p for p in pump.payloads}
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
        profile = profile_from_element(
            spec.agent_profile,
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


async def open_llm(
    topology: Topology,
    resources: contextlib.AsyncExitStack,
    environ: Mapping[str, str],
    *,
    tracing: Tracing | None = None,
    metrics: Metrics | None = None,
) -> LLMPort:
    if topology.llm is None:
        return NoLLM()
    from agentserver.llm import Router, parse_llm_section

    config = parse_llm_section(topology.llm, environ=environ)
    telemetry = LLMTelemetry(
        tracing or Tracing(), metrics, {b.name: b.provider.value for b in config.backends}
    )
    router = Router(config, environ=environ, telemetry=telemetry)
    if metrics is not None:
        metrics.bind_router(router)
    await resources.enter_async_context(router)
    for backend, reason in router.skipped.items():
        log.warning("LLM backend %s skipped: %s", backend, reason)
    return RouterLLM(router)


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
) -> AgentService | None:
    """Open the store and router, bind the agent listeners and start the runtime in
    ``nursery``. Call once the pump runs. Returns None if the topology has no agents."""
    if not agent_names(topology):
        return None
    env = os.environ if environ is None else environ
    settings = store_settings_from_element(topology.store, base_dir=Path.cwd(), environ=env)
    profiles = build_profiles(topology, pump, env)
    llm = await open_llm(topology, resources, env, tracing=tracing, metrics=metrics)
    window_of = getattr(llm, "context_window", None)
    if window_of is not None:
        # <agent context-window> wins; else the model's <model context-window>; else 128k.
        profiles = {
            name: p
            if p.context_window is not None or (w := window_of(p.model)) is None
            else dataclasses.replace(p, context_window=w)
            for name, p in profiles.items()
        }
    clients = {c.name for c in topology.clients}
    ports = PumpPorts(
        pump,
        named_clients=clients,
        operators=frozenset(s.name for s in topology.listeners if s.builtin == "console-router"),
    )
    runtime = AgentRuntime.open(
        settings,
        profiles,
        llm=llm,
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
                    if r.approver and r.approver not in clients
                }
            )
        ),
    )
    resources.push_async_callback(runtime.aclose)
    figures = None
    if metrics is not None:
        # A snapshot refreshed by its own task (run below): a scrape never waits on the
        # store, whichever backend it is.
        from agentserver.agents.store_figures import StoreFigures

        figures = StoreFigures(runtime.store, runtime.clock)
        runtime.events.observe(metrics.bind_agents(figures, tuple(profiles)))
    ports.attach(runtime.store)
    for name in profiles:
        handlers[name].bind(agent_handler(runtime, pump, name, ports))
    service = AgentService(runtime, ports, profiles, router=getattr(llm, "router", None))

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with service.scope:
            kept = getattr(runtime.store, "client_replies", None)
            async with trio.open_nursery() as inner:
                if figures is not None:
                    inner.start_soon(figures.run)
                if kept is not None and ports.clients is not None:
                    # A shared store: replies other processes keep for clients here.
                    from agentserver.agents.named_clients import forward_kept

                    inner.start_soon(forward_kept, kept, ports.clients)
                await runtime.run(task_status=task_status)
                inner.cancel_scope.cancel()  # the runtime ended: so do its helpers

    await nursery.start(run)
    log.info("agents running: %s (store %s)", ", ".join(profiles), settings.where)
    return service
