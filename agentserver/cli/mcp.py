"""``agentserver mcp``: a running server's exposed listeners and agents (``<expose-mcp>``)
as an MCP server on standard input and output, for MCP clients that start their servers
as commands (Claude Desktop, Claude Code, Cursor, ...; docs/mcp.md).

It reads BOOT for what to offer and the payloads' schemas, connects to the server (where
BOOT's ``<listen>`` says, unless ``--connect`` or ``$AGENTSERVER_HOST``/``PORT`` say
otherwise; ``--client`` and TLS as for ``send``) and relays each tool call as one message on
a thread of its own. Standard output carries the protocol only; logs go to standard error.
"""

from __future__ import annotations

import argparse
import sys

import trio
from lxml import etree

from agentserver.cli.common import (
    EXIT_CONNECTION,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Subcommands,
    connect_address,
    connection_failure,
    credentials,
    parse_positive,
    tls_options,
)


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``mcp`` subcommand."""
    mcp = sub.add_parser(
        "mcp",
        parents=[common, remote],
        help="serve the exposed listeners and agents to an MCP client over stdio",
        description="Serve the listeners and agents BOOT's <expose-mcp> names as MCP tools on "
        "standard input and output (one line in an MCP client's configuration), each call "
        "sent to the running server as one message (at BOOT's <listen> address unless "
        "--connect or $AGENTSERVER_HOST/$AGENTSERVER_PORT say otherwise). Exits when the client "
        "closes standard input.",
    )
    mcp.add_argument(
        "boot",
        nargs="?",
        metavar="BOOT",
        help="the boot.xml of the server (default: $AGENTSERVER_BOOT, else ./boot.xml)",
    )
    mcp.add_argument(
        "--timeout",
        type=parse_positive,
        default=600.0,
        metavar="SECONDS",
        help="how long one call waits for its reply (default: 600)",
    )


class ClientSender:
    """Sends each call through one socket client (its own thread per call)."""

    def __init__(self, client: object, timeout: float) -> None:
        self.client = client
        self.timeout = timeout

    async def __call__(
        self, listener: str, payload: etree._Element, identity: object
    ) -> etree._Element:
        from agentserver.http.mcp_expose import SendFailed
        from agentserver.net.client import ClientError

        try:
            reply = await self.client.request(payload, to=listener, timeout=self.timeout)  # type: ignore[attr-defined]
        except ClientError as exc:
            raise SendFailed(str(exc)) from None
        return reply.payload


def cmd_mcp(args: argparse.Namespace) -> int:
    from agentserver import package_version
    from agentserver.config import loader as boot
    from agentserver.config.mcp import exposed_tools
    from agentserver.http.mcp_expose import build_server, serve_stdio
    from agentserver.net.client import ClientError, open_client

    result = boot.load(args.boot)
    if result.topology is None:
        # (problems to standard error: standard output is the protocol's)
        for problem in result.problems:
            print(problem, file=sys.stderr)
        return EXIT_FAILED
    topology = result.topology
    tools = exposed_tools(topology)
    if not tools:
        print(f"{args.boot}: <expose-mcp> offers nothing", file=sys.stderr)
        return EXIT_USAGE
    tls = tls_options(args)
    creds = credentials(args, tls)
    if tls is None or creds is None:
        return EXIT_USAGE
    try:
        host, port = connect_address(args, (topology.host, topology.port))
    except argparse.ArgumentTypeError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    args.connect = (host, port)

    async def serve() -> int:
        async with open_client(host, port, client=creds[0], token=creds[1], **tls) as client:
            server = build_server(
                tools,
                ClientSender(client, args.timeout),
                name=topology.organism,
                version=package_version(),
            )
            await serve_stdio(server)
        return EXIT_OK

    try:
        return trio.run(serve)
    except (ClientError, OSError) as exc:
        print(connection_failure(args, exc), file=sys.stderr)
        return EXIT_CONNECTION
