"""``agentserver fork``: a new conversation from a recorded Turn up to one of its steps,
through a running server's HTTP API (docs/agents.md, "Fork")."""

from __future__ import annotations

import argparse
import json
import sys
import time

from agentserver.cli.common import (
    EXIT_CONNECTION,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    TOKEN_ENV,
    Subcommands,
    add_http_api_options,
    http_api_client,
    http_unreachable,
    parse_positive,
    refusal_text,
)


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``fork`` subcommand."""
    fork = sub.add_parser(
        "fork",
        parents=[common],
        help="continue a recorded Turn from one of its steps as a new conversation",
        description="Ask a running server (POST /v1/agents/AGENT/tasks/THREAD/fork) for a "
        "new conversation with the cards of the Turn of AGENT on THREAD up to step N "
        "copied, continued with a new task (--task) or the original task re-run; the "
        "original is untouched. Prints the fork (its thread and origin) as JSON; with "
        "--wait, then its answer. Needs the HTTP API; the token is read from "
        f"${TOKEN_ENV}. Exit 4 if unreachable, 1 if refused, 3 if --wait times out.",
    )
    fork.add_argument("agent", metavar="AGENT", help="the agent listener")
    fork.add_argument("thread", metavar="THREAD", help="the recorded task's thread")
    fork.add_argument(
        "--at-step", type=int, required=True, metavar="N", help="the last step copied"
    )
    fork.add_argument("--task", metavar="FILE", help="the new task's XML ('-': standard input)")
    add_http_api_options(fork)
    fork.add_argument("--wait", action="store_true", help="wait for the fork's answer")
    fork.add_argument(
        "--timeout",
        type=parse_positive,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait (default: 60)",
    )


def cmd_fork(args: argparse.Namespace) -> int:
    import httpx

    body: dict[str, object] = {"at_step": args.at_step}
    if args.task is not None:
        if args.task == "-":
            body["task"] = sys.stdin.read()
        else:
            with open(args.task, encoding="utf-8") as f:
                body["task"] = f.read()
    base = args.url.rstrip("/")
    try:
        with http_api_client(args, args.timeout) as client:
            response = client.post(
                f"{base}/v1/agents/{args.agent}/tasks/{args.thread}/fork", json=body
            )
            if response.status_code != 202:
                print(
                    f"fork refused ({response.status_code}): {refusal_text(response)}",
                    file=sys.stderr,
                )
                return EXIT_FAILED
            made = response.json()
            print(json.dumps(made))
            if not args.wait:
                return EXIT_OK
            deadline = time.monotonic() + args.timeout
            while time.monotonic() < deadline:
                kept = client.get(f"{base}{made['replies']}")
                if kept.status_code == 200 and kept.json()["replies"]:
                    print(kept.json()["replies"][-1])
                    return EXIT_OK
                time.sleep(0.2)
            print("no answer in time", file=sys.stderr)
            return EXIT_TIMEOUT
    except httpx.HTTPError as exc:
        print(http_unreachable(args, exc), file=sys.stderr)
        return EXIT_CONNECTION
