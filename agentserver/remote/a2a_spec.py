"""Remote A2A agents as tools: what boot.xml's ``<a2a>`` declares and what the remote
card offers, as plain frozen data (read by :mod:`agentserver.config.a2a_remote`, used by
:mod:`agentserver.remote.a2a_client`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentserver.core.jsonschema_xsd import ToolShape

#: The arguments of every remote skill's listener: the task's text, and optional data
#: fields as a JSON object's text.
SKILL_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "description": "the task for the remote agent"},
        "data": {"type": "string", "description": "optional: a JSON object of data fields"},
    },
    "required": ["text"],
}


@dataclass(frozen=True, slots=True)
class A2aRemoteSpec:
    """One ``<a2a>``: a remote A2A agent reached over the JSON-RPC binding. ``headers``
    hold values already read from the environment (the bearer token included)."""

    name: str
    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    #: Seconds one call may take, every attempt included (then the remote task is
    #: cancelled).
    timeout: float = 300.0
    #: Seconds one attempt may take (None: ``timeout``): a timed-out attempt is retried,
    #: continuing the same remote task.
    step_timeout: float | None = None
    #: Attempts after the first (a step timeout, a lost transport), ``backoff(n)`` apart.
    retries: int = 3
    #: Seconds fetching the card may take.
    connect_timeout: float = 30.0
    #: Calls in flight at once, per skill listener.
    concurrency: int = 8
    #: False: an unreachable card is a warning (after retries), its skills absent.
    required: bool = True
    #: TLS: a CA bundle to verify the remote with; a client certificate and key (PEM).
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    line: int = 0
    #: The card fetched at load, as JSON (the SDK's ``AgentCard``).
    card: Mapping[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True, slots=True)
class A2aSkillRef:
    """What makes a listener a remote A2A skill: its remote, the skill's id and the
    mapping between its XML payload and the arguments."""

    remote: str
    skill: str
    shape: ToolShape = field(compare=False)
