"""``agentserver schedule add|list|pause|resume|trigger|delete``: runs on a schedule,
through a running server's HTTP API (``/v1/schedules``, docs/runs.md)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agentserver.cli.common import (
    EXIT_CONNECTION,
    EXIT_FAILED,
    EXIT_OK,
    TOKEN_ENV,
    Subcommands,
    add_http_api_options,
    http_api_client,
    http_unreachable,
    refusal_text,
)

TIMEOUT = 30.0
OVERLAPS = ("skip", "buffer-one", "buffer-all", "cancel-other", "allow")


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``schedule`` subcommand and its verbs."""
    schedule = sub.add_parser(
        "schedule",
        parents=[common],
        help="make, list, pause, resume, trigger and delete runs on a schedule",
        description="Runs on a schedule (docs/runs.md), through a running server's HTTP "
        "API (/v1/schedules): each tick of a cron expression sends a task to an agent, "
        "exactly once across restarts and processes. Schedules declared in boot.xml "
        "(<schedules>) are listed and can be paused too. The token is read from "
        f"${TOKEN_ENV}. Exit 4 if the server is unreachable, 1 if it refused.",
    )
    verbs = schedule.add_subparsers(dest="verb", required=True, metavar="VERB")
    add = verbs.add_parser(
        "add",
        help="make a schedule",
        description="Make schedule NAME: AGENT gets the task (XML, from --task FILE or "
        "'-' for standard input) at each tick of CRON (cronsim: five fields, or six with "
        "seconds first) in --timezone.",
    )
    add.add_argument("name", metavar="NAME")
    add.add_argument("agent", metavar="AGENT", help="the agent listener")
    add.add_argument("cron", metavar="CRON", help="e.g. '0 9 * * mon-fri' or '*/10 * * * * *'")
    add.add_argument("--task", required=True, metavar="FILE", help="the task's XML ('-': stdin)")
    add.add_argument("--timezone", default="UTC", help="an IANA time zone (default: UTC)")
    add.add_argument(
        "--overlap",
        choices=OVERLAPS,
        default="skip",
        help="when the previous run has not ended (default: skip)",
    )
    add.add_argument(
        "--catchup-window",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a tick missed while down by at most this much still fires (default: 60)",
    )
    add.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="start each tick up to this much later (default: 0)",
    )
    verbs.add_parser("list", help="list schedules: next fire times and last outcome")
    for verb, text in (
        ("pause", "pause a schedule (its ticks pass, none fire)"),
        ("resume", "resume a schedule from its next tick"),
        ("trigger", "start a run now (its overlap applies)"),
        ("delete", "delete a schedule"),
    ):
        one = verbs.add_parser(verb, help=text, description=text[0].upper() + text[1:] + ".")
        one.add_argument("name", metavar="NAME")
    for parser in verbs.choices.values():
        add_http_api_options(parser)


def _line(view: dict[str, Any]) -> str:
    state = "paused" if view["paused"] else "next " + (", ".join(view["next"]) or "-")
    return (
        f"{view['name']}  {view['agent']}  {view['cron']!r} {view['timezone']}  "
        f"overlap={view['overlap']}  {state}  last: {view['last_outcome'] or '-'}"
        f" ({view['fired']} fired, {view['skipped']} skipped)"
    )


def cmd_schedule(args: argparse.Namespace) -> int:
    import httpx

    base = args.url.rstrip("/") + "/v1/schedules"
    try:
        with http_api_client(args, TIMEOUT) as client:
            if args.verb == "list":
                response = client.get(base)
            elif args.verb == "add":
                if args.task == "-":
                    task = sys.stdin.read()
                else:
                    with open(args.task, encoding="utf-8") as f:
                        task = f.read()
                response = client.post(
                    base,
                    json={
                        "name": args.name,
                        "agent": args.agent,
                        "cron": args.cron,
                        "task": task,
                        "timezone": args.timezone,
                        "overlap": args.overlap,
                        "catchup_window": args.catchup_window,
                        "jitter": args.jitter,
                    },
                )
            elif args.verb == "delete":
                response = client.delete(f"{base}/{args.name}")
            else:
                response = client.post(f"{base}/{args.name}/{args.verb}")
    except httpx.HTTPError as exc:
        print(http_unreachable(args, exc), file=sys.stderr)
        return EXIT_CONNECTION
    except OSError as exc:
        print(f"cannot read the task: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if response.status_code >= 400:
        print(
            f"schedule {args.verb} refused ({response.status_code}): {refusal_text(response)}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if args.verb == "list":
        for view in response.json()["schedules"]:
            print(_line(view))
    elif response.status_code != 204:
        data = response.json()
        print(_line(data) if "cron" in data else json.dumps(data))
    return EXIT_OK
