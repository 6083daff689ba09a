"""``agentserver replay``: re-run a recorded Turn offline and report ``identical`` or its
first divergence (docs/agents.md, "Replay and export")."""

from __future__ import annotations

import argparse
import sys

from agentserver.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Subcommands, trio_run


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``replay`` subcommand."""
    replay = sub.add_parser(
        "replay",
        parents=[common],
        help="re-run a recorded Turn offline and report any divergence",
        description="Re-run the latest Turn of AGENT on THREAD (the caller's thread or the "
        "agent's hop) from the agent store, or the Turn of an export (--from), offline: the "
        "model's recorded outputs are served in order (no LLM is called), tool results "
        "from the record (or the real tools with --live-tools), while policy, guardrails, "
        "loop detection, compaction and step limits run as BOOT configures them now. "
        "Prints 'identical' (exit 0) or the first divergence (exit 1); exit 2 when it "
        "cannot run (no such Turn, an unreadable export). The store is read beside a "
        "running server as 'store stats' reads it.",
    )
    replay.add_argument("agent", metavar="AGENT", nargs="?", help="the agent listener")
    replay.add_argument("thread", metavar="THREAD", nargs="?", help="the task's thread")
    add_store_options(replay)
    replay.add_argument(
        "--from",
        dest="record",
        metavar="FILE",
        help="replay the Turn of this export (agentserver export) instead of the store's",
    )
    replay.add_argument(
        "--live-tools",
        action="store_true",
        help="call the tools (BOOT's in-process listeners) instead of serving recorded results",
    )
    replay.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="how long the replayed Turn may take (default 60)",
    )


def add_store_options(parser: argparse.ArgumentParser) -> None:
    """``--boot`` and ``--store``, shared with ``export``."""
    parser.add_argument(
        "--boot",
        metavar="BOOT",
        help="boot.xml (default: $AGENTSERVER_BOOT, else ./boot.xml)",
    )
    parser.add_argument(
        "--store",
        metavar="PATH|URL",
        help="the agent store: a SQLite file or a postgresql:// URL (default: BOOT's <store>)",
    )


def boot_of(args: argparse.Namespace) -> str:
    """BOOT as main resolved it (``--boot``, else ``$AGENTSERVER_BOOT``, else ./boot.xml)."""
    return str(args.boot)


def cmd_replay(args: argparse.Namespace) -> int:
    from agentserver.agents.errors import AgentError
    from agentserver.agents.replay.record import RecordError, TurnRecord
    from agentserver.app.replay import replay
    from agentserver.config.problems import BootError

    record = None
    try:
        if args.record is not None:
            with open(args.record, encoding="utf-8") as f:
                record = TurnRecord.from_jsonl(f)
        elif args.agent is None or args.thread is None:
            print("replay needs AGENT and THREAD, or --from FILE", file=sys.stderr)
            return EXIT_USAGE
        report = trio_run(
            lambda: replay(
                boot_of(args),
                args.agent,
                args.thread,
                store=args.store,
                record=record,
                live_tools=args.live_tools,
                timeout=args.timeout,
            )
        )
    except (AgentError, BootError, RecordError, OSError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(report)
    return EXIT_OK if report.identical else EXIT_FAILED
