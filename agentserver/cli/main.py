"""The ``agentserver`` command: run, send, check, console, schemas, status.

Exit statuses: 0 success; 1 a problem with the topology or the request (boot.xml errors,
a ``<huh>`` or ``<SystemError>`` reply, or a reply marked ``status="failed"``); 2 bad usage or input; 3 no reply in time;
4 cannot connect, or the connection was lost.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import os
import pathlib
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from agentserver.config import loader as boot
from agentserver.config.bundled import BOOT_XML
from agentserver.config.topology import DEFAULT_HTTP_PORT, DEFAULT_PORT, Topology
from agentserver.core.errors import ConfigurationError, HuhReason, InputRefused, sole_exception
from agentserver.core.threads import is_uuid4
from agentserver.core.xmlsafe import DEFAULT_MAX_MESSAGE_BYTES
from agentserver.observability.logs import LOG_FORMATS, configure_logging

if TYPE_CHECKING:
    from agentserver.net.client import Reply

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_CONNECTION = 4
DEFAULT_CONNECT = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_HTTP_URL = f"http://127.0.0.1:{DEFAULT_HTTP_PORT}"
HTTP_URL_ENV = "AGENTSERVER_HTTP_URL"
TOKEN_ENV = "AGENTSERVER_TOKEN"
#: Environment alternatives to --ca, --cert and --key.
TLS_ENV = {"ca": "AGENTSERVER_CA", "cert": "AGENTSERVER_CERT", "key": "AGENTSERVER_KEY"}
BUNDLED_NAME = "<bundled boot.xml>"
#: Defaults from the environment (a container sets these); a command-line option wins.
HOST_ENV = "AGENTSERVER_HOST"
PORT_ENV = "AGENTSERVER_PORT"
BOOT_ENV = "AGENTSERVER_BOOT"
LOG_LEVEL_ENV = "AGENTSERVER_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")

log = logging.getLogger("agentserver.cli")


def _address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _port(value: str) -> int:
    if not value.isdigit() or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number (0-65535)")
    return int(value)


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentserver",
        description="An XML message-pump agent server.",
        epilog="Exit status: 0 ok, 1 failed (boot.xml errors, <huh>/<SystemError> reply, "
        'a reply marked status="failed"), '
        "2 usage, 3 timeout, 4 connection.",
    )
    from agentserver import package_version

    parser.add_argument("--version", action="version", version=f"agentserver {package_version()}")
    levels = list(LEVELS)
    level_help = (
        f"log level on standard error (default: ${LOG_LEVEL_ENV}, else info for run, "
        "warning otherwise)"
    )
    parser.add_argument("--log-level", choices=levels, help=level_help)
    format_help = (
        "log format on standard error: text (human) or json (one object per line); "
        "default: text on a terminal, json otherwise"
    )
    parser.add_argument("--log-format", choices=LOG_FORMATS, help=format_help)
    # Also accepted after the command; SUPPRESS keeps a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", choices=levels, default=argparse.SUPPRESS, help=level_help)
    common.add_argument(
        "--log-format", choices=LOG_FORMATS, default=argparse.SUPPRESS, help=format_help
    )
    # What the commands that talk to a running server share.
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument(
        "--connect",
        type=_address,
        metavar="HOST:PORT",
        help=f"server address (default: ${HOST_ENV}:${PORT_ENV}, each else {DEFAULT_CONNECT})",
    )
    remote.add_argument(
        "--client",
        metavar="NAME",
        help=f"client name for the hello; the token is read from ${TOKEN_ENV} (not needed "
        "with a client certificate)",
    )
    remote.add_argument(
        "--tls",
        action="store_true",
        help="connect with TLS, verifying the server's certificate and name (implied by "
        "--ca, --cert, --key and their variables)",
    )
    remote.add_argument(
        "--ca",
        metavar="FILE",
        help=f"CA certificate(s) (PEM) to verify the server with, instead of the system's "
        f"(default: ${TLS_ENV['ca']})",
    )
    remote.add_argument(
        "--cert",
        metavar="FILE",
        help=f"client certificate (PEM) for mutual TLS (default: ${TLS_ENV['cert']})",
    )
    remote.add_argument(
        "--key",
        metavar="FILE",
        help=f"its private key (PEM; default: ${TLS_ENV['key']}, else in the --cert file)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run",
        parents=[common],
        help="run a topology",
        description="Run the topology of BOOT until SIGINT/SIGTERM (or until an attached "
        "console quits), then stop accepting, drain in-flight work and exit 0. Logs one "
        "line 'agentserver listening on HOST:PORT' to standard error once it accepts "
        "connections.",
    )
    run.add_argument(
        "boot",
        nargs="?",
        metavar="BOOT",
        help=f"boot.xml to run (default: ${BOOT_ENV}, else ./boot.xml, else the bundled one)",
    )
    run.add_argument(
        "--host", help=f"address to listen on (default: ${HOST_ENV}, else boot.xml <listen host>)"
    )
    run.add_argument(
        "--port",
        type=_port,
        help=f"port to listen on; 0 picks a free one (default: ${PORT_ENV}, else boot.xml)",
    )
    run.add_argument(
        "--insecure",
        action="store_true",
        help="allow anonymous connections on a non-loopback address (no clients declared)",
    )
    run.add_argument(
        "--http-port",
        type=_port,
        metavar="PORT",
        help="serve the HTTP API on PORT; 0 picks a free one (default: boot.xml <http port>; "
        "not served without either). Logs 'agentserver http listening on URL'",
    )
    run.add_argument(
        "--console",
        action="store_true",
        help="attach the console listener to this terminal; quitting it stops the server",
    )
    run.add_argument(
        "--explain-refusals",
        action="store_true",
        help="development only (loopback): each <huh> carries the reason it was refused "
        "(e.g. which element is missing) instead of the canned text alone",
    )

    send = sub.add_parser(
        "send",
        parents=[common, remote],
        help="send one payload and print the reply",
        description="Send one payload (an XML element: given as the argument, or read from "
        "FILE or standard input) and print the reply envelope(s) of its thread. Without "
        "--to, the payload's root tag picks the listener. The text of a <huh> or "
        "<SystemError> reply is also printed on standard error. Exit 1 if a reply is a "
        '<huh> or <SystemError> or is marked status="failed" (e.g. an agent\'s failed '
        "<answer>), 3 if none comes in time, 4 if the server is unreachable.",
    )
    send.add_argument(
        "file",
        nargs="?",
        default="-",
        metavar="PAYLOAD|FILE",
        help="the payload itself (an argument starting with '<'), a payload file, or - for "
        "standard input (default)",
    )
    send.add_argument(
        "--to",
        metavar="NAME",
        help="listener to address (default: the one registered for the payload's root tag)",
    )
    output = send.add_mutually_exclusive_group()
    output.add_argument(
        "--payload-only",
        action="store_true",
        help="print only each reply's payload, pretty-printed (a <huh> or <SystemError> "
        "then goes to standard error only)",
    )
    output.add_argument("--pretty", action="store_true", help="pretty-print the reply envelope(s)")
    send.add_argument(
        "--thread", metavar="UUID", help="thread to use (a uuid4; default: a new one)"
    )
    send.add_argument(
        "--timeout",
        type=_positive,
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for the reply (default: 30)",
    )
    send.add_argument(
        "--linger",
        type=float,
        default=0.2,
        metavar="SECONDS",
        help="after the first reply, how long to wait for more on the same thread (default: 0.2)",
    )

    check = sub.add_parser(
        "check",
        parents=[common],
        help="validate a boot.xml",
        description="Validate BOOT against schemas/boot.xsd and check every reference in it "
        "(imports resolve, peers and payload types exist, names are unique, ...). Prints "
        "each problem as FILE:LINE: message and exits 1 on errors; prints a one-line summary "
        "and exits 0 when the file is good (warnings do not fail it).",
    )
    check.add_argument(
        "boot", nargs="?", metavar="BOOT", help=f"the boot.xml to check (default: ${BOOT_ENV})"
    )
    check.add_argument(
        "--connect",
        action="store_true",
        help="also connect to the agents' store when it is PostgreSQL (<store url>) and say "
        "whether it is reachable (an unreachable store fails the check)",
    )

    schemas = sub.add_parser(
        "schemas",
        parents=[common],
        help="export the payload XSDs of a topology",
        description="Write one XSD per payload namespace of BOOT (derived from the payload "
        "models, as the server validates them), plus envelope.xsd and core.xsd, into DIR, so "
        "clients can validate what they send. Prints each file written.",
    )
    schemas.add_argument("boot", metavar="BOOT", help="the boot.xml whose payloads to export")
    schemas.add_argument(
        "--out",
        metavar="DIR",
        default="schemas-export",
        help="target directory (default: ./schemas-export)",
    )

    status = sub.add_parser(
        "status",
        parents=[common],
        help="show what a running server is doing",
        description="Ask a running server's HTTP API (GET /v1/status) for its listeners and "
        "queues, agents with their state and queue, LLM backends with breaker and bucket "
        "state, and connections. Needs the HTTP API (<http> in boot.xml or run --http-port). "
        f"With declared clients the token is read from ${TOKEN_ENV}. Exit 4 if unreachable.",
    )
    status.add_argument(
        "--url",
        default=os.environ.get(HTTP_URL_ENV) or DEFAULT_HTTP_URL,
        metavar="URL",
        help=f"the HTTP API (default: ${HTTP_URL_ENV}, else {DEFAULT_HTTP_URL})",
    )
    status.add_argument(
        "--ca",
        metavar="FILE",
        help=f"CA certificate(s) (PEM) to verify an https URL with (default: ${TLS_ENV['ca']}, "
        "else the system's)",
    )
    status.add_argument("--json", action="store_true", help="print the status document as JSON")
    status.add_argument(
        "--timeout",
        type=_positive,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the answer (default: 10)",
    )

    runner = sub.add_parser(
        "runner",
        parents=[common, remote],
        help="serve a remote listener with a Python handler",
        description="Connect to a server as a runner (a client declared with serves=...), "
        "announce <serve>, and run HANDLER on every job of LISTENER (docs/wire.md, Runners).",
    )
    runner.add_argument(
        "--token-env",
        metavar="VAR",
        default=TOKEN_ENV,
        help=f"environment variable holding the client's token (default: {TOKEN_ENV})",
    )
    runner.add_argument("--listener", required=True, metavar="NAME", help="remote listener")
    runner.add_argument(
        "--handler", required=True, metavar="MOD:FUNC", help="async handler(payload, meta)"
    )
    runner.add_argument(
        "--concurrency", type=int, default=4, metavar="N", help="jobs at once (default: 4)"
    )
    for verb, summary in (
        ("stop", "end an agent's active task with a failed answer"),
        ("cancel", "cancel an agent's task (queued: skipped; running: stopped)"),
    ):
        command = sub.add_parser(
            verb,
            parents=[common, remote],
            help=summary,
            description=f"{summary[0].upper()}{summary[1:]}, over the socket. Allowed for "
            'clients declared operator="true", and for anonymous loopback connections when '
            "no clients are declared (docs/agents.md, Stop and cancel).",
        )
        command.add_argument("agent", metavar="AGENT", help="the agent listener")
        command.add_argument(
            "--thread",
            required=verb == "cancel",
            metavar="T",
            help="the thread the task was sent on"
            + (" (default: whatever task is active)" if verb == "stop" else ""),
        )
        command.add_argument(
            "--timeout", type=_positive, default=30.0, metavar="S", help="seconds (default 30)"
        )
    sub.add_parser(
        "console",
        parents=[common, remote],
        help="talk to a running server",
        description="An interactive console over the socket. Type @NAME <payload .../> to "
        "send a payload to listener NAME, plain text for the default agent, /help, /quit.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    level = args.log_level or os.environ.get(LOG_LEVEL_ENV, "").strip().lower() or None
    if level is not None and level not in LEVELS:
        print(f"${LOG_LEVEL_ENV}: {level!r} is not one of {', '.join(LEVELS)}", file=sys.stderr)
        return EXIT_USAGE
    level = level or ("info" if args.command == "run" else "warning")
    try:
        _apply_environment(args)
    except argparse.ArgumentTypeError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    if args.command == "check" and args.boot is None:
        print(f"check needs BOOT (or ${BOOT_ENV})", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(level, args.log_format, sys.stderr)
    handler = {
        "run": cmd_run,
        "send": cmd_send,
        "check": cmd_check,
        "console": cmd_console,
        "schemas": cmd_schemas,
        "status": cmd_status,
        "runner": cmd_runner,
        "stop": cmd_operator,
        "cancel": cmd_operator,
    }
    return handler[args.command](args)


def _apply_environment(args: argparse.Namespace) -> None:
    """Fill the options left unset from AGENTSERVER_HOST/PORT/BOOT. Raises
    ArgumentTypeError for a variable that is not a valid value."""
    env = os.environ
    host = env.get(HOST_ENV, "").strip() or None
    port_text = env.get(PORT_ENV, "").strip() or None
    try:
        port = _port(port_text) if port_text is not None else None
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"${PORT_ENV}: {exc}") from None
    if getattr(args, "boot", "given") is None:
        args.boot = env.get(BOOT_ENV, "").strip() or None
    if args.command == "run":
        args.host = args.host or host
        args.port = args.port if args.port is not None else port
    if hasattr(args, "connect") and args.connect is None:
        default_host, default_port = _address(DEFAULT_CONNECT)
        if port == 0:
            raise argparse.ArgumentTypeError(f"${PORT_ENV}=0 is no address to connect to")
        args.connect = (host or default_host, port or default_port)


def _trio_run(fn):
    """``trio.run(fn)``, re-raising a nursery's sole exception as itself (callers catch
    ClientError and OSError, not groups of one)."""
    try:
        return trio.run(fn)
    except BaseExceptionGroup as group:
        raise sole_exception(group) from None


# -- check ----------------------------------------------------------------------------------


def _print_problems(result: boot.LoadResult) -> None:
    for problem in result.problems:
        print(problem, file=sys.stderr if problem.warning else sys.stdout)


def cmd_check(args: argparse.Namespace) -> int:
    result = boot.load(args.boot)
    _print_problems(result)
    if result.topology is None:
        count = len(result.errors)
        print(f"{args.boot}: {count} error{'s' * (count != 1)}", file=sys.stderr)
        return EXIT_FAILED
    print(summary(args.boot, result))
    if getattr(args, "connect", False):
        return _check_store_reachable(args.boot, result.topology)
    return EXIT_OK


def _check_store_reachable(name: str, topology: Topology) -> int:
    """``check --connect``: one line saying whether the PostgreSQL store answers."""
    from agentserver.agents.pg.url import probe

    settings = topology.store
    if settings.url is None:
        print(f"{name}: store: SQLite file {settings.path} (nothing to connect to)")
        return EXIT_OK
    ok, detail = probe(settings.url)
    if ok:
        print(f"{name}: store {settings.where}: reachable ({detail})")
        return EXIT_OK
    print(f"{name}: store {settings.where}: NOT reachable: {detail}", file=sys.stderr)
    return EXIT_FAILED


def cmd_schemas(args: argparse.Namespace) -> int:
    import shutil

    from lxml import etree

    from agentserver.core.payloads import PayloadRegistry
    from agentserver.core.schemas_export import schema_path
    from agentserver.primitives.core import CORE_MODELS

    result = boot.load(args.boot)
    if result.topology is None:
        _print_problems(result)
        return EXIT_FAILED
    registry = PayloadRegistry()
    for spec in result.topology.listeners:
        for model in (*spec.accepts, *spec.responds):
            registry.add(model)
    core = set(CORE_MODELS)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("envelope.xsd", "core.xsd"):
        shutil.copyfile(schema_path(name), out / name)
        print(out / name)
    for namespace, doc in sorted(registry.namespace_schemas().items()):
        if all(p.model in core for p in registry if p.namespace == namespace):
            continue  # the core primitives are core.xsd
        stem = "".join(c if c.isalnum() else "-" for c in namespace).strip("-")
        path = out / f"{stem}.xsd"
        path.write_bytes(
            etree.tostring(doc, pretty_print=True, xml_declaration=True, encoding="UTF-8")
        )
        print(path)
    return EXIT_OK


def summary(name: str, result: boot.LoadResult) -> str:
    topo = result.topology
    assert topo is not None
    warnings = len(result.warnings)
    extra = f", {warnings} warning{'s' * (warnings != 1)}" if warnings else ""
    return (
        f"{name}: OK: organism {topo.organism!r}, {len(topo.listeners)} listeners, "
        f"{len(topo.clients)} clients{extra}"
    )


# -- run ------------------------------------------------------------------------------------


def load_boot_for_run(explicit: str | None) -> tuple[str, boot.LoadResult]:
    """The topology ``run`` uses: BOOT if given, else ./boot.xml, else the bundled copy."""
    if explicit is not None:
        return explicit, boot.load(explicit)
    local = pathlib.Path("boot.xml")
    if local.is_file():
        return str(local), boot.load(local)
    return BUNDLED_NAME, boot.load_bytes(BOOT_XML.encode("utf-8"), name=BUNDLED_NAME)


def cmd_run(args: argparse.Namespace) -> int:
    from agentserver.app.builtins import RunContext, console_listener_names
    from agentserver.app.root import ServeOptions, run_server
    from agentserver.console.terminal import logs_above_prompt, make_terminal

    name, result = load_boot_for_run(args.boot)
    topology = result.topology
    if topology is None:
        _print_problems(result)
        print(f"{name}: not started: fix the errors above", file=sys.stderr)
        return EXIT_FAILED
    for problem in result.problems:
        # Logged, not printed: with --log-format json every line on stderr stays one object.
        log.warning("%s", problem)
    if args.console:
        reachable = set(console_listener_names(topology)) & set(topology.boot_listener.peers)
        if not reachable:
            print(
                f"{name}: --console needs a console listener among the boot listener's peers",
                file=sys.stderr,
            )
            return EXIT_FAILED
    log.info("topology %r from %s", topology.organism, name)
    shutdown = trio.Event()
    terminal = make_terminal() if args.console else None
    if terminal is not None and hasattr(terminal, "set_listeners"):
        terminal.set_listeners(_console_targets(topology))
    ctx = RunContext(topology, terminal=terminal, on_console_exit=shutdown.set)
    options = ServeOptions(
        host=args.host,
        port=args.port,
        insecure=args.insecure,
        http_port=args.http_port,
        explain_refusals=args.explain_refusals,
    )

    def listening(addresses: list[str]) -> None:
        # What start-up made (modules, schemas, the topology, the pump) lives as long as the
        # process: out of the cyclic collector's reach, a full collection no longer walks
        # it (under load one took ~45 ms, the tail of every request in flight meanwhile).
        gc.freeze()
        # Printed, not only logged: tools and tests read the bound address from this line.
        print(f"agentserver listening on {', '.join(addresses)}", file=sys.stderr, flush=True)

    def http_listening(urls: list[str]) -> None:
        print(f"agentserver http listening on {', '.join(urls)}", file=sys.stderr, flush=True)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals, shutdown, nursery.cancel_scope, terminal)
            if hasattr(terminal, "chunk"):
                from agentserver.console.terminal import show_chunks

                ctx.services["on_agent_events"] = functools.partial(
                    nursery.start_soon, show_chunks, terminal
                )
            await run_server(
                topology,
                options,
                ctx,
                shutdown,
                environ=os.environ,
                on_listening=listening,
                on_http=http_listening,
            )
            nursery.cancel_scope.cancel()

    try:
        with logs_above_prompt(terminal):
            _trio_run(serve)
    except ConfigurationError as exc:
        print(f"{name}: not started: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"{name}: cannot listen: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


#: With a console attached, how long Ctrl-C lets in-flight work drain before stopping.
CONSOLE_INTERRUPT_GRACE = 0.5


def _console_targets(topology) -> list[str]:
    """The listeners the console can address (its router's peers), for completion."""
    return sorted(
        {peer for s in topology.listeners if s.builtin == "console-router" for peer in s.peers}
    )


async def _watch_signals(
    shutdown: trio.Event, scope: trio.CancelScope, terminal: object = None
) -> None:
    """First SIGINT/SIGTERM: graceful shutdown. A second one: stop at once.

    With a console attached, a person pressed Ctrl-C and waits: the console's pending
    read ends now and the server stops after CONSOLE_INTERRUPT_GRACE at most, instead of
    draining for the full drain-timeout (durable agent work resumes at the next start)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if shutdown.is_set():
                log.warning("second %s: stopping now", signal.Signals(signum).name)
                scope.cancel()
                return
            log.info("%s: shutting down", signal.Signals(signum).name)
            shutdown.set()
            if terminal is not None:
                interrupt = getattr(terminal, "interrupt", None)
                if interrupt is not None:
                    interrupt()
                scope.deadline = min(scope.deadline, trio.current_time() + CONSOLE_INTERRUPT_GRACE)


# -- send -----------------------------------------------------------------------------------


def _tls_options(args: argparse.Namespace) -> dict | None:
    """open_client's TLS arguments from --tls/--ca/--cert/--key (each file option falls
    back to its variable in TLS_ENV); None on a usage error (printed)."""
    files = {
        name: getattr(args, name) or os.environ.get(env) or None for name, env in TLS_ENV.items()
    }
    if files["key"] is not None and files["cert"] is None:
        print(f"--key needs --cert (or ${TLS_ENV['cert']})", file=sys.stderr)
        return None
    if not args.tls and not any(files.values()):
        return {}
    return {"tls": True, **files}


def _credentials(
    args: argparse.Namespace, tls: dict | None = None
) -> tuple[str | None, str | None] | None:
    if args.client is None:
        return None, None
    token = os.environ.get(TOKEN_ENV)
    if not token and tls and tls.get("cert"):
        return args.client, None  # the client certificate says who this is
    if not token:
        print(f"--client needs the token in ${TOKEN_ENV}", file=sys.stderr)
        return None
    return args.client, token


def _failed(reply: Reply) -> bool:
    """A refusal, or an answer that says the request failed (``status="failed"`` on its
    root, as an agent's failed ``<answer>`` or the calculator's ``<error>`` carry)."""
    return reply.is_error or reply.payload.get("status") == "failed"


def cmd_send(args: argparse.Namespace) -> int:
    from agentserver.net.client import (
        ClientError,
        ConnectionClosed,
        RequestTimeout,
        open_client,
        payload_element,
    )

    if args.thread is not None and not is_uuid4(args.thread):
        print("--thread must be a lowercase uuid4", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.file.lstrip().startswith("<"):
            data = args.file.encode("utf-8")
        elif args.file == "-":
            data = sys.stdin.buffer.read()
        else:
            data = pathlib.Path(args.file).read_bytes()
    except OSError as exc:
        print(f"cannot read {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        payload = payload_element(data)
    except InputRefused as exc:
        if exc.reason is HuhReason.TOO_LARGE:
            problem = f"is too large: {exc.detail}, the limit is {DEFAULT_MAX_MESSAGE_BYTES}"
        else:
            problem = f"is not well-formed XML: {exc.detail or exc}"
        print(f"the payload {problem}", file=sys.stderr)
        return EXIT_USAGE
    tls = _tls_options(args)
    creds = _credentials(args, tls)
    if tls is None or creds is None:
        return EXIT_USAGE
    host, port = args.connect

    async def send() -> int:
        async with open_client(host, port, client=creds[0], token=creds[1], **tls) as client:
            reply = await client.request(
                payload, to=args.to, timeout=args.timeout, thread=args.thread
            )
            replies = [reply]
            with trio.move_on_after(max(args.linger, 0)):
                # Ends early if the server closes: what arrived is still printed. Replies
                # on other threads (a named client's answers kept from before) are left
                # unread, so they stay kept for a client that reads them.
                with contextlib.suppress(ConnectionClosed):
                    while True:
                        replies.append(await client.receive_on(reply.thread))
        for r in replies:
            if r.is_error:
                print(error_line(r), file=sys.stderr)
                if args.payload_only:
                    continue
            sys.stdout.write(render_reply(r, payload_only=args.payload_only, pretty=args.pretty))
        sys.stdout.flush()
        return EXIT_FAILED if any(_failed(r) for r in replies) else EXIT_OK

    try:
        return _trio_run(send)
    except RequestTimeout as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_TIMEOUT
    except ConfigurationError as exc:  # a CA, certificate or key file that cannot be used
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except (ClientError, OSError, trio.TooSlowError) as exc:
        print(f"cannot talk to {host}:{port}: {exc}", file=sys.stderr)
        return EXIT_CONNECTION


def render_reply(reply, *, payload_only: bool = False, pretty: bool = False) -> str:
    """A reply as ``send`` prints it: the envelope as received (one line), the envelope
    pretty-printed, or only the payload pretty-printed."""
    from lxml import etree

    if payload_only:
        return etree.tostring(reply.payload, encoding="unicode", pretty_print=True, with_tail=False)
    if pretty:
        root = reply.payload.getroottree().getroot()
        return etree.tostring(root, encoding="unicode", pretty_print=True)
    return reply.raw.decode("utf-8") + "\n"


def error_line(reply) -> str:
    """``huh from NAME: TEXT`` / ``SystemError (CODE) from NAME: TEXT``, with the
    explanation a server run with --explain-refusals adds."""
    from agentserver.core.namespaces import CORE_NS

    if reply.is_huh:
        kind = "huh"
    else:
        kind = f"SystemError ({reply.payload.findtext(f'{{{CORE_NS}}}code')})"
    line = f"{kind} from {reply.from_id}: {reply.error_text}"
    detail = reply.payload.findtext(f"{{{CORE_NS}}}detail")
    return f"{line} ({detail})" if detail else line


# -- stop / cancel --------------------------------------------------------------------------


def cmd_operator(args: argparse.Namespace) -> int:
    """``stop`` and ``cancel``: one operator command, its ``<outcome>`` printed."""
    from lxml import etree

    from agentserver.core.namespaces import CORE_NS
    from agentserver.net.client import ClientError, RequestTimeout, open_client

    if args.thread is not None and not is_uuid4(args.thread):
        print("--thread must be a lowercase uuid4", file=sys.stderr)
        return EXIT_USAGE
    tls = _tls_options(args)
    creds = _credentials(args, tls)
    if tls is None or creds is None:
        return EXIT_USAGE
    host, port = args.connect
    command = etree.Element(f"{{{CORE_NS}}}{args.command}", nsmap={None: CORE_NS})
    command.set("agent", args.agent)
    if args.thread is not None:
        command.set("thread", args.thread)

    async def send() -> int:
        async with open_client(host, port, client=creds[0], token=creds[1], **tls) as client:
            thread = await client.send(command)
            with trio.fail_after(args.timeout):
                reply = await client.receive_on(thread)
        sys.stdout.write(reply.raw.decode("utf-8") + "\n")
        if reply.is_error:
            return EXIT_FAILED
        return EXIT_OK if reply.payload.get("count", "0") != "0" else EXIT_FAILED

    try:
        return _trio_run(send)
    except (RequestTimeout, trio.TooSlowError):
        print(f"no answer within {args.timeout} s", file=sys.stderr)
        return EXIT_TIMEOUT
    except ConfigurationError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except (ClientError, OSError) as exc:
        print(f"cannot talk to {host}:{port}: {exc}", file=sys.stderr)
        return EXIT_CONNECTION


# -- runner ---------------------------------------------------------------------------------


async def _cancel_on_signal(scope: trio.CancelScope) -> None:
    """Cancel ``scope`` at the first SIGINT or SIGTERM (a client command's Ctrl-C)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        async for _ in received:
            scope.cancel()
            return


def cmd_runner(args: argparse.Namespace) -> int:
    from agentserver.net.client import ClientError
    from agentserver.remote.runner import RunnerRefused, run_runner

    # The command line the docs show names no client: a runner of LISTENER is, by
    # default, the client LISTENER-runner (declare it with serves="LISTENER").
    client = args.client or f"{args.listener}-runner"
    token = os.environ.get(args.token_env)
    if not token:
        print(f"runner needs the token in ${args.token_env}", file=sys.stderr)
        return EXIT_USAGE
    if not 1 <= args.concurrency <= 1024:
        print("--concurrency must be 1..1024", file=sys.stderr)
        return EXIT_USAGE
    try:
        handler = boot.resolve_import(args.handler)
    except Exception as exc:
        print(f"--handler {args.handler}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    tls = _tls_options(args)
    if tls is None:
        return EXIT_USAGE
    host, port = args.connect
    from agentserver.observability.tracing import Tracing

    # The same OTEL_* switches as the server's: each job's span joins the caller's trace.
    tracing = Tracing.from_environ(os.environ)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_signal, nursery.cancel_scope)
            await run_runner(
                host,
                port,
                client=client,
                token=token,
                listener=args.listener,
                handler=handler,
                concurrency=args.concurrency,
                tracer_provider=tracing.provider,
                **tls,
            )
            nursery.cancel_scope.cancel()

    try:
        _trio_run(serve)
    except RunnerRefused as exc:
        print(f"the server refused this runner: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ConfigurationError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except (ClientError, OSError, trio.TooSlowError) as exc:
        print(f"cannot talk to {host}:{port}: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    finally:
        tracing.shutdown()  # flush the spans of the last jobs
    return EXIT_OK


# -- console --------------------------------------------------------------------------------


def cmd_console(args: argparse.Namespace) -> int:
    from agentserver.console.remote import run_remote_console
    from agentserver.console.terminal import logs_above_prompt, make_terminal
    from agentserver.net.client import ClientError

    tls = _tls_options(args)
    creds = _credentials(args, tls)
    if tls is None or creds is None:
        return EXIT_USAGE
    host, port = args.connect
    terminal = make_terminal()

    async def console() -> int:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_signal, nursery.cancel_scope)
            status = await run_remote_console(
                host, port, terminal, client=creds[0], token=creds[1], **tls
            )
            nursery.cancel_scope.cancel()
            return status
        return EXIT_OK  # interrupted

    try:
        with logs_above_prompt(terminal):
            status = _trio_run(console)
    except ConfigurationError as exc:  # a CA, certificate or key file that cannot be used
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except (ClientError, OSError, trio.TooSlowError) as exc:
        print(f"cannot talk to {host}:{port}: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    return EXIT_CONNECTION if status else EXIT_OK


# -- status ---------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    headers = {}
    token = os.environ.get(TOKEN_ENV)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    ca = args.ca or os.environ.get(TLS_ENV["ca"])
    url = args.url.rstrip("/") + "/v1/status"
    try:
        with httpx.Client(verify=ca or True, timeout=args.timeout) as client:
            response = client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        print(
            f"cannot reach the HTTP API at {args.url}: {exc} (is the server running with "
            "<http> in boot.xml or run --http-port?)",
            file=sys.stderr,
        )
        return EXIT_CONNECTION
    if response.status_code != 200:
        try:
            title = response.json().get("title", "")
        except ValueError:
            title = response.text[:200]
        print(f"{url}: {response.status_code} {title}", file=sys.stderr)
        return EXIT_FAILED
    doc = response.json()
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(format_status(doc))
    return EXIT_OK


def format_status(doc: dict) -> str:
    """The status document (GET /v1/status) for a terminal."""
    ready = doc.get("ready", {})
    checks = ", ".join(f"{k} {_yes(v)}" for k, v in ready.get("checks", {}).items())
    pump = doc.get("pump", {})
    lines = [
        f"organism {doc.get('organism')!r} (agentserver {doc.get('version')}): "
        f"{'ready' if ready.get('ready') else 'NOT ready'} ({checks})",
        f"pump {pump.get('state')}: {pump.get('inflight', 0)} in flight, "
        f"{pump.get('threads', 0)} threads, {pump.get('endpoints', 0)} endpoints",
        "listeners:",
    ]
    for lst in doc.get("listeners", []):
        lines.append(
            f"  {lst['name']:<20} queue {lst['queue']:<5} waiting {lst['waiting']:<5} "
            f"handled {lst['handled']}{'  (agent)' if lst.get('agent') else ''}"
        )
    agents = doc.get("agents", [])
    if agents:
        lines.append("agents:")
        for agent in agents:
            turn = agent.get("active_turn")
            active = f", turn {turn['id'][:8]} step {turn['steps']}" if turn else ""
            error = agent.get("last_error")
            last = f", last error ({error['status']}): {error['text'][:60]!r}" if error else ""
            lines.append(
                f"  {agent['name']:<20} {agent['state']:<10} queue {agent['queue']}{active}{last}"
            )
    backends = doc.get("backends", {})
    if backends:
        lines.append("LLM backends:")
        for name, b in backends.items():
            if b.get("skipped"):
                lines.append(f"  {name:<20} skipped: {b['skipped']}")
                continue
            buckets = ", ".join(
                f"{label} bucket {b[key]:.0%}"
                for key, label in (
                    ("requests_bucket_fill", "requests"),
                    ("tokens_bucket_fill", "tokens"),
                )
                if b.get(key) is not None
            )
            cooling = f", cooling {b['cooling_for']:.1f}s" if b.get("cooling_for") else ""
            lines.append(
                f"  {name:<20} breaker {b['breaker']}, {b['active']} active{cooling}"
                f"{', ' + buckets if buckets else ''}"
            )
    conns = doc.get("connections", {})
    lines.append(
        f"connections: socket {conns.get('socket', 0)}, HTTP pending {conns.get('http_pending', 0)}, "
        f"HTTP kept threads {conns.get('http_kept_threads', 0)}, "
        f"event streams {conns.get('sse_streams', 0)}"
    )
    return "\n".join(lines)


def _yes(value: object) -> str:
    return "n/a" if value is None else ("ok" if value else "FAILING")
