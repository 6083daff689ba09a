"""The ``agentserver`` command: run, send, check, console, schemas, status.

Exit statuses: 0 success; 1 a problem with the topology or the request (boot.xml errors,
a ``<huh>`` or ``<SystemError>`` reply, or a reply marked ``status="failed"``); 2 bad usage or input; 3 no reply in time;
4 cannot connect, or the connection was lost.

This module holds the entry point (:func:`main`) and the top-level parser; each command
group is a module of this package that adds its own subcommands (``add_parsers``) and
runs them (``cmd_*``): :mod:`~agentserver.cli.run`, :mod:`~agentserver.cli.send`,
:mod:`~agentserver.cli.check` (check, schemas), :mod:`~agentserver.cli.status`,
:mod:`~agentserver.cli.runner`, :mod:`~agentserver.cli.operator` (stop, cancel),
:mod:`~agentserver.cli.console`; what they share is :mod:`~agentserver.cli.common`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from agentserver.cli import (
    budget,
    check,
    console,
    drain,
    export,
    fork,
    mcp,
    operator,
    replay,
    result,
    run,
    runner,
    schedule,
    send,
    status,
    store,
    turns,
)
from agentserver.cli.common import (
    BOOT_ENV,
    EXIT_USAGE,
    HOST_ENV,
    LEVELS,
    LOG_LEVEL_ENV,
    PORT_ENV,
    parse_port,
    shared_options,
)
from agentserver.cli.project import apply_project, find_boot, no_boot_message
from agentserver.observability.logs import LOG_FORMATS, configure_logging


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
    common, remote = shared_options(levels, level_help, format_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # In this order in --help.
    run.add_parsers(sub, common, remote)
    send.add_parsers(sub, common, remote)
    result.add_parsers(sub, common, remote)
    check.add_parsers(sub, common, remote)
    status.add_parsers(sub, common, remote)
    runner.add_parsers(sub, common, remote)
    operator.add_parsers(sub, common, remote)
    console.add_parsers(sub, common, remote)
    mcp.add_parsers(sub, common, remote)
    replay.add_parsers(sub, common, remote)
    export.add_parsers(sub, common, remote)
    fork.add_parsers(sub, common, remote)
    store.add_parsers(sub, common, remote)
    budget.add_parsers(sub, common, remote)
    schedule.add_parsers(sub, common, remote)
    drain.add_parsers(sub, common, remote)
    turns.add_parsers(sub, common, remote)
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
    # The format in use from here on (the default resolved): ``run`` writes its start-up
    # lines in it.
    args.log_format = configure_logging(level, args.log_format, sys.stderr)
    handler = {
        "run": run.cmd_run,
        "send": send.cmd_send,
        "result": result.cmd_result,
        "check": check.cmd_check,
        "console": console.cmd_console,
        "schemas": check.cmd_schemas,
        "status": status.cmd_status,
        "runner": runner.cmd_runner,
        "stop": operator.cmd_operator,
        "cancel": operator.cmd_operator,
        "mcp": mcp.cmd_mcp,
        "replay": replay.cmd_replay,
        "export": export.cmd_export,
        "fork": fork.cmd_fork,
        "store": store.cmd_store,
        "budget": budget.cmd_budget,
        "schedule": schedule.cmd_schedule,
        "drain": drain.cmd_drain,
        "turns": turns.cmd_turns,
    }
    return handler[args.command](args)


#: The commands that load a topology: BOOT defaults to $AGENTSERVER_BOOT, else ./boot.xml
#: (``run`` falls back to the bundled one instead of failing).
NEEDS_BOOT = ("check", "schemas", "store", "export", "replay", "mcp", "turns")


def _apply_environment(args: argparse.Namespace) -> None:
    """Fill the options left unset from AGENTSERVER_HOST/PORT/BOOT and the project's
    boot.xml. Raises ArgumentTypeError for a variable that is not a valid value, a
    command that needs a topology and finds none, or a project that cannot be read."""
    env = os.environ
    host = env.get(HOST_ENV, "").strip() or None
    port_text = env.get(PORT_ENV, "").strip() or None
    try:
        port = parse_port(port_text) if port_text is not None else None
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"${PORT_ENV}: {exc}") from None
    if args.command == "run":
        args.boot = args.boot or env.get(BOOT_ENV, "").strip() or None
        args.host = args.host or host
        args.port = args.port if args.port is not None else port
        return
    if args.command in NEEDS_BOOT:
        args.boot = find_boot(args.boot, env)
        if args.boot is None:
            raise argparse.ArgumentTypeError(no_boot_message(args.command))
        # (mcp loads BOOT whole and connects where its <listen> says: cli/mcp.py; check's
        # --connect is a switch, not an address)
        return
    if hasattr(args, "connect") or hasattr(args, "url"):
        apply_project(args, env)
