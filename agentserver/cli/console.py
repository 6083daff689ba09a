"""``agentserver console``: an interactive console on a running server, over the socket."""

from __future__ import annotations

import argparse
import sys

import trio

from agentserver.cli.common import (
    EXIT_CONNECTION,
    EXIT_OK,
    EXIT_USAGE,
    Subcommands,
    add_boot_option,
    cancel_on_signal,
    connection_failure,
    credentials,
    tls_options,
    trio_run,
)
from agentserver.core.errors import ConfigurationError


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``console`` subcommand."""
    console = sub.add_parser(
        "console",
        parents=[common, remote],
        help="talk to a running server",
        description="An interactive console over the socket. Type @NAME <payload .../> to "
        "send a payload to listener NAME, plain text for the default agent, /help, /quit.",
    )
    add_boot_option(console)


def cmd_console(args: argparse.Namespace) -> int:
    from agentserver.console.remote import run_remote_console
    from agentserver.console.terminal import logs_above_prompt, make_terminal
    from agentserver.net.client import ClientError

    tls = tls_options(args)
    creds = credentials(args, tls)
    if tls is None or creds is None:
        return EXIT_USAGE
    host, port = args.connect
    terminal = make_terminal()

    async def console() -> int:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_signal, nursery.cancel_scope)
            status = await run_remote_console(
                host, port, terminal, client=creds[0], token=creds[1], **tls
            )
            nursery.cancel_scope.cancel()
            return status
        return EXIT_OK  # interrupted

    try:
        with logs_above_prompt(terminal):
            status = trio_run(console)
    except ConfigurationError as exc:  # a CA, certificate or key file that cannot be used
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except (ClientError, OSError, trio.TooSlowError) as exc:
        print(connection_failure(args, exc), file=sys.stderr)
        return EXIT_CONNECTION
    return EXIT_CONNECTION if status else EXIT_OK
