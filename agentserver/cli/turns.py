"""``agentserver turns migrate``: the active Turns of an agent begun on an old version,
moved to the version BOOT defines now (docs/deploy.md, "Deploying with Turns in flight")."""

from __future__ import annotations

import argparse
import json
import sys

from agentserver.cli.common import EXIT_FAILED, EXIT_OK, Subcommands, trio_run


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``turns`` subcommand group."""
    turns = sub.add_parser(
        "turns",
        parents=[common],
        help="the agents' Turns across versions",
        description="Work on the agents' Turns in the store of BOOT, on a stopped server's "
        "store or beside a running one (docs/deploy.md).",
    )
    group = turns.add_subparsers(dest="turns_command", metavar="COMMAND", required=True)
    migrate = group.add_parser(
        "migrate",
        help="move an agent's Turns begun on VERSION to BOOT's current version",
        description="Move the active Turns of AGENT begun on version VERSION (a pinned Turn "
        "waits for a process of its version) to the version BOOT defines now: each "
        "continues there at its next step, as an upgrade Turn would. A tool call to a "
        "tool the new version lacks is answered to the model as a failed result naming "
        "the change. Prints the Turns moved.",
    )
    migrate.add_argument("agent", metavar="AGENT", help="the agent listener")
    migrate.add_argument(
        "--from",
        dest="from_version",
        required=True,
        metavar="VERSION",
        help="the version the Turns began on (as status and GET /v1/agents show it)",
    )
    migrate.add_argument(
        "boot",
        nargs="?",
        metavar="BOOT",
        help="the server's boot.xml, whose version of AGENT is the target (default: "
        "$AGENTSERVER_BOOT, else ./boot.xml)",
    )
    migrate.add_argument(
        "--store",
        metavar="PATH|URL",
        help="the agent store: a SQLite file or a postgresql:// URL (default: BOOT's)",
    )
    migrate.add_argument("--json", action="store_true", help="the result as one JSON object")


def cmd_turns(args: argparse.Namespace) -> int:
    from agentserver.agents.errors import AgentError
    from agentserver.app import store_admin
    from agentserver.config.loader import BootError

    try:
        out = trio_run(
            lambda: store_admin.migrate_turns(
                args.boot, args.agent, args.from_version, store=args.store
            )
        )
    except (BootError, AgentError, ValueError) as exc:
        print(f"agentserver turns migrate: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return EXIT_OK
    moved = out["turns"]
    if not moved:
        print(f"no active Turn of {out['agent']} is on version {out['from']}")
    for turn in moved:
        print(f"{out['agent']}: turn {turn}: version {out['from']} -> {out['to']}")
    return EXIT_OK
