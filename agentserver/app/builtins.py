"""The built-in handlers usable in boot.xml, and topology → listeners.

A listener's ``handler`` is either ``module:function`` (an async handler) or one of the
names in :data:`BUILTIN_HANDLERS`. The names, each built-in's payload types and defaults
(so ``<listener name="echo" handler="echo"/>`` is a complete declaration) and the built-in
payload names are declared in :mod:`agentserver.config.builtins`, which the loader reads;
this module makes the handlers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from agentserver.config.topology import ListenerSpec, Topology
from agentserver.core.listener import Handler, Listener
from agentserver.core.xsdgen import model_root_tag
from agentserver.listeners import assistant, calculator, echo
from agentserver.listeners.console import Console, Terminal
from agentserver.listeners.console_router import DEFAULT_AGENT, ConsoleRouter
from agentserver.listeners.system_boot import SystemBoot

if TYPE_CHECKING:
    # Imported where used: most commands (check, schemas) need neither, and both are slow.
    from agentserver.agents.service import LateHandler
    from agentserver.remote.hub import RunnerHub
    from agentserver.remote.mcp_client import McpHub


@dataclass(slots=True)
class RunContext:
    """What built-in handlers may need from the process that runs the topology."""

    topology: Topology
    #: The terminal of an attached console (``run --console``); None: no console.
    terminal: Terminal | None = None
    #: Called when the attached console ends (``/quit`` or end of input).
    on_console_exit: Callable[[], None] | None = None
    #: Closed by the server after the pump has drained (stores, routers register here).
    resources: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)


Factory = Callable[[ListenerSpec, RunContext], Handler]


@dataclass(frozen=True, slots=True)
class Builtin:
    """How a built-in handler is made (its payload types and default settings are
    declared under the same name in :data:`agentserver.config.builtins.BUILTIN_HANDLERS`)."""

    factory: Factory
    #: A synchronous raw handler doing the same (``Listener(sync=True)``), used whenever
    #: the listener runs raw.
    sync_handler: Callable[..., Any] | None = None


def _static(handler: Handler) -> Factory:
    return lambda spec, ctx: handler


def _accepted_tags(topology: Topology, names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for name in names:
        try:
            spec = topology.listener(name)
        except KeyError:
            continue
        out[name] = tuple(model_root_tag(m) for m in spec.accepts)
    return out


def _console(spec: ListenerSpec, ctx: RunContext) -> Handler:
    boots = tuple(s.name for s in ctx.topology.listeners if s.is_boot)
    return Console(
        ctx.terminal,
        trusted=(*spec.peers, *boots),
        on_exit=ctx.on_console_exit,
        # Listener approvers get requests from the agents that name them (docs/agents.md).
        requesters=tuple(s.name for s in ctx.topology.listeners if s.agent),
    )


def _describer(topology: Topology) -> Callable[[str], tuple[str, ...]]:
    """``/describe NAME``: each payload type NAME accepts, as docs/protocol.md's usage
    instructions show it to agents (rendered on first use: xmlschema is slow to import)."""
    cache: dict[str, tuple[str, ...]] = {}

    def describe(name: str) -> tuple[str, ...]:
        if name not in cache:
            from agentserver.core.payloads import PayloadType
            from agentserver.core.usage import describe_payload

            spec = topology.listener(name)
            lines = [f"@{name}" + (f": {spec.description}" if spec.description else "")]
            for model in spec.accepts:
                lines.extend(
                    "  " + line
                    for line in describe_payload(PayloadType.from_model(model)).splitlines()
                )
            cache[name] = tuple(lines)
        return cache[name]

    return describe


def _console_router(spec: ListenerSpec, ctx: RunContext) -> Handler:
    return ConsoleRouter(
        peers=_accepted_tags(ctx.topology, spec.peers),
        # Answer the console a little before the router's own handler timeout would.
        reply_wait=spec.timeout * 0.9,
        default_agent=DEFAULT_AGENT,
        max_bytes=ctx.topology.limits.max_message_bytes,
        describe=_describer(ctx.topology),
    )


def _system_boot(spec: ListenerSpec, ctx: RunContext) -> Handler:
    topology = ctx.topology
    console_names = console_listener_names(topology)
    consoles = [p for p in spec.peers if p in console_names]
    banner = [
        f"agentserver console: organism {topology.organism!r}, "
        f"{len(topology.listeners)} listeners. Type /help for commands, /quit to leave."
    ]
    return SystemBoot(start_console=ctx.terminal is not None and bool(consoles), banner=banner)


BUILTIN_HANDLERS: Mapping[str, Builtin] = MappingProxyType(
    {
        "echo": Builtin(_static(echo.handle), sync_handler=echo.respond),
        "calculator": Builtin(_static(calculator.handle)),
        "assistant": Builtin(_static(assistant.handle)),
        "console": Builtin(_console),
        "console-router": Builtin(_console_router),
        "system-boot": Builtin(_system_boot),
    }
)


def console_listener_names(topology: Topology) -> tuple[str, ...]:
    """Listeners that run the built-in console handler."""
    return tuple(s.name for s in topology.listeners if s.builtin == "console")


@dataclass(frozen=True, slots=True)
class ListenerSet:
    """What :func:`build_listener_set` made of a topology: the pump's listeners and the
    objects behind some of them, which the composition root wires further."""

    listeners: list[Listener]
    #: The hub the remote listeners' handlers send jobs to (None: no remote listener);
    #: the TCP server gives it the runner connections.
    runner_hub: RunnerHub | None = None
    #: Each agent listener's handler, by name: it refuses until the agent runtime binds
    #: it once the pump runs (:func:`agentserver.app.agents.start_agents`).
    agent_handlers: Mapping[str, LateHandler] = field(default_factory=dict)
    #: The connections to the ``<mcp>`` servers behind the tool listeners (None: none);
    #: the composition root runs it while the pump runs.
    mcp_hub: McpHub | None = None
    #: The remote A2A agents behind the skill listeners
    #: (:class:`agentserver.remote.a2a_client.A2aRemotes`; None: none); the operator's
    #: stop cancels their calls.
    a2a_remotes: Any = None


def build_listeners(topology: Topology, ctx: RunContext) -> list[Listener]:
    """The pump listeners of ``topology``, with built-in handlers made for ``ctx`` (see
    :func:`build_listener_set` for the objects behind remote and agent listeners)."""
    return build_listener_set(topology, ctx).listeners


def build_listener_set(topology: Topology, ctx: RunContext) -> ListenerSet:
    """The pump listeners of ``topology``, with built-in handlers made for ``ctx``, and
    the runner hub and agent handlers they use."""
    listeners = []
    late: dict[str, LateHandler] = {}
    hub: RunnerHub | None = None
    mcp_hub: McpHub | None = None
    a2a_remotes: Any = None
    for spec in topology.listeners:
        timeout = spec.timeout
        sync = False
        if spec.mcp_tool is not None:
            # An MCP server's tool: the hub's connection to the server calls it.
            from agentserver.remote.mcp_client import McpHub

            if mcp_hub is None:
                mcp_hub = McpHub(topology.mcp)
            tool = spec.mcp_tool
            handler = mcp_hub.handler_for(tool.server, tool.tool, spec.name, tool.shape)
        elif spec.a2a_skill is not None:
            # A remote A2A agent's skill: the SDK's client calls it.
            from agentserver.remote.a2a_client import A2aRemotes

            if a2a_remotes is None:
                # With agents, their store keeps which remote task a call started
                # (root.py hands it over once they run).
                durable = any(s.agent for s in topology.listeners)
                a2a_remotes = A2aRemotes(topology.a2a, durable=durable)
            skill = spec.a2a_skill
            handler = a2a_remotes.handler_for(skill.remote, skill.skill, spec.name, skill.shape)
        elif spec.remote:
            # Served by runners over the wire: the hub's handler sends each delivery as a
            # job and returns the runner's reply (agentserver.remote.hub).
            from agentserver.remote.hub import hub_for, pump_timeout

            if hub is None:
                hub = hub_for(topology)
                assert hub is not None  # the topology has a remote listener
            handler = hub.handler_for(spec.name)
            timeout = pump_timeout(hub.policies[spec.name])
        elif spec.agent:
            # Agents are run by the agent runtime, bound once the pump runs
            # (agentserver.app.agents.start_agents); they take raw elements.
            from agentserver.agents.service import LateHandler

            handler = late[spec.name] = LateHandler(spec.name)
        elif spec.builtin is not None:
            builtin = BUILTIN_HANDLERS[spec.builtin]
            if builtin.sync_handler is not None and spec.raw:
                handler, sync = builtin.sync_handler, True
            else:
                handler = builtin.factory(spec, ctx)
        else:
            assert spec.handler is not None  # the loader resolved it
            handler = spec.handler
        # An A2A skill's handler retries itself (each retry continuing the remote task).
        own_steps = spec.remote or spec.agent or spec.a2a_skill is not None
        if not own_steps and (spec.step_timeout is not None or spec.idempotent):
            # Steps as a remote listener's: attempts, retries, the same idempotency key.
            from agentserver.remote.hub import pump_timeout
            from agentserver.steps.local import retrying_handler
            from agentserver.steps.retry import StepPolicy

            policy = StepPolicy(
                spec.step_timeout if spec.step_timeout is not None else spec.timeout,
                spec.idempotent,
                spec.retries,
            )
            handler, sync = retrying_handler(spec.name, handler, policy), False
            timeout = pump_timeout(policy)
        listeners.append(
            Listener(
                spec.name,
                spec.accepts,
                handler,
                peers=spec.peers,
                responses=spec.responds,
                agent=spec.agent,
                broadcast=spec.broadcast,
                # An agent's handler is intake only (one short store commit). More than
                # one pump slot would let trio run two slots woken together in either
                # order, so a connection's back-to-back tasks could reach the inbox out of
                # send order; one slot takes the queue strictly first in, first out. Its
                # Turns run in the agent worker (<store worker-concurrency>), not here.
                concurrency=1 if spec.agent else spec.concurrency,
                timeout=timeout,
                queue_size=spec.queue_size,
                raw=spec.raw or spec.agent or spec.remote,
                description=spec.description,
                sync=sync,
                addressed_only=spec.addressed_only,
            )
        )
    return ListenerSet(listeners, hub, MappingProxyType(late), mcp_hub, a2a_remotes)
