"""``agentserver run``: load a boot.xml and run its topology until a signal (or an
attached console) stops it."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import pathlib
import signal
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import trio

from agentserver.cli.common import (
    BOOT_ENV,
    BUNDLED_NAME,
    EXIT_FAILED,
    EXIT_OK,
    HOST_ENV,
    PORT_ENV,
    Subcommands,
    parse_port,
    print_problems,
    trio_run,
)
from agentserver.config.bundled import BOOT_XML
from agentserver.config.topology import Topology

if TYPE_CHECKING:
    from agentserver.agents.events import EventBus
    from agentserver.config.problems import LoadResult
from agentserver.core.errors import CannotListen, ConfigurationError
from agentserver.observability.logs import announce

log = logging.getLogger("agentserver.cli")


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``run`` subcommand."""
    run = sub.add_parser(
        "run",
        parents=[common],
        help="run a topology",
        description="Run the topology of BOOT until SIGINT/SIGTERM (or until an attached "
        "console quits), then stop accepting, drain in-flight work and exit 0. Writes one "
        "line 'agentserver listening on HOST:PORT' to standard error once it accepts "
        "connections (in JSON logs, the event of one JSON object, with 'addresses').",
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
        type=parse_port,
        help=f"port to listen on; 0 picks a free one (default: ${PORT_ENV}, else boot.xml)",
    )
    run.add_argument(
        "--insecure",
        action="store_true",
        help="allow anonymous connections on a non-loopback address (no clients declared)",
    )
    run.add_argument(
        "--http-port",
        type=parse_port,
        metavar="PORT",
        help="serve the HTTP API on PORT; 0 picks a free one (default: boot.xml <http port>; "
        "not served without either). Writes 'agentserver http listening on URL' (in JSON "
        "logs, the event of one JSON object, with 'urls')",
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


def load_boot_for_run(explicit: str | None) -> tuple[str, LoadResult]:
    """The topology ``run`` uses: BOOT if given, else ./boot.xml, else the bundled copy."""
    from agentserver.config import loader as boot  # not at import: other commands skip it

    if explicit is not None:
        return explicit, boot.load(explicit)
    local = pathlib.Path("boot.xml")
    if local.is_file():
        return str(local), boot.load(local)
    return BUNDLED_NAME, boot.load_bytes(BOOT_XML.encode("utf-8"), name=BUNDLED_NAME)


def cmd_run(args: argparse.Namespace) -> int:
    """Run the topology. ``args.log_format`` is the format in use (main resolved the
    default): in ``json`` every line this writes on standard error is one JSON object."""
    json_logs = args.log_format == "json"
    with _warnings_logged(json_logs):
        return _run(args, json_logs)


def _run(args: argparse.Namespace, json_logs: bool) -> int:
    from agentserver.app.builtins import RunContext, console_listener_names
    from agentserver.app.root import ServeOptions, run_server
    from agentserver.console.terminal import PromptTerminal, logs_above_prompt, make_terminal

    name, result = load_boot_for_run(args.boot)
    topology = result.topology
    if topology is None:
        _print_problems(result, json_logs)
        _say_error(json_logs, f"{name}: not started: fix the errors above")
        return EXIT_FAILED
    for problem in result.problems:
        # Logged, not printed: with --log-format json every line on stderr stays one object.
        log.warning("%s", problem)
    if args.console:
        reachable = set(console_listener_names(topology)) & set(topology.boot_listener.peers)
        if not reachable:
            _say_error(
                json_logs,
                f"{name}: --console needs a console listener among the boot listener's peers",
            )
            return EXIT_FAILED
    log.info("topology %r from %s", topology.organism, name)
    shutdown = trio.Event()
    terminal = make_terminal(_console_targets(topology)) if args.console else None
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
        # Tools and tests read the bound address from this line.
        _banner(json_logs, f"agentserver listening on {', '.join(addresses)}", addresses=addresses)

    def http_listening(urls: list[str]) -> None:
        _banner(json_logs, f"agentserver http listening on {', '.join(urls)}", urls=urls)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals, shutdown, nursery.cancel_scope, terminal)
            on_agent_events: Callable[[EventBus], None] | None = None
            if isinstance(terminal, PromptTerminal):  # it shows streamed text
                from agentserver.console.terminal import show_chunks

                prompt = terminal

                def show_agent_chunks(bus: EventBus) -> None:
                    nursery.start_soon(show_chunks, prompt, bus)

                on_agent_events = show_agent_chunks
            await run_server(
                topology,
                options,
                ctx,
                shutdown,
                environ=os.environ,
                on_listening=listening,
                on_http=http_listening,
                on_agent_events=on_agent_events,
            )
            nursery.cancel_scope.cancel()

    try:
        with logs_above_prompt(terminal):
            trio_run(serve)
    except ConfigurationError as exc:
        _say_error(json_logs, f"{name}: not started: {exc}")
        return EXIT_FAILED
    except CannotListen as exc:
        _say_error(json_logs, f"{name}: {exc}")
        return EXIT_FAILED
    except OSError as exc:
        _say_error(json_logs, f"{name}: cannot listen: {exc}")
        return EXIT_FAILED
    except Exception:
        if not json_logs:
            raise  # Python's traceback, as ever
        # One object with the traceback in "exception", not a traceback's many lines.
        log.critical("%s: stopped by an unexpected error", name, exc_info=True)
        return EXIT_FAILED
    return EXIT_OK


def _banner(json_logs: bool, text: str, **fields: object) -> None:
    """A start-up line tools wait for: in JSON logs one record whose event is ``text``,
    with ``fields``, whatever the log level; otherwise ``text`` printed as it is."""
    if json_logs:
        announce(log, text, **fields)
    else:
        print(text, file=sys.stderr, flush=True)


def _say_error(json_logs: bool, text: str) -> None:
    """Why the server did not start: an error record in JSON logs, else a plain line."""
    if json_logs:
        log.error("%s", text)
    else:
        print(text, file=sys.stderr, flush=True)


def _print_problems(result: LoadResult, json_logs: bool) -> None:
    """boot.xml's problems: errors on standard output as ``check`` prints them; warnings
    on standard error, as records in JSON logs."""
    if not json_logs:
        print_problems(result)
        return
    for problem in result.problems:
        if problem.warning:
            log.warning("%s", problem)
        else:
            print(problem)


@contextlib.contextmanager
def _warnings_logged(json_logs: bool) -> Iterator[None]:
    """In JSON logs, Python's warnings go through logging (logger ``py.warnings``) while
    ``run`` runs, instead of as plain text on standard error; put back on the way out."""
    if not json_logs:
        yield
        return
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)


#: With a console attached, how long Ctrl-C lets in-flight work drain before stopping.
CONSOLE_INTERRUPT_GRACE = 0.5


def _console_targets(topology: Topology) -> list[str]:
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
