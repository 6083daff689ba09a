"""The Agent Cards (A2A 1.0, docs/a2a.md, "The card"): the server's, at
``/.well-known/agent-card.json``, with one skill per exposed agent; one per agent, at
the path the server's card names (its extension :data:`AGENT_CARDS`), whose endpoint
addresses that agent alone; and the extended card an authenticated caller gets, with
only the agents it may address. Built from the SDK's types. Sans I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    HTTPAuthSecurityScheme,
    SecurityRequirement,
    SecurityScheme,
    StringList,
)
from a2a.types.a2a_pb2 import AgentExtension
from a2a.utils.constants import PROTOCOL_VERSION_0_3, PROTOCOL_VERSION_1_0, TransportProtocol
from google.protobuf.struct_pb2 import Struct

from agentserver.http.a2a.skills import SKILL_KEY, A2aSkill

#: The JSON-RPC endpoint of the server's card (a message picks its agent by skill).
ENDPOINT = "/a2a"
#: An agent's own endpoint, and its card.
AGENT_ENDPOINT = "/a2a/agents/{name}"
AGENT_CARD = "/a2a/agents/{name}/agent-card.json"
#: The extension of the server's card that names each skill's own card.
AGENT_CARDS = "urn:agentserver:a2a:agent-cards"
INPUT_MODES = ["text/plain", "application/json"]
OUTPUT_MODES = ["text/plain"]
BEARER = "bearer"


@dataclass(frozen=True, slots=True)
class CardFacts:
    """What every card says: the server's name, description and version, and whether
    callers authenticate (``<clients>`` declared: a bearer token)."""

    organism: str
    description: str
    version: str
    secured: bool


def _skill(skill: A2aSkill) -> AgentSkill:
    return AgentSkill(
        id=skill.name,
        name=skill.name,
        description=skill.description,
        tags=list(skill.tags) or [skill.name],
        examples=list(skill.examples),
        input_modes=INPUT_MODES,
        output_modes=OUTPUT_MODES,
    )


def _card(
    facts: CardFacts, name: str, description: str, url: str, skills: Sequence[A2aSkill]
) -> AgentCard:
    card = AgentCard(
        name=name,
        description=description,
        version=facts.version,
        # 1.0 first (a 1.x client takes it); then 0.3 at the same endpoint, from which the
        # SDK writes the card's 0.3 fields (url, preferredTransport, protocolVersion) that
        # 0.3 clients read.
        supported_interfaces=[
            AgentInterface(
                url=url,
                protocol_binding=TransportProtocol.JSONRPC.value,
                protocol_version=version,
            )
            for version in (PROTOCOL_VERSION_1_0, PROTOCOL_VERSION_0_3)
        ],
        capabilities=AgentCapabilities(
            streaming=True, push_notifications=True, extended_agent_card=facts.secured
        ),
        default_input_modes=INPUT_MODES,
        default_output_modes=OUTPUT_MODES,
        skills=[_skill(s) for s in skills],
    )
    if facts.secured:
        card.security_schemes[BEARER].CopyFrom(
            SecurityScheme(
                http_auth_security_scheme=HTTPAuthSecurityScheme(
                    scheme="Bearer", description="the token of a client declared in boot.xml"
                )
            )
        )
        card.security_requirements.append(SecurityRequirement(schemes={BEARER: StringList()}))
    return card


def server_card(facts: CardFacts, base_url: str, skills: Sequence[A2aSkill]) -> AgentCard:
    """The server's card: every skill, the JSON-RPC endpoint, and the extension naming
    each skill's own card (and the metadata key that picks a skill)."""
    card = _card(
        facts,
        facts.organism,
        facts.description or f"The agents of {facts.organism}.",
        base_url + ENDPOINT,
        skills,
    )
    params = Struct()
    params.update(
        {
            "metadataKey": SKILL_KEY,
            "agentCards": {s.name: base_url + AGENT_CARD.format(name=s.name) for s in skills},
        }
    )
    card.capabilities.extensions.append(
        AgentExtension(
            uri=AGENT_CARDS,
            description=(
                f"With several skills, a message names its skill in its metadata "
                f"({SKILL_KEY!r}); each skill also has its own card and endpoint "
                "(agentCards)."
            ),
            required=False,
            params=params,
        )
    )
    return card


def agent_card(facts: CardFacts, base_url: str, skill: A2aSkill) -> AgentCard:
    """One agent's card: its one skill, at its own endpoint."""
    return _card(
        facts,
        skill.name,
        skill.description,
        base_url + AGENT_ENDPOINT.format(name=skill.name),
        [skill],
    )
