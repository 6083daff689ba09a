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
    add_boot_option,
    cancel_on_signal,
    tls_options,
    trio_run,
)
from agentserver.config.imports import resolve_import
from agentserver.core.errors import ConfigurationError

#: --reconnect's backoff: the first wait after a lost connection, and its cap.
RECONNECT_FIRST_S = 0.5
RECONNECT_MAX_S = 30.0


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
    add_boot_option(runner)
    runner.add_argument("--listener", required=True, metavar="NAME", help="remote listener")
    runner.add_argument(
        "--handler", required=True, metavar="MOD:FUNC", help="async handler(payload, meta)"
    )
    runner.add_argument(
        "--concurrency", type=int, default=4, metavar="N", help="jobs at once (default: 4)"
    )
    runner.add_argument(
        "--reconnect",
        action="store_true",
        help="keep serving across lost connections and server restarts: reconnect with "
        f"backoff ({RECONNECT_FIRST_S:g} s doubling to {RECONNECT_MAX_S:g} s), resuming the "
        "TLS session; a refusal still exits",
    )


def cmd_runner(args: argparse.Namespace) -> int:
    from agentserver.net.client import ClientError, TlsSessions
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

    # One TLS session store for every connection of this process: a reconnect resumes.
    sessions = TlsSessions() if tls else None

    async def serve_once() -> None:
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
            sessions=sessions,
            **tls,
        )

    async def serve_forever() -> None:
        """Reconnects until cancelled (a signal) or refused. Bounded: one connection at a
        time; the wait doubles per failed attempt up to RECONNECT_MAX_S and starts over
        once a connection has served."""
        wait = RECONNECT_FIRST_S
        while True:
            try:
                await serve_once()
                why = "the server closed the connection"
                wait = RECONNECT_FIRST_S
            except (ClientError, OSError, trio.TooSlowError) as exc:
                why = f"cannot talk to {host}:{port}: {exc}"
            resumed = (
                ""
                if sessions is None
                else f" (TLS sessions: {sessions.full} full, {sessions.resumed} resumed)"
            )
            print(f"{why}; reconnecting in {wait:g} s{resumed}", file=sys.stderr, flush=True)
            await trio.sleep(wait)
            wait = min(wait * 2, RECONNECT_MAX_S)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_signal, nursery.cancel_scope)
            await (serve_forever() if args.reconnect else serve_once())
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
