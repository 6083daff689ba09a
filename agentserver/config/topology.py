"""What a boot.xml declares, as typed and frozen data: :class:`Topology` and its parts.

Built by :mod:`agentserver.config.loader`, which validates the file, resolves every
reference and parses every section once: no subsystem sees boot.xml's elements. Every
relative path in the file (the store, TLS files, payload schema files, the folder handler
modules are imported from) is resolved against boot.xml's folder, so the working directory
never changes what a topology means. Turned into running listeners by
:func:`agentserver.app.builtins.build_listeners`.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic_xml import BaseXmlModel

from agentserver.config.a2a_spec import ExposeA2a
from agentserver.core.listener import (
    DEFAULT_CONCURRENCY,
    DEFAULT_QUEUE_SIZE,
    DEFAULT_TIMEOUT,
    Handler,
)
from agentserver.net.limits import Limits  # defined below config (net applies it)
from agentserver.net.tls import TlsSpec
from agentserver.primitives.core import Boot, boot_primitive
from agentserver.pump.pump import PumpConfig
from agentserver.remote.a2a_spec import A2aRemoteSpec, A2aSkillRef
from agentserver.remote.mcp_spec import McpServerSpec, McpToolRef

if TYPE_CHECKING:
    # Types only: importing the agents and the LLM router would make every command that
    # reads DEFAULT_PORT pay for them (httpx, the router); the loader imports them.
    from agentserver.agents.policy.budget import BudgetSpec
    from agentserver.agents.policy.evaluate import Policy
    from agentserver.agents.policy.guardrails import GuardrailSpec
    from agentserver.agents.profile.schedule import ScheduleSpec
    from agentserver.agents.profile.settings import AgentSettings, StoreSettings
    from agentserver.agents.profile.webhooks import WebhookSpec
    from agentserver.llm.config import RouterConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7340
DEFAULT_HTTP_PORT = 7341


@dataclass(frozen=True, slots=True)
class HttpSpec:
    """boot.xml ``<http>``: the HTTP API (docs/http-api.md). Same clients, tokens and
    ``<tls>`` as the socket; the bounds of ``?wait=false`` threads are its own."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_HTTP_PORT
    #: Messages over HTTP waiting for their replies at once (each holds an endpoint).
    max_pending: int = 1024
    #: Seconds a ``?wait=false`` thread keeps its replies after its last one (or its start).
    reply_ttl: float = 300.0
    #: Replies one ``?wait=false`` thread keeps (later ones are dropped and counted).
    max_replies: int = 64
    #: Seconds a waiting ``POST /v1/messages`` waits for its first reply.
    wait_timeout: float = 60.0
    #: Seconds a web console sign-in lasts (a fixed lifetime from signing in).
    ui_session_ttl: float = 43200.0
    line: int = 0


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """A named client. Its token is read from the environment variable ``token_env``
    (None: it has none); with mutual TLS, a client certificate with ``cert_subject``'s
    attributes or ``cert_fingerprint`` (``sha256:HEX``) authenticates it instead."""

    name: str
    token_env: str | None
    #: Listener names it may address; None means all.
    may_address: tuple[str, ...] | None = None
    line: int = 0
    cert_subject: str | None = None
    cert_fingerprint: str | None = None
    #: Remote listeners it may serve as a runner (docs/wire.md, "Runners").
    serves: tuple[str, ...] = ()
    #: May stop and cancel agents' tasks from outside (``agentserver stop`` / ``cancel``).
    operator: bool = False


@dataclass(frozen=True, slots=True)
class ListenerSpec:
    """One declared listener with every reference resolved.

    Exactly one of ``builtin`` (a name in :data:`agentserver.config.builtins.BUILTIN_HANDLERS`)
    and ``handler`` (an imported async callable) is set, unless ``remote`` (then neither:
    runners serve it over the wire).
    """

    name: str
    handler_ref: str
    accepts: tuple[type[BaseXmlModel], ...]
    responds: tuple[type[BaseXmlModel], ...] = ()
    peers: tuple[str, ...] = ()
    builtin: str | None = None
    handler: Handler | None = None
    agent: bool = False
    broadcast: bool = False
    concurrency: int = DEFAULT_CONCURRENCY
    timeout: float = DEFAULT_TIMEOUT
    queue_size: int = DEFAULT_QUEUE_SIZE
    raw: bool = False
    description: str = ""
    #: An agent's ``<agent>`` settings (all defaults when it has none); None: not an agent.
    agent_profile: AgentSettings | None = None
    line: int = 0
    #: Served by runners over the wire (:mod:`agentserver.remote.hub`).
    remote: bool = False
    #: A tool listener (remote or in-process): seconds one attempt may take (None:
    #: ``timeout``; in-process, None and not idempotent: no steps, the pump's timeout).
    step_timeout: float | None = None
    #: Failed or timed-out attempts may be retried automatically (same idempotency key),
    #: and a call a restart interrupted is sent again.
    idempotent: bool = False
    #: Idempotent: automatic retries after the first attempt.
    retries: int = 3
    #: The agent's tool-call policy (None: peers only) and guardrails.
    agent_policy: Policy | None = field(default=None, compare=False)
    agent_guardrails: tuple[GuardrailSpec, ...] = field(default=(), compare=False)
    #: Of ``accepts``, the types taken by name only (``to``): their root tags are not
    #: claimed (the approval decision of a governed agent but the first; docs/agents.md).
    addressed_only: tuple[type[BaseXmlModel], ...] = ()
    #: An MCP server's tool (``<mcp>``, docs/mcp.md); None: not one.
    mcp_tool: McpToolRef | None = None
    #: A remote A2A agent's skill (``<a2a>``, docs/a2a.md); None: not one.
    a2a_skill: A2aSkillRef | None = None
    #: The ``<listener>`` element as written, canonical (C14N, no comments): part of an
    #: agent's version (config/versions.py).
    definition: bytes = field(default=b"", compare=False)

    @property
    def is_boot(self) -> bool:
        """True for the system boot listener (it takes the core ``<boot>`` primitive)."""
        return Boot in self.accepts


def _default_store() -> StoreSettings:
    """The store of a topology built without one (the loader always sets it)."""
    from agentserver.agents.profile.settings import StoreSettings

    return StoreSettings()


@dataclass(frozen=True, slots=True)
class Topology:
    """A validated boot.xml."""

    path: pathlib.Path
    organism: str
    listeners: tuple[ListenerSpec, ...]
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    limits: Limits = Limits()
    clients: tuple[ClientSpec, ...] = ()
    description: str = ""
    #: ``<llm>``: the LLM router's settings; None if absent.
    llm: RouterConfig | None = None
    #: ``<store>`` (its defaults if absent): the agents' store, a relative SQLite path
    #: already resolved against boot.xml's folder.
    store: StoreSettings = field(default_factory=_default_store)
    #: ``<tls>``: every connection on the listener is TLS; None: plaintext.
    tls: TlsSpec | None = None
    #: ``<listen insecure-plaintext="true">``: declared clients on a non-loopback address
    #: without TLS (tokens cross the network in clear).
    insecure_plaintext: bool = False
    #: ``<http>``: the HTTP API; None: not served (unless ``run --http-port``).
    http: HttpSpec | None = None
    #: ``<mcp>``: the MCP servers whose tools are listeners, with the tools listed at load.
    mcp: tuple[McpServerSpec, ...] = ()
    #: ``<a2a>``: the remote A2A agents whose skills are listeners, cards fetched at load.
    a2a: tuple[A2aRemoteSpec, ...] = ()
    #: ``<expose-mcp listeners>``: what ``agentserver mcp`` and ``/mcp`` offer.
    expose_mcp: tuple[str, ...] = ()
    #: ``<webhooks>`` and the agents' ``<webhook>`` (docs/webhooks.md).
    webhooks: tuple[WebhookSpec, ...] = ()
    #: ``<budget>`` elements: the spend budgets (docs/budgets.md); empty: none.
    budgets: tuple[BudgetSpec, ...] = ()
    #: ``<schedules>``: runs on a schedule (docs/runs.md).
    schedules: tuple[ScheduleSpec, ...] = ()
    #: ``<expose-a2a>``: the agents served as A2A agents (docs/a2a.md); None: absent.
    expose_a2a: ExposeA2a | None = None

    def listener(self, name: str) -> ListenerSpec:
        for spec in self.listeners:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def boot_primitive(self) -> Boot:
        """The boot primitive this topology starts with, stamped now."""
        return boot_primitive(self.organism, len(self.listeners))

    @property
    def boot_listener(self) -> ListenerSpec:
        """The listener that receives the boot primitive (the loader guarantees one)."""
        return next(spec for spec in self.listeners if spec.is_boot)

    def pump_config(self) -> PumpConfig:
        lim = self.limits
        return PumpConfig(
            organism=self.organism,
            max_message_bytes=lim.max_message_bytes,
            max_threads=lim.max_threads,
            max_threads_per_endpoint=lim.max_threads_per_connection,
            thread_idle_ttl=lim.thread_ttl,
            delivery_timeout=lim.delivery_timeout,
            endpoint_buffer=lim.outgoing_buffer,
            endpoint_buffer_bytes=lim.outgoing_buffer_bytes,
            drain_timeout=lim.drain_timeout,
        )
