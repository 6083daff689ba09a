"""``agentserver stop`` and ``agentserver cancel``: operator commands to a running
server's agents, over the socket."""

from __future__ import annotations

import argparse
import sys

import trio

from agentserver.cli.common import (
    EXIT_CONNECTION,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    Subcommands,
    add_boot_option,
    connection_failure,
    credentials,
    parse_positive,
    tls_options,
    trio_run,
)
from agentserver.core.errors import ConfigurationError
from agentserver.core.threads import is_uuid4


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``stop`` and ``cancel`` subcommands."""
    for verb, summary in (
        ("stop", "end an agent's active task with a failed answer"),
        ("cancel", "cancel an agent's task (queued: skipped; running: stopped)"),
    ):
        command = sub.add_parser(
            verb,
            parents=[common, remote],
            help=summary,
            description=f"{summary[0].upper()}{summary[1:]}, over the socket. Allowed for "
            'clients declared operator="true", and for anonymous loopback connections when '
            "no clients are declared (docs/agents.md, Stop and cancel).",
        )
        add_boot_option(command)
        command.add_argument("agent", metavar="AGENT", help="the agent listener")
        command.add_argument(
            "--thread",
            required=verb == "cancel",
            metavar="T",
            help="the thread the task was sent on"
            + (" (default: whatever task is active)" if verb == "stop" else ""),
        )
        command.add_argument(
            "--timeout", type=parse_positive, default=30.0, metavar="S", help="seconds (default 30)"
        )


def cmd_operator(args: argparse.Namespace) -> int:
    """``stop`` and ``cancel``: one operator command, its ``<outcome>`` printed."""
    from lxml import etree

    from agentserver.core.namespaces import CORE_NS
    from agentserver.net.client import ClientError, RequestTimeout, open_client

    if args.thread is not None and not is_uuid4(args.thread):
        print("--thread must be a lowercase uuid4", file=sys.stderr)
        return EXIT_USAGE
    tls = tls_options(args)
    creds = credentials(args, tls)
    if tls is None or creds is None:
        return EXIT_USAGE
    host, port = args.connect
    command = etree.Element(f"{{{CORE_NS}}}{args.command}", nsmap={None: CORE_NS})
    command.set("agent", args.agent)
    if args.thread is not None:
        command.set("thread", args.thread)

    async def send() -> int:
        async with open_client(host, port, client=creds[0], token=creds[1], **tls) as client:
            thread = await client.send(command)
            with trio.fail_after(args.timeout):
                reply = await client.receive_on(thread)
        sys.stdout.write(reply.raw.decode("utf-8") + "\n")
        if reply.is_error:
            return EXIT_FAILED
        return EXIT_OK if reply.payload.get("count", "0") != "0" else EXIT_FAILED

    try:
        return trio_run(send)
    except (RequestTimeout, trio.TooSlowError):
        print(f"no answer within {args.timeout} s", file=sys.stderr)
        return EXIT_TIMEOUT
    except ConfigurationError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except (ClientError, OSError) as exc:
        print(connection_failure(args, exc), file=sys.stderr)
        return EXIT_CONNECTION
