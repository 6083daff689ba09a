"""``agentserver runner``: serve a server's remote listener with a Python handler."""

from __future__ import annotations

import argparse
import os
import sys

import trio

from agentserver.cli.common import (
    EXIT_CONNECTION,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    TOKEN_ENV,
    Subcommands,
    cancel_on_signal,
    tls_options,
    trio_run,
)
from agentserver.config.imports import resolve_import
from agentserver.core.errors import ConfigurationError


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``runner`` subcommand."""
    runner = sub.add_parser(
        "runner",
        parents=[common, remote],
        help="serve a remote listener with a Python handler",
        description="Connect to a server as a runner (a client declared with serves=...), "
        "announce <serve>, and run HANDLER on every job of LISTENER (docs/wire.md, Runners).",
    )
    runner.add_argument(
        "--token-env",
        metavar="VAR",
        default=TOKEN_ENV,
        help=f"environment variable holding the client's token (default: {TOKEN_ENV})",
    )
    runner.add_argument("--listener", required=True, metavar="NAME", help="remote listener")
    runner.add_argument(
        "--handler", required=True, metavar="MOD:FUNC", help="async handler(payload, meta)"
    )
    runner.add_argument(
        "--concurrency", type=int, default=4, metavar="N", help="jobs at once (default: 4)"
    )


def cmd_runner(args: argparse.Namespace) -> int:
    from agentserver.net.client import ClientError
    from agentserver.remote.runner import RunnerRefused, run_runner

    # The command line the docs show names no client: a runner of LISTENER is, by
    # default, the client LISTENER-runner (declare it with serves="LISTENER").
    client = args.client or f"{args.listener}-runner"
    tls = tls_options(args)
    if tls is None:
        return EXIT_USAGE
    token = os.environ.get(args.token_env)
    if not token and not tls.get("cert"):
        print(
            f"runner needs the token in ${args.token_env} (or a client certificate: --cert)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not 1 <= args.concurrency <= 1024:
        print("--concurrency must be 1..1024", file=sys.stderr)
        return EXIT_USAGE
    try:
        handler = resolve_import(args.handler)
    except Exception as exc:
        print(f"--handler {args.handler}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    host, port = args.connect
    from agentserver.observability.tracing import Tracing

    # The same OTEL_* switches as the server's: each job's span joins the caller's trace.
    tracing = Tracing.from_environ(os.environ)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_signal, nursery.cancel_scope)
            await run_runner(
                host,
                port,
                client=client,
                # With a client certificate the hello's token is not checked.
                token=token or "",
                listener=args.listener,
                handler=handler,
                concurrency=args.concurrency,
                tracer_provider=tracing.provider,
                **tls,
            )
            nursery.cancel_scope.cancel()

    try:
        trio_run(serve)
    except RunnerRefused as exc:
        print(f"the server refused this runner: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ConfigurationError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except (ClientError, OSError, trio.TooSlowError) as exc:
        print(f"cannot talk to {host}:{port}: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    finally:
        tracing.shutdown()  # flush the spans of the last jobs
    return EXIT_OK
