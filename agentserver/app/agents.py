"""A topology's agents: what the agent runtime needs, derived from the
:class:`~agentserver.config.topology.Topology` and the running pump.

:func:`build_profiles` turns each agent listener's ``<agent>`` settings, its peers and its
payload types into the runtime's :class:`AgentProfile`; :func:`start_agents` hands the
profiles and the topology's typed ``<store>`` and ``<llm>`` settings to
:func:`agentserver.agents.service.start_agent_service`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Mapping

import trio

from agentserver.agents.governance.approvals import DECISION_TAG, REQUEST_TAG
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.config import profile_from_settings
from agentserver.agents.profile.settings import AgentSettings
from agentserver.agents.service import AgentService, LateHandler, start_agent_service
from agentserver.agents.turn.answer import takes_failure_status
from agentserver.config.topology import Topology
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
    """Start ``topology``'s agents on the running ``pump`` (see
    :func:`~agentserver.agents.service.start_agent_service`). Returns None if the
    topology has no agents."""
    if not agent_names(topology):
        return None
    env = os.environ if environ is None else environ
    return await start_agent_service(
        pump,
        handlers,
        nursery,
        resources,
        store=topology.store,
        profiles=build_profiles(topology, pump, env),
        llm=topology.llm,
        clients=[c.name for c in topology.clients],
        operators=[s.name for s in topology.listeners if s.builtin == "console-router"],
        environ=env,
        tracing=tracing,
        metrics=metrics,
        access=access,
        retryable_tools=[s.name for s in topology.listeners if s.idempotent],
        budgets=topology.budgets,
        schedules=topology.schedules,
    )
