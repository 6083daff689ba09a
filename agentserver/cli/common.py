"""What the ``agentserver`` commands share: exit statuses, environment variable names,
option types, the options of every command and of those that talk to a running server,
and the helpers that turn those options into connection arguments."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import trio

from agentserver.config.topology import DEFAULT_HTTP_PORT, DEFAULT_PORT
from agentserver.core.errors import sole_exception
from agentserver.observability.logs import LOG_FORMATS

if TYPE_CHECKING:
    import httpx

    from agentserver.config.problems import LoadResult

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_CONNECTION = 4
#: Interrupted by a signal (Ctrl-C), as a shell reports it (128 + SIGINT).
EXIT_INTERRUPTED = 130
DEFAULT_CONNECT = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_HTTP_URL = f"http://127.0.0.1:{DEFAULT_HTTP_PORT}"
HTTP_URL_ENV = "AGENTSERVER_HTTP_URL"
TOKEN_ENV = "AGENTSERVER_TOKEN"
#: Environment alternatives to --ca, --cert and --key.
TLS_ENV = {"ca": "AGENTSERVER_CA", "cert": "AGENTSERVER_CERT", "key": "AGENTSERVER_KEY"}
BUNDLED_NAME = "<bundled boot.xml>"
#: Defaults from the environment (a container sets these); a command-line option wins.
HOST_ENV = "AGENTSERVER_HOST"
PORT_ENV = "AGENTSERVER_PORT"
BOOT_ENV = "AGENTSERVER_BOOT"
LOG_LEVEL_ENV = "AGENTSERVER_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")

T = TypeVar("T")


class Subcommands(Protocol):
    """Where a command module adds its subcommands (argparse's subparsers action), with the
    keywords the commands pass."""

    def add_parser(
        self,
        name: str,
        *,
        help: str | None = ...,
        description: str | None = ...,
        parents: Sequence[argparse.ArgumentParser] = ...,
    ) -> argparse.ArgumentParser: ...


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 client``, ``2 clients`` (``many``: an irregular plural)."""
    return f"{count:,} {word if count == 1 else (many or word + 's')}"


def parse_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def parse_port(value: str) -> int:
    if not value.isdigit() or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number (0-65535)")
    return int(value)


def parse_positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return number


def shared_options(
    levels: list[str], level_help: str, format_help: str
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The parent parsers: ``common`` (every command: the log options again, after the
    command) and ``remote`` (the commands that talk to a running server)."""
    # Also accepted after the command; SUPPRESS keeps a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", choices=levels, default=argparse.SUPPRESS, help=level_help)
    common.add_argument(
        "--log-format", choices=LOG_FORMATS, default=argparse.SUPPRESS, help=format_help
    )
    # What the commands that talk to a running server share.
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument(
        "--connect",
        type=parse_address,
        metavar="HOST:PORT",
        help=f"server address (default: ${HOST_ENV}:${PORT_ENV}, each else the <listen> of "
        f"the project's boot.xml, else {DEFAULT_CONNECT})",
    )
    remote.add_argument(
        "--client",
        metavar="NAME",
        help=f"client name for the hello; the token is read from ${TOKEN_ENV} (not needed "
        "with a client certificate)",
    )
    remote.add_argument(
        "--tls",
        action="store_true",
        help="connect with TLS, verifying the server's certificate and name (implied by "
        "--ca, --cert, --key and their variables)",
    )
    remote.add_argument(
        "--ca",
        metavar="FILE",
        help=f"CA certificate(s) (PEM) to verify the server with, instead of the system's "
        f"(default: ${TLS_ENV['ca']})",
    )
    remote.add_argument(
        "--cert",
        metavar="FILE",
        help=f"client certificate (PEM) for mutual TLS (default: ${TLS_ENV['cert']})",
    )
    remote.add_argument(
        "--key",
        metavar="FILE",
        help=f"its private key (PEM; default: ${TLS_ENV['key']}, else in the --cert file)",
    )
    return common, remote


#: A wildcard listening host, and the loopback address a client on this machine uses for it.
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def connect_address(
    args: argparse.Namespace, listen: tuple[str, int] | None = None
) -> tuple[str, int]:
    """Where a command that talks to the server connects: ``--connect``; else
    ``$AGENTSERVER_HOST`` and ``$AGENTSERVER_PORT``, each on its own; else, for a command
    given BOOT, the ``<listen>`` address BOOT declares (``listen``: its host and port; a
    wildcard host is reached on loopback); else :data:`DEFAULT_CONNECT`. Raises
    ArgumentTypeError for a ``$AGENTSERVER_PORT`` that is no port, or a port 0 (no
    address to connect to)."""
    if args.connect is not None:
        return args.connect
    env = os.environ
    host = env.get(HOST_ENV, "").strip() or None
    port_text = env.get(PORT_ENV, "").strip() or None
    try:
        port = parse_port(port_text) if port_text is not None else None
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"${PORT_ENV}: {exc}") from None
    if port == 0:
        raise argparse.ArgumentTypeError(f"${PORT_ENV}=0 is no address to connect to")
    if listen is not None:
        listen_host, listen_port = listen
        default_host = WILDCARDS.get(listen_host, listen_host)
        if port is None and listen_port == 0:
            raise argparse.ArgumentTypeError(
                "BOOT listens on port 0 (any free one): give --connect HOST:PORT"
            )
        default_port = listen_port
    else:
        default_host, default_port = parse_address(DEFAULT_CONNECT)
    return host or default_host, port or default_port


def connection_failure(args: argparse.Namespace, exc: BaseException) -> str:
    """The line a client command prints when its connection failed or was lost: the
    server's refusal of a missing or wrong token says what to pass, anything else names
    the address."""
    from agentserver.net.reply import AuthenticationRefused

    if isinstance(exc, AuthenticationRefused):
        if getattr(args, "client", None) is None:
            return f"authentication required: pass --client NAME and set {TOKEN_ENV}"
        return (
            f"authentication refused for client {args.client!r}: check ${TOKEN_ENV} (the "
            "token of that client in the server's boot.xml)"
        )
    host, port = args.connect
    return f"cannot talk to {host}:{port}: {exc}"


def trio_run(fn: Callable[[], Awaitable[T]]) -> T:
    """``trio.run(fn)``, re-raising a nursery's sole exception as itself (callers catch
    ClientError and OSError, not groups of one)."""
    try:
        return trio.run(fn)
    except BaseExceptionGroup as group:
        raise sole_exception(group) from None


def print_problems(result: LoadResult) -> None:
    for problem in result.problems:
        print(problem, file=sys.stderr if problem.warning else sys.stdout)


def tls_options(args: argparse.Namespace) -> dict | None:
    """open_client's TLS arguments from --tls/--ca/--cert/--key (each file option falls
    back to its variable in TLS_ENV); None on a usage error (printed)."""
    files = {
        name: getattr(args, name) or os.environ.get(env) or None for name, env in TLS_ENV.items()
    }
    if files["key"] is not None and files["cert"] is None:
        print(f"--key needs --cert (or ${TLS_ENV['cert']})", file=sys.stderr)
        return None
    if not args.tls and not any(files.values()):
        return {}
    return {"tls": True, **files}


def credentials(
    args: argparse.Namespace, tls: dict | None = None
) -> tuple[str | None, str | None] | None:
    if args.client is None:
        return None, None
    token = os.environ.get(TOKEN_ENV)
    if not token and tls and tls.get("cert"):
        return args.client, None  # the client certificate says who this is
    if not token:
        print(f"--client needs the token in ${TOKEN_ENV}", file=sys.stderr)
        return None
    return args.client, token


async def cancel_on_signal(scope: trio.CancelScope) -> None:
    """Cancel ``scope`` at the first SIGINT or SIGTERM (a client command's Ctrl-C)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        async for _ in received:
            scope.cancel()
            return


def add_boot_option(parser: argparse.ArgumentParser) -> None:
    """``--boot``: the project's boot.xml, whose addresses a client command connects to."""
    parser.add_argument(
        "--boot",
        metavar="BOOT",
        help=f"the project's boot.xml, whose <listen> and <http> say where the server is "
        f"(default: ${BOOT_ENV}, else ./boot.xml; none: {DEFAULT_CONNECT} and "
        f"{DEFAULT_HTTP_URL})",
    )


def add_http_api_options(parser: argparse.ArgumentParser) -> None:
    """``--url``, ``--ca`` and ``--boot``: the commands that talk to a running server's
    HTTP API."""
    parser.add_argument(
        "--url",
        metavar="URL",
        help=f"the HTTP API (default: ${HTTP_URL_ENV}, else the <http> of the project's "
        f"boot.xml, else {DEFAULT_HTTP_URL})",
    )
    add_boot_option(parser)
    parser.add_argument(
        "--ca",
        metavar="FILE",
        help=f"CA certificate(s) (PEM) to verify an https URL with (default: ${TLS_ENV['ca']}, "
        "else the system's)",
    )


def http_unreachable(args: argparse.Namespace, exc: BaseException) -> str:
    """The line an HTTP command prints when the API does not answer; when the address
    is today's default because the project's boot.xml declares no ``<http>``, says so."""
    text = f"cannot reach the HTTP API at {args.url}: {exc}"
    project = getattr(args, "project", None)
    if getattr(args, "url_from", None) == "default" and project is not None:
        text += f" ({project.boot} declares no <http>: add one, or give --url)"
    return text


def refusal_text(response: httpx.Response) -> str:
    """What an HTTP API refusal says: its problem's title (RFC 9457), else its body; for a
    refused token, what to set."""
    try:
        doc = response.json()
    except ValueError:
        doc = None
    text = str(doc["title"]) if isinstance(doc, dict) and doc.get("title") else response.text[:500]
    if response.status_code == 401:
        text += f" (set {TOKEN_ENV} to the token of a client declared in the server's boot.xml)"
    return text


def http_api_client(args: argparse.Namespace, timeout: float) -> httpx.Client:
    """An HTTP client for ``args.url``: the bearer token from ``$AGENTSERVER_TOKEN`` (if
    set) on every request, an https URL verified with ``--ca`` (else ``$AGENTSERVER_CA``,
    else the system's CAs)."""
    import httpx

    token = os.environ.get(TOKEN_ENV)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    ca = args.ca or os.environ.get(TLS_ENV["ca"])
    return httpx.Client(verify=ca or True, timeout=timeout, headers=headers)
