"""``agentserver store stats [BOOT]`` and ``agentserver store prune [BOOT] [--dry-run]``: the
agents' store looked at and pruned by retention by hand (docs/operations.md, "Storage
and retention"), on a stopped server's store or beside a running one."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from agentserver.cli.common import EXIT_OK, EXIT_USAGE, Subcommands, plural, trio_run

if TYPE_CHECKING:
    from agentserver.agents.store.pruner import PruneReport


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``store`` subcommand group."""
    store = sub.add_parser(
        "store",
        parents=[common],
        help="the agents' store: sizes and retention",
        description="Look at the agents' store of BOOT (stats) or apply its <retention> "
        "once (prune). Both work on a stopped server's store and beside a running one.",
    )
    group = store.add_subparsers(dest="store_command", metavar="COMMAND", required=True)
    stats = group.add_parser(
        "stats",
        help="rows and bytes per table, the oldest row, what retention would remove",
        description="Rows and bytes per table, each table's oldest row, the file's size "
        "(SQLite) and what BOOT's retention would remove now (nothing is deleted).",
    )
    prune = group.add_parser(
        "prune",
        help="apply BOOT's retention once (SQLite: freed pages go back to the file)",
        description="Remove what BOOT's <retention> says may go, in small batches, never "
        "what a promise needs (docs/operations.md). SQLite: the freed pages go back to "
        "the file (a file made before retention was on is converted first, which needs "
        "the server stopped). Progress on standard error; the result as lines (--json: "
        "one JSON object).",
    )
    prune.add_argument(
        "--dry-run",
        action="store_true",
        help="report exactly what the prune would remove now, delete nothing (the prune "
        "is run in one transaction and rolled back)",
    )
    for p in (stats, prune):
        p.add_argument(
            "boot",
            nargs="?",
            metavar="BOOT",
            help="the server's boot.xml (default: $AGENTSERVER_BOOT, else ./boot.xml)",
        )
        p.add_argument(
            "--store",
            metavar="PATH|URL",
            help="the agent store: a SQLite file or a postgresql:// URL (default: BOOT's)",
        )
    for p in (stats, prune):
        p.add_argument("--json", action="store_true", help="the figures as one JSON object")


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)


def _print_stats(data: dict) -> None:
    print(f"store: {data['store']} ({data['backend']})")
    if "file_bytes" in data:
        print(f"file (with WAL): {_size(data['file_bytes'])}, auto_vacuum {data['auto_vacuum']}")
    print(f"{'table':<22}{'rows':>10}{'bytes':>12}  oldest row")
    now = time.time()
    for t in data["tables"]:
        age = "" if t["oldest"] is None else f"{(now - t['oldest']) / 86400:.1f} days ago"
        print(f"{t['table']:<22}{t['rows']:>10}{_size(t['bytes']):>12}  {age}")
    would = data["would_remove"]
    if would is None:
        print("retention: none configured (everything is kept)")
    else:
        print(f"retention would remove now: {removed(would)}")


def removed(report: dict) -> str:
    """A prune report (``PruneReport.as_dict``) as words: tasks, rows and rows by kind."""
    rows = {k: v for k, v in report.get("rows", {}).items() if v}
    text = f"{plural(report.get('tasks', 0), 'task')} and {plural(sum(rows.values()), 'row')}"
    if rows:
        text += " (" + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in rows.items()) + ")"
    return text


def _print_prune(out: dict) -> None:
    if out.get("skipped"):
        print("another process is pruning this store now (it holds the prune lease): nothing done")
        return
    if out["dry_run"]:
        print(f"would remove: {removed(out)} (a dry run: nothing was deleted)")
        return
    line = f"removed: {removed(out)}"
    if out.get("pages_freed"):
        line += f"; {plural(out['pages_freed'], 'page')} given back to the file"
    print(line)
    if out.get("file_bytes_before") is not None:
        print(
            f"file (with WAL): {_size(out['file_bytes_before'])} before, "
            f"{_size(out['file_bytes_after'])} after"
        )


def cmd_store(args: argparse.Namespace) -> int:
    from agentserver.agents.errors import AgentError
    from agentserver.app import store_admin
    from agentserver.config.problems import BootError

    try:
        if args.store_command == "stats":
            data = trio_run(lambda: store_admin.stats(args.boot, store=args.store))
            if args.json:
                print(json.dumps(data))
            else:
                _print_stats(data)
            return EXIT_OK
        last = [0.0]

        def progress(report: PruneReport) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.5:  # at most two lines a second
                last[0] = now
                rows = sum(report.rows.values())
                print(
                    f"prune: {plural(report.tasks, 'task')}, {plural(rows, 'row')}, "
                    f"{plural(report.pages, 'page')} freed so far",
                    file=sys.stderr,
                )

        out = trio_run(
            lambda: store_admin.prune(
                args.boot, dry_run=args.dry_run, store=args.store, progress=progress
            )
        )
        for note in out.get("notes", ()):
            print(f"prune: {note}", file=sys.stderr)
        if args.json:
            print(json.dumps(out))
        else:
            _print_prune(out)
        return EXIT_OK
    except (AgentError, BootError, OSError, ValueError) as exc:
        print(f"store: {exc}", file=sys.stderr)
        return EXIT_USAGE
