"""The composition root: builds a topology's parts (pump, listeners, TCP server, agents)
from boot.xml's :class:`~agentserver.topology.Topology` and runs them together.

This is the one place that knows every subsystem; each of them only knows the objects it
is given (no module-level singletons).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio
from prometheus_client import CollectorRegistry

from agentserver.builtins import RunContext, build_listeners
from agentserver.errors import ConfigurationError
from agentserver.handshake import Credential, HelloGate
from agentserver.observability import Metrics, Tracing
from agentserver.pump import Pump
from agentserver.server import Server, format_address
from agentserver.tls import CertificateRule, normalize_fingerprint, parse_subject
from agentserver.topology import Topology

log = logging.getLogger("agentserver.app")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """How ``agentserver run`` runs a topology (None: the topology's own value)."""

    host: str | None = None
    port: int | None = None
    insecure: bool = False


def credentials(topology: Topology, environ) -> dict[str, Credential]:
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
    environ,
    on_listening: Callable[[list[str]], None] | None = None,
    registry: CollectorRegistry | None = None,
    tracing: Tracing | None = None,
) -> None:
    """Run ``topology`` until ``shutdown`` is set, then shut down cleanly: stop accepting,
    let in-flight work drain (``drain_timeout``), flush and close connections, close the
    resources subsystems registered on ``ctx.resources``. Raises ConfigurationError if the
    server must not start (e.g. anonymous access on a public address without insecure).

    ``registry`` receives the server's Prometheus metrics (a fresh one by default);
    ``tracing`` defaults to what the ``OTEL_*`` variables of ``environ`` ask for."""
    from agentserver.boot import is_loopback  # boot imports builtins; keep imports acyclic

    host = options.host or topology.host
    port = topology.port if options.port is None else options.port
    if not topology.clients and not options.insecure and not is_loopback(host):
        raise ConfigurationError(
            f"no clients are declared, so connections are anonymous: refusing to listen on "
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
    ssl_context = None
    if topology.tls is not None:
        from agentserver.tls import server_context

        ssl_context = server_context(topology.tls, environ)  # TlsError is a ConfigurationError
    # -- observability (traces, metrics) --
    if tracing is None:
        tracing = Tracing.from_environ(environ)
        ctx.resources.callback(tracing.shutdown)
    metrics = Metrics(registry if registry is not None else CollectorRegistry())
    listeners = build_listeners(topology, ctx)
    pump = Pump(listeners, config=topology.pump_config(), tracing=tracing)
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
    )
    # The server keeps no public count (yet): read its set of connections at scrape time.
    metrics.bind_pump(pump, lambda: len(server._connections))
    async with ctx.resources:
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.run)
            from agentserver.agents.service import start_agents

            agents = await start_agents(
                topology,
                pump,
                ctx.services.get("agent_handlers", {}),
                nursery,
                ctx.resources,
                environ=environ,
                tracing=tracing,
                metrics=metrics,
            )
            if agents is not None:
                server.named_clients = agents.ports.clients
            await pump.inject_system(
                topology.boot_primitive(),
                to=topology.boot_listener.name,
            )
            try:
                addresses = await nursery.start(server.serve, host, port)
            except OSError:
                pump.close()
                raise
            shown = [format_address(a) for a in addresses]
            log.debug("listening on %s", ", ".join(shown))
            if on_listening is not None:
                on_listening(shown)
            await shutdown.wait()
            log.info("shutting down: draining for up to %ss", topology.limits.drain_timeout)
            server.stop_accepting()
            if agents is not None:
                # Turns are durable: stopping the worker first means no new tool calls
                # race the draining pump; an interrupted Turn resumes at the next start.
                agents.stop()
            pump.close()
    log.info("agentserver stopped")
