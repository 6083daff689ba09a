"""boot.xml's ``<expose-a2a>``: our agents as A2A agents on the HTTP API (docs/a2a.md).

Read once into :class:`ExposeA2a`; :func:`exposed_skills` turns it into what the HTTP
API serves (:class:`agentserver.http.a2a.skills.A2aSkill`: one A2A skill per agent, its
task payload's input and whether the agent remembers a conversation per context).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from lxml import etree

from agentserver.config.a2a_spec import A2aAgent, ExposeA2a
from agentserver.config.imports import B, flag
from agentserver.config.problems import Problem, Report
from agentserver.config.topology import ListenerSpec, Topology
from agentserver.core.payloads import PayloadType
from agentserver.core.xsd_jsonschema import tool_input
from agentserver.http.a2a.skills import A2aSkill
from agentserver.primitives.core import Boot


def _sdk_installed() -> bool:
    try:
        return importlib.util.find_spec("a2a") is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a None module entry
        return False


def check_exposed_a2a(
    report: Report,
    el: etree._Element | None,
    listeners: tuple[ListenerSpec, ...],
    cause_of: Callable[[str], Problem | None] = lambda name: None,
) -> ExposeA2a | None:
    """``<expose-a2a>``: each ``<agent name>`` a declared agent, named once.
    ``cause_of(name)``: the error that made a declared listener fail (naming it is said
    under that error, not as one of its own)."""
    if el is None:
        return None
    if not _sdk_installed():
        # The SDK is the optional a2a extra: say so at load, not as an ImportError later.
        report.error(
            el.sourceline, "<expose-a2a> needs the A2A SDK: pip install 'agentserver[a2a]'"
        )
        return None
    by_name = {s.name: s for s in listeners}
    agents: list[A2aAgent] = []
    for child in el.findall(B + "agent"):
        name = child.get("name", "")
        spec = by_name.get(name)
        if spec is None and (cause := cause_of(name)) is not None:
            report.note(
                cause,
                f"(so <expose-a2a>, line {child.sourceline}, lacks its agent {name!r})",
            )
            continue
        if spec is None or not spec.agent:
            report.error(child.sourceline, f"<expose-a2a>: {name!r} is not a declared agent")
            continue
        if any(a.name == name for a in agents):
            report.error(child.sourceline, f"<expose-a2a>: agent {name!r} named twice")
            continue
        description = (child.findtext(B + "description") or "").strip()
        agents.append(
            A2aAgent(
                name=name,
                description=description or spec.description or f"The agent {name}.",
                examples=tuple(
                    (e.text or "").strip()
                    for e in child.findall(B + "example")
                    if (e.text or "").strip()
                ),
                tags=tuple(child.get("tags", "").split()),
            )
        )
    public_url = (el.get("public-url") or "").strip().rstrip("/") or None
    return ExposeA2a(tuple(agents), public_url, flag(el, "allow-private-push"))


def exposed_skills(topology: Topology) -> tuple[A2aSkill, ...]:
    """One skill per agent ``<expose-a2a>`` names: its task payload (the first type it
    takes by root tag) as the input its messages fill."""
    expose = topology.expose_a2a
    if expose is None:
        return ()
    skills = []
    for agent in expose.agents:
        spec = topology.listener(agent.name)
        model = next(m for m in spec.accepts if m not in spec.addressed_only and m is not Boot)
        profile = spec.agent_profile
        ptype = PayloadType.from_model(model)
        skills.append(
            A2aSkill(
                name=agent.name,
                description=agent.description,
                examples=agent.examples,
                tags=agent.tags,
                input=tool_input(ptype),
                memory=profile is not None and profile.memory == "client",
                ptype=ptype,
            )
        )
    return tuple(skills)
