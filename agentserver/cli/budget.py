"""``agentserver budget show|set|reset``: the spend budgets of a running server, through
its HTTP API (docs/budgets.md)."""

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


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``budget`` subcommand and its actions."""
    budget = sub.add_parser(
        "budget",
        parents=[common],
        help="show, set or reset the spend budgets of a running server",
        description="Read or change the spend budgets (docs/budgets.md) of a running "
        "server through its HTTP API (GET/PUT /v1/budgets/NAME, POST "
        f"/v1/budgets/NAME/reset). The token is read from ${TOKEN_ENV}; set and reset "
        "need an operator's. Budget names: organism, agent:NAME, client:NAME, "
        "client:NAME@agent:NAME. Prints JSON. Exit 4 if unreachable, 1 if refused.",
    )
    budget.add_argument("action", choices=("show", "set", "reset"))
    budget.add_argument("name", nargs="?", metavar="NAME", help="the budget (show: all if none)")
    budget.add_argument("--tokens", type=int, metavar="N", help="set: the token limit")
    budget.add_argument("--cost", type=float, metavar="X", help="set: the cost limit")
    budget.add_argument("--period", choices=("day", "week", "month", "total"))
    budget.add_argument("--soft", metavar="PCT", help="set: e.g. 80%%")
    budget.add_argument("--timezone", metavar="ZONE", help="set: an IANA time zone")
    add_http_api_options(budget)


def cmd_budget(args: argparse.Namespace) -> int:
    import httpx

    base = args.url.rstrip("/")
    if args.action != "show" and not args.name:
        print(f"budget {args.action} needs NAME", file=sys.stderr)
        return EXIT_FAILED
    try:
        with http_api_client(args, 10.0) as client:
            if args.action == "show":
                path = f"/v1/budgets/{args.name}" if args.name else "/v1/budgets"
                response = client.get(base + path)
            elif args.action == "set":
                body: dict[str, Any] = {
                    k: getattr(args, k)
                    for k in ("tokens", "cost", "period", "soft", "timezone")
                    if getattr(args, k) is not None
                }
                response = client.put(f"{base}/v1/budgets/{args.name}", json=body)
            else:
                response = client.post(f"{base}/v1/budgets/{args.name}/reset")
    except httpx.HTTPError as exc:
        print(http_unreachable(args, exc), file=sys.stderr)
        return EXIT_CONNECTION
    if response.status_code != 200:
        print(
            f"budget {args.action} refused ({response.status_code}): {refusal_text(response)}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print(json.dumps(response.json(), indent=2))
    return EXIT_OK
