"""``agentserver drain``: a running server takes no new work, finishes or hands over what
it holds, and exits 0 (docs/deploy.md, "Deploying with Turns in flight"), through its
HTTP API (``POST /v1/drain``, an operator's only)."""

from __future__ import annotations

import argparse
import sys
import time

from agentserver.cli.common import (
    BOOT_ENV,
    EXIT_CONNECTION,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    TLS_ENV,
    TOKEN_ENV,
    Subcommands,
    http_api_client,
    http_unreachable,
    parse_positive,
    refusal_text,
)

#: How often ``--wait`` asks how the drain goes.
POLL_S = 0.5


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``drain`` subcommand."""
    drain = sub.add_parser(
        "drain",
        parents=[common],
        help="make a running server take no new work, finish what it holds, and exit",
        description="Ask the server of BOOT (its <http>, or --url) to drain: it takes no new "
        "task, runs pinned Turns of its version on, hands upgrade Turns over at their next "
        "step, waits for the tool calls it sent, then exits 0. Needs an operator: a client "
        f'declared operator="true" (its token in ${TOKEN_ENV}), or an anonymous loopback '
        "caller when no client is declared. Exit 4 if the server cannot be reached.",
    )
    drain.add_argument(
        "boot",
        nargs="?",
        metavar="BOOT",
        help=f"the server's boot.xml, whose <http> says where it is (default: ${BOOT_ENV}, "
        "else ./boot.xml)",
    )
    drain.add_argument("--url", metavar="URL", help="the HTTP API (default: the <http> of BOOT)")
    drain.add_argument(
        "--ca",
        metavar="FILE",
        help=f"CA certificate(s) (PEM) to verify an https URL with (default: ${TLS_ENV['ca']})",
    )
    drain.add_argument(
        "--wait",
        action="store_true",
        help="wait until the server has drained and exited, showing what it still holds",
    )
    drain.add_argument(
        "--timeout",
        type=parse_positive,
        default=None,
        metavar="SECONDS",
        help="with --wait: give up waiting after this long (exit 3; the server drains on)",
    )


def cmd_drain(args: argparse.Namespace) -> int:
    import httpx

    base = args.url.rstrip("/")
    try:
        with http_api_client(args, 10.0) as client:
            response = client.post(base + "/v1/drain")
            if response.status_code != 202:
                print(
                    f"{base}/v1/drain: {response.status_code} {refusal_text(response)}",
                    file=sys.stderr,
                )
                return EXIT_FAILED
            state = response.json()
            print(f"draining {base}: {_holding(state)}")
            if not args.wait:
                return EXIT_OK
            deadline = None if args.timeout is None else time.monotonic() + args.timeout
            shown = _holding(state)
            while True:
                if deadline is not None and time.monotonic() > deadline:
                    print(f"still draining after {args.timeout:g}s: {shown}", file=sys.stderr)
                    return EXIT_TIMEOUT
                time.sleep(POLL_S)
                try:
                    response = client.get(base + "/v1/drain")
                except httpx.HTTPError:
                    break  # the server has gone: it drained and exited
                if response.status_code != 200:
                    break  # shutting down (its routes close before it exits)
                state = response.json()
                now = _holding(state)
                if now != shown:
                    print(f"draining: {now}")
                    shown = now
    except httpx.HTTPError as exc:
        print(http_unreachable(args, exc), file=sys.stderr)
        return EXIT_CONNECTION
    print("drained: the server has exited")
    return EXIT_OK


def _holding(state: dict) -> str:
    if state.get("done"):
        return "nothing held, shutting down"
    held = state.get("holding") or {}
    return f"{held.get('turns', 0)} turn(s) running, {held.get('tool_calls', 0)} tool call(s) out"
