"""``agentserver export``: a recorded Turn as self-contained JSON Lines on standard output
(docs/agents.md, "Replay and export")."""

from __future__ import annotations

import argparse
import sys

from agentserver.cli.common import EXIT_OK, EXIT_USAGE, Subcommands, trio_run
from agentserver.cli.replay import add_store_options, boot_of


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``export`` subcommand."""
    export = sub.add_parser(
        "export",
        parents=[common],
        help="write a recorded Turn as JSON Lines (for replay --from)",
        description="Write the latest Turn of AGENT on THREAD from the agent store as JSON "
        "Lines on standard output: its task, every step (model input summary and output), "
        "tool calls and results, decisions and answer; 'agentserver replay --from FILE' "
        "replays it without the store. Exit 2 when there is no such Turn.",
    )
    export.add_argument("agent", metavar="AGENT", help="the agent listener")
    export.add_argument("thread", metavar="THREAD", help="the task's thread")
    add_store_options(export)


def cmd_export(args: argparse.Namespace) -> int:
    from agentserver.agents.errors import AgentError
    from agentserver.app.replay import read_record
    from agentserver.config.problems import BootError

    try:
        record = trio_run(
            lambda: read_record(boot_of(args), args.agent, args.thread, store=args.store)
        )
    except (AgentError, BootError, OSError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.write(record.to_jsonl())
    return EXIT_OK
