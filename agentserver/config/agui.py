"""The agents AG-UI runs reach (docs/ag-ui.md): every declared agent, its task payload's
input (as ``<expose-a2a>``'s skills: the first payload type it takes by root tag) and
whether it remembers a conversation per AG-UI thread."""

from __future__ import annotations

from agentserver.config.topology import Topology
from agentserver.core.payloads import PayloadType
from agentserver.core.xsd_jsonschema import tool_input
from agentserver.http.agui.agents import AguiAgent
from agentserver.primitives.core import Boot


def agui_agents(topology: Topology) -> tuple[AguiAgent, ...]:
    """One :class:`AguiAgent` per declared agent, in boot.xml's order."""
    agents = []
    for spec in topology.listeners:
        if not spec.agent:
            continue
        model = next(
            (m for m in spec.accepts if m not in spec.addressed_only and m is not Boot), None
        )
        if model is None:
            continue
        ptype = PayloadType.from_model(model)
        profile = spec.agent_profile
        agents.append(
            AguiAgent(
                name=spec.name,
                input=tool_input(ptype),
                ptype=ptype,
                memory=profile is not None and profile.memory == "client",
            )
        )
    return tuple(agents)
