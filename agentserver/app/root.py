"""The composition root: builds a topology's parts (pump, listeners, TCP server, agents)
from boot.xml's :class:`~agentserver.config.topology.Topology` and runs them together.

This is the one place that knows every subsystem; each of them only knows the objects it
is given (no module-level singletons).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry

from agentserver.app.builtins import RunContext, build_listener_set
from agentserver.app.drain import Drain
from agentserver.config.topology import HttpSpec, Topology
from agentserver.console.operator import Operator
from agentserver.core.access import AccessRule
from agentserver.core.errors import CannotListen, ConfigurationError, sole_exception
from agentserver.core.handshake import Credential, HelloGate
from agentserver.net.server import Server, format_address
from agentserver.net.tls import CertificateRule, normalize_fingerprint, parse_subject
from agentserver.observability import Metrics, Tracing
from agentserver.observability.metrics import AccessRefusals
from agentserver.pump.pump import Pump

if TYPE_CHECKING:
    from agentserver.agents.events import EventBus
    from agentserver.agents.service import AgentService
    from agentserver.agents.store.base import ViewStore
    from agentserver.remote.hub import RunnerHub

log = logging.getLogger("agentserver.app")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """How ``agentserver run`` runs a topology (None: the topology's own value)."""

    host: str | None = None
    port: int | None = None
    insecure: bool = False
    #: ``run --http-port``: serve the HTTP API on this port (on ``<http host>``, else on
    #: the socket's host), even without ``<http>``.
    http_port: int | None = None
    #: Development only (loopback): each <huh> carries its logged reason (docs/protocol.md).
    explain_refusals: bool = False


@dataclass(frozen=True, slots=True)
class Running:
    """A running server's parts, for whoever embeds :func:`run_server` (tests, tools):
    handed to its ``on_running`` once the server listens."""

    #: The socket's addresses, as ``on_listening`` gets them.
    addresses: tuple[str, ...]
    #: The remote listeners' hub (None: the topology has no remote listener).
    runner_hub: RunnerHub | None
    #: The agents (None: the topology has no agent listener).
    agents: AgentService | None


def http_spec(topology: Topology, options: ServeOptions, socket_host: str) -> HttpSpec | None:
    """Where and how the HTTP API is served; None: it is not."""
    spec = topology.http
    if options.http_port is None:
        return spec
    if spec is None:
        return HttpSpec(host=socket_host, port=options.http_port)
    return dataclasses.replace(spec, port=options.http_port)


def check_exposure(topology: Topology, host: str, insecure: bool, what: str) -> None:
    """The address rules of the socket (and of the HTTP API): anonymous access only on
    loopback unless ``insecure``; tokens never in clear off loopback. Raises
    ConfigurationError."""
    from agentserver.config.loader import is_loopback  # boot imports builtins; keep imports acyclic

    if not topology.clients and not insecure and not is_loopback(host):
        raise ConfigurationError(
            f"no clients are declared, so {what} are anonymous: refusing to listen on "
            f"non-loopback address {host} (declare clients in boot.xml, or pass --insecure)"
        )
    if topology.clients and topology.tls is None and not is_loopback(host):
        if not topology.insecure_plaintext:
            raise ConfigurationError(
                f"clients are declared but {host} is not loopback and there is no <tls>: "
                "tokens would cross the network in clear (add <tls>, or "
                'insecure-plaintext="true" on <listen> to accept that)'
            )
        log.warning(
            "insecure-plaintext: tokens and messages to %s cross the network in clear", host
        )


def credentials(topology: Topology, environ: Mapping[str, str]) -> dict[str, Credential]:
    """Declared clients and their tokens, read from the environment now. (An unset
    token was reported by the boot loader, as a warning with its line.)"""
    out = {}
    for client in topology.clients:
        token = (environ.get(client.token_env) if client.token_env else None) or None
        allowed = frozenset(client.may_address) if client.may_address is not None else None
        out[client.name] = Credential(token, allowed)
    return out


def certificate_rules(topology: Topology) -> tuple[CertificateRule, ...]:
    """Who a client certificate proves, from the clients' cert-subject/cert-fingerprint
    (only consulted with mutual TLS: ``<tls client-ca>``)."""
    tls = topology.tls
    if tls is None or tls.client_ca is None:
        return ()
    return tuple(
        CertificateRule(
            c.name,
            parse_subject(c.cert_subject) if c.cert_subject else None,
            normalize_fingerprint(c.cert_fingerprint) if c.cert_fingerprint else None,
        )
        for c in topology.clients
        if c.cert_subject or c.cert_fingerprint
    )


async def run_server(
    topology: Topology,
    options: ServeOptions,
    ctx: RunContext,
    shutdown: trio.Event,
    *,
    environ: Mapping[str, str],
    on_listening: Callable[[list[str]], None] | None = None,
    on_http: Callable[[list[str]], None] | None = None,
    on_running: Callable[[Running], None] | None = None,
    on_agent_events: Callable[[EventBus], None] | None = None,
    registry: CollectorRegistry | None = None,
    tracing: Tracing | None = None,
) -> None:
    """Run ``topology`` until ``shutdown`` is set, then shut down cleanly: stop accepting,
    let in-flight work drain (``drain_timeout``), flush and close connections, close the
    resources subsystems registered on ``ctx.resources``. Raises ConfigurationError if the
    server must not start (e.g. anonymous access on a public address without insecure).

    With ``<http>`` (or ``options.http_port``) the HTTP API is served too, before the
    socket, and ``on_http`` gets its URLs. Once the socket listens, ``on_listening``
    gets its addresses and ``on_running`` the running parts (:class:`Running`).
    ``on_agent_events`` gets the agents' event bus once they run (an attached console
    shows their streamed text; not called without agents). ``registry`` is the Prometheus registry
    ``/metrics`` serves and the server's metrics are registered in (a new one by
    default); ``tracing`` defaults to what the ``OTEL_*`` variables of ``environ`` ask
    for."""
    if registry is None:
        registry = CollectorRegistry()
    host = options.host or topology.host
    port = topology.port if options.port is None else options.port
    check_exposure(topology, host, options.insecure, "connections")
    http = http_spec(topology, options, host)
    if http is not None:
        check_exposure(topology, http.host, options.insecure, "HTTP callers")
    if options.explain_refusals:
        from agentserver.config.loader import is_loopback

        if not is_loopback(host):
            raise ConfigurationError(
                f"--explain-refusals is for development on a loopback address, not {host}: "
                "it tells every sender why it was refused"
            )
        log.warning(
            "--explain-refusals: every <huh> carries the reason it was refused "
            "(development only; never on a server others use)"
        )
    ssl_context = None
    if topology.tls is not None:
        from agentserver.net.tls import server_context

        ssl_context = server_context(topology.tls, environ)  # TlsError is a ConfigurationError
    # -- observability (traces, metrics) --
    if tracing is None:
        tracing = Tracing.from_environ(environ)
        ctx.resources.callback(tracing.shutdown)
    metrics = Metrics(registry)
    # The one authorization rule every door applies (docs/security.md); its refusals are
    # counted in /metrics and logged.
    access = AccessRule(
        frozenset(c.name for c in topology.clients if c.operator),
        anonymous_sees_all=not topology.clients,
        sink=AccessRefusals(registry),
    )
    built = build_listener_set(topology, ctx)
    hub = built.runner_hub
    config = topology.pump_config()
    if options.explain_refusals:
        config = dataclasses.replace(config, explain_refusals=True)
    pump = Pump(built.listeners, config=config, tracing=tracing)
    step_log = step_writer = None
    webhooks = hooks_scope = None
    async with ctx.resources:
        if built.a2a_remotes is not None:
            # Their HTTP connections close with the run.
            ctx.resources.push_async_callback(built.a2a_remotes.aclose)
        if built.mcp_hub is not None:
            # Connected before the pump runs; closed (servers stopped) after it drained.
            await ctx.resources.enter_async_context(built.mcp_hub.running())
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.run)
            from agentserver.app.agents import start_agents

            agents = await start_agents(
                topology,
                pump,
                built.agent_handlers,
                nursery,
                ctx.resources,
                environ=environ,
                tracing=tracing,
                metrics=metrics,
                access=access,
            )
            if agents is not None:
                if hub is not None or built.a2a_remotes is not None:
                    # Step events are durable rows in the agents' store from now on
                    # (the runners' steps; the remote tasks <a2a> calls started).
                    step_log, step_writer = await _durable_step_log(
                        nursery, agents.runtime.store, metrics
                    )
                    if hub is not None:
                        hub.log_steps_to(step_log)
                    if built.a2a_remotes is not None:
                        built.a2a_remotes.log_steps_to(step_log)
                if on_agent_events is not None:
                    on_agent_events(agents.runtime.events)
                # Costs nothing until a webhook exists (declared or made at run time).
                webhooks, hooks_scope = await _start_webhooks(nursery, topology, agents, registry)
            # Made once the agents run: the named clients' replies and the operator's
            # commands need them. The web console carries out stop/cancel with the same
            # operator object, for the same operators.
            operator = Operator(
                agents.runtime if agents is not None else None,
                hub,
                max_message_bytes=topology.limits.max_message_bytes,
                remote_calls=built.a2a_remotes,
                access=access,
            )
            server = Server(
                pump,
                topology.limits,
                HelloGate(credentials(topology, environ)),
                ssl_context=ssl_context,
                cert_rules=certificate_rules(topology) if topology.tls is not None else (),
                allowed={
                    c.name: frozenset(c.may_address) if c.may_address is not None else None
                    for c in topology.clients
                },
                runners=hub,
                operator=operator,
                operators=frozenset(c.name for c in topology.clients if c.operator),
                anonymous_operators=not topology.clients,
                named_clients=agents.ports.clients if agents is not None else None,
            )
            metrics.bind_pump(pump, lambda: server.connection_count)
            # Both addresses are bound before the boot message and any "listening" line:
            # a port in use stops the start naming its element, with nothing announced.
            http_stop = trio.Event()
            # ``agentserver drain``: no new work, then the shutdown below (docs/deploy.md).
            drain = Drain(agents.runtime if agents is not None else None, shutdown, nursery)
            http_ctx = None
            urls: list[str] = []
            if http is not None:
                try:
                    http_ctx, urls = await _start_http(
                        nursery,
                        topology,
                        http,
                        pump,
                        server,
                        hub,
                        agents,
                        registry,
                        ctx,
                        http_stop,
                        environ,
                        operator,
                        webhooks,
                        access,
                        step_log,
                        drain,
                    )
                except (OSError, BaseExceptionGroup) as exc:
                    # Hypercorn binds inside a nursery of its own: a group of one OSError.
                    cause = sole_exception(exc) if isinstance(exc, BaseExceptionGroup) else exc
                    if not isinstance(cause, OSError):
                        raise
                    pump.close()
                    address = format_address((http.host, http.port))
                    raise CannotListen("http", address, cause) from exc
            try:
                addresses = await nursery.start(server.serve, host, port)
            except OSError as exc:
                pump.close()
                raise CannotListen("listen", format_address((host, port)), exc) from exc
            await pump.inject_system(
                topology.boot_primitive(),
                to=topology.boot_listener.name,
            )
            if http is not None:
                log.debug("HTTP API on %s", ", ".join(urls))
                if on_http is not None:
                    on_http(urls)
            shown = [format_address(a) for a in addresses]
            log.debug("listening on %s", ", ".join(shown))
            if on_listening is not None:
                on_listening(shown)
            if on_running is not None:
                on_running(Running(tuple(shown), hub, agents))
            await shutdown.wait()
            log.info("shutting down: draining for up to %ss", topology.limits.drain_timeout)
            if http_ctx is not None:
                http_ctx.close()
            http_stop.set()
            server.stop_accepting()
            if agents is not None:
                # Turns are durable: stopping the worker first means no new tool calls
                # race the draining pump; an interrupted Turn resumes at the next start.
                agents.stop()
            pump.close()
            if step_writer is not None:
                step_writer.cancel()  # the rows the draining pump still logs wait for drain()
            if hooks_scope is not None:
                hooks_scope.cancel()  # deliveries in flight: their leases run out
        if step_log is not None:
            # The hub has stopped and the writer with it: what it still held goes to
            # the store before the store closes (ctx.resources).
            await step_log.drain()
        if webhooks is not None:
            # The events the Turns ended last still waiting for the writer.
            await webhooks.drain()
    log.info("agentserver stopped")


async def _durable_step_log(
    nursery: trio.Nursery, store: ViewStore, metrics: Metrics
) -> tuple[Any, trio.CancelScope]:
    """The runner hub's step log in the agents' store, and the scope of its writer (run
    in ``nursery``; cancelled at shutdown, then ``drain()`` writes the rest)."""
    from agentserver.agents.store.step_log import StoreStepLog

    step_log = StoreStepLog(store)
    metrics.bind_step_log(step_log)
    scope = trio.CancelScope()

    async def write(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await step_log.run(task_status=task_status)

    await nursery.start(write)
    return step_log, scope


async def _start_webhooks(
    nursery: trio.Nursery, topology: Topology, agents: AgentService, registry: CollectorRegistry
) -> tuple[Any, trio.CancelScope]:
    """The webhooks (docs/webhooks.md) on the agents' store and event bus, run in
    ``nursery`` under the returned scope (cancelled at shutdown, then ``drain()``)."""
    from agentserver.agents.edge.outbox import KEEP_DONE_S, Outbox
    from agentserver.agents.edge.outbox_metrics import OutboxCollector
    from agentserver.agents.edge.webhooks import WebhookDirectory, Webhooks

    store = agents.store
    clock = agents.runtime.clock.now
    bus = agents.runtime.events
    # With <retention> the pruner removes done deliveries (its `deliveries` window, in
    # leased batches); without it the sender keeps them a day, as it always did.
    keep = KEEP_DONE_S if topology.store.retention is None else None
    # In dependency order: the directory (which the outbox asks for channels made by
    # other processes, and tells of disabled ones), the outbox, the webhooks.
    directory = WebhookDirectory(store, bus)
    outbox = Outbox(store, clock, keep_done_s=keep, directory=directory)
    webhooks = Webhooks(store, directory, outbox, bus, clock, topology.webhooks)
    registry.register(OutboxCollector(outbox))
    scope = trio.CancelScope()

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await webhooks.run(task_status=task_status)

    await nursery.start(run)
    return webhooks, scope


def _a2a_handler(
    topology: Topology,
    spec: HttpSpec,
    gateway: Any,
    agents: AgentService,
    operator: Operator | None,
    access: AccessRule | None = None,
) -> Any:
    """The A2A methods on the agents ``<expose-a2a>`` names (docs/a2a.md)."""
    from agentserver import package_version
    from agentserver.config.a2a import exposed_skills
    from agentserver.http.a2a.card import CardFacts
    from agentserver.http.a2a.handler import A2aDeps, A2aHandler
    from agentserver.http.gate import Gate

    assert topology.expose_a2a is not None
    return A2aHandler(
        A2aDeps(
            store=agents.runtime.store,
            gateway=gateway,
            skills=exposed_skills(topology),
            facts=CardFacts(
                organism=topology.organism,
                description=topology.description,
                version=package_version(),
                secured=bool(topology.clients),
            ),
            may_see=Gate.may_see,
            wait_timeout=spec.wait_timeout,
            conversations=agents.runtime,
            operator=operator,
            public_url=topology.expose_a2a.public_url,
            allow_private_push=topology.expose_a2a.allow_private_push,
            access=access,
        )
    )


async def _a2a_push(
    deps: Any,
    webhooks: Any,
    scope: trio.CancelScope,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The A2A push notifications' watcher, until ``scope`` is cancelled (the HTTP API's
    end); the webhooks' outbox delivers them (its sender started for them)."""
    from agentserver.http.a2a.push import PushNotifier, push_channels

    push_channels(webhooks.outbox, allow_private=deps.allow_private_push)
    await webhooks.start_sender()
    with scope:
        await PushNotifier(deps.store, webhooks.outbox).run(task_status=task_status)


async def _start_http(
    nursery: trio.Nursery,
    topology: Topology,
    spec: HttpSpec,
    pump: Pump,
    server: Server,
    hub: RunnerHub | None,
    agents: AgentService | None,
    registry: CollectorRegistry,
    ctx: RunContext,
    stop: trio.Event,
    environ: Mapping[str, str],
    operator: Operator | None = None,
    webhooks: Any = None,
    access: AccessRule | None = None,
    steps: Any = None,
    drain: Drain | None = None,
) -> tuple[Any, list[str]]:
    """Start the HTTP API in ``nursery`` (it ends once ``stop`` is set and its requests
    are done, or after the drain timeout); returns its context (to close its event
    streams at shutdown) and its URLs."""
    from agentserver import package_version
    from agentserver.http.agents_view import AgentsView
    from agentserver.http.api import HttpContext, build_app
    from agentserver.http.auth import HttpAuth
    from agentserver.http.gateway import HttpGateway
    from agentserver.http.metrics import HttpCollector
    from agentserver.http.serve import http_config, serve_http
    from agentserver.http.ui.sessions import (
        MemorySessionTable,
        SessionTable,
        StoreSessionTable,
        UiSessions,
    )

    gateway = HttpGateway(
        pump, topology.limits, spec, deciders=agents.ports if agents is not None else None
    )
    registry.register(HttpCollector(gateway))
    view = None
    if agents is not None:
        view = AgentsView(agents.runtime.store, tuple(agents.profiles))
    router = agents.router if agents is not None else None
    auth = HttpAuth(credentials(topology, environ))
    # The console's sessions live in the agents' store (every process of a PostgreSQL
    # store, and restarts, know them); without agents there is no store: this process's
    # memory (docs/operations.md, "Signing in").
    table: SessionTable
    if agents is not None:
        table = StoreSessionTable(agents.runtime.store)
    else:
        from agentserver.agents.clock import SystemClock

        table = MemorySessionTable(SystemClock())
    # The doors the app serves are made before it, and given to its context.
    a2a = None
    if topology.expose_a2a is not None and agents is not None:
        a2a = _a2a_handler(topology, spec, gateway, agents, operator, access)
    agui = None
    if agents is not None and view is not None:
        from agentserver.config.agui import agui_agents
        from agentserver.http.agui.runs import AguiRuns

        agui = AguiRuns(agui_agents(topology), gateway, view, agents.runtime.events, agents.runtime)
    mcp_http = None
    if topology.expose_mcp:
        from agentserver.config.loader import is_loopback
        from agentserver.config.mcp import exposed_tools
        from agentserver.http.gate import Gate
        from agentserver.http.mcp_expose import GatewaySender, McpHttp, build_server
        from agentserver.http.mcp_tasks import TurnDoor

        turns = None
        if agents is not None:
            # An agent's tool on its durable Turn: tasks, input_required (docs/mcp.md).
            turns = TurnDoor(
                store=agents.runtime.store,
                gateway=gateway,
                may_see=Gate.may_see,
                wait_timeout=spec.wait_timeout,
                operator=operator,
                access=access,
            )
        mcp_http = McpHttp(
            build_server(
                exposed_tools(topology),
                GatewaySender(gateway),
                name=topology.organism,
                version=package_version(),
                may_see=Gate.may_see,
                turns=turns,
            ),
            loopback=is_loopback(spec.host),
        )
    app_ctx = HttpContext(
        pump=pump,
        gateway=gateway,
        auth=auth,
        registry=registry,
        agents=view,
        forks=agents.runtime if agents is not None else None,
        schedules=agents.runtime.scheduler if agents is not None else None,
        events=agents.runtime.events if agents is not None else None,
        backends=(lambda: router.stats().as_dict()["backends"]) if router is not None else None,
        transports=lambda: {"socket": server.connection_count, **server.counters},
        # The durable step log (runners, or <a2a> calls' remote tasks), else the hub's.
        steps=steps if steps is not None else (hub.step_log if hub is not None else None),
        operator=operator,
        webhooks=webhooks,
        operators=frozenset(c.name for c in topology.clients if c.operator),
        anonymous_operators=not topology.clients,
        tls=topology.tls is not None,
        mcp=mcp_http,
        a2a=a2a,
        agui=agui,
        organism=topology.organism,
        version=package_version(),
        budgets=agents.budgets if agents is not None else None,
        ui_sessions=UiSessions(table, auth, spec.ui_session_ttl),
        access=access,
        drain=drain,
    )
    ssl_context = None
    if topology.tls is not None:
        from agentserver.net.tls import server_context

        # Its own context: ALPN for HTTP must not touch the socket's.
        ssl_context = server_context(topology.tls, environ)
    config = http_config(
        spec.host,
        spec.port,
        ssl_context=ssl_context,
        read_timeout=topology.limits.read_timeout,
        graceful_timeout=topology.limits.drain_timeout,
    )
    gateway_scope = trio.CancelScope()

    async def run_gateway(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with gateway_scope:
            await gateway.run(task_status=task_status)

    async def run_http(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with mcp_http.running() if mcp_http is not None else contextlib.nullcontext():
                await serve_http(build_app(app_ctx), config, stop, task_status=task_status)
        finally:
            gateway_scope.cancel()
            push_scope.cancel()

    push_scope = trio.CancelScope()
    if app_ctx.a2a is not None and webhooks is not None:
        await nursery.start(_a2a_push, app_ctx.a2a.deps, webhooks, push_scope)

    await nursery.start(run_gateway)
    return app_ctx, await nursery.start(run_http)
