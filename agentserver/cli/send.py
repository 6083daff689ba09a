"""``agentserver send``: one payload to a running server, its replies printed."""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
from typing import TYPE_CHECKING

import trio

from agentserver.cli.common import (
    EXIT_CONNECTION,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    Subcommands,
    add_boot_option,
    cancel_on_signal,
    connection_failure,
    credentials,
    parse_positive,
    tls_options,
    trio_run,
)
from agentserver.core.envelope import MULTITASK_MODES
from agentserver.core.errors import ConfigurationError, HuhReason, InputRefused
from agentserver.core.threads import is_uuid4, new_thread_id
from agentserver.core.xmlsafe import DEFAULT_MAX_MESSAGE_BYTES

if TYPE_CHECKING:
    from agentserver.net.client import Reply


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``send`` subcommand."""
    send = sub.add_parser(
        "send",
        parents=[common, remote],
        help="send one payload and print the reply",
        description="Send one payload (an XML element: given as the argument, or read from "
        "FILE or standard input) and print the reply envelope(s) of its thread. Without "
        "--to, the payload's root tag picks the listener. The text of a <huh> or "
        "<SystemError> reply is also printed on standard error. Exit 1 if a reply is a "
        '<huh> or <SystemError> or is marked status="failed" (e.g. an agent\'s failed '
        "<answer>), 3 if none comes in time, 4 if the server is unreachable.",
    )
    send.add_argument(
        "file",
        nargs="?",
        default="-",
        metavar="PAYLOAD|FILE",
        help="the payload itself (an argument starting with '<'), a payload file, or - for "
        "standard input (default)",
    )
    add_boot_option(send)
    send.add_argument(
        "--to",
        metavar="NAME",
        help="listener to address (default: the one registered for the payload's root tag)",
    )
    output = send.add_mutually_exclusive_group()
    output.add_argument(
        "--payload-only",
        action="store_true",
        help="print only each reply's payload, pretty-printed (a <huh> or <SystemError> "
        "then goes to standard error only)",
    )
    output.add_argument("--pretty", action="store_true", help="pretty-print the reply envelope(s)")
    send.add_argument(
        "--thread", metavar="UUID", help="thread to use (a uuid4; default: a new one)"
    )
    send.add_argument(
        "--multitask",
        choices=MULTITASK_MODES,
        metavar="MODE",
        help="for a task to an agent: what it does while an earlier task of its conversation "
        "is queued or running: " + ", ".join(MULTITASK_MODES) + " (default: the agent's "
        "multitask; docs/runs.md)",
    )
    send.add_argument(
        "--timeout",
        type=parse_positive,
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for the reply (default: 30)",
    )
    send.add_argument(
        "--linger",
        type=float,
        default=0.2,
        metavar="SECONDS",
        help="after the first reply, how long to wait for more on the same thread (default: 0.2)",
    )


def _failed(reply: Reply) -> bool:
    """A refusal, or an answer that says the request failed (``status="failed"`` on its
    root, as an agent's failed ``<answer>`` or the calculator's ``<error>`` carry)."""
    return reply.is_error or reply.payload.get("status") == "failed"


def cmd_send(args: argparse.Namespace) -> int:
    from agentserver.net.client import (
        AuthenticationRefused,
        ClientError,
        ConnectionClosed,
        RequestTimeout,
        open_client,
        payload_element,
    )

    if args.thread is not None and not is_uuid4(args.thread):
        print("--thread must be a lowercase uuid4", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.file.lstrip().startswith("<"):
            data = args.file.encode("utf-8")
        elif args.file == "-":
            data = sys.stdin.buffer.read()
        else:
            data = pathlib.Path(args.file).read_bytes()
    except OSError as exc:
        print(f"cannot read {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        payload = payload_element(data)
    except InputRefused as exc:
        if exc.reason is HuhReason.TOO_LARGE:
            problem = f"is too large: {exc.detail}, the limit is {DEFAULT_MAX_MESSAGE_BYTES}"
        else:
            problem = f"is not well-formed XML: {exc.detail or exc}"
        print(f"the payload {problem}", file=sys.stderr)
        return EXIT_USAGE
    tls = tls_options(args)
    creds = credentials(args, tls)
    if tls is None or creds is None:
        return EXIT_USAGE
    host, port = args.connect
    # Chosen here, not by the client: a Ctrl-C or a lost connection can still name it.
    thread = args.thread or new_thread_id()
    sent = False

    async def exchange() -> int:
        nonlocal sent
        async with open_client(host, port, client=creds[0], token=creds[1], **tls) as client:
            sent = True
            reply = await client.request(
                payload,
                to=args.to,
                timeout=args.timeout,
                thread=thread,
                multitask=args.multitask,
            )
            replies = [reply]
            with trio.move_on_after(max(args.linger, 0)):
                # Ends early if the server closes: what arrived is still printed. Replies
                # on other threads (a named client's answers kept from before) are left
                # unread, so they stay kept for a client that reads them.
                with contextlib.suppress(ConnectionClosed):
                    while True:
                        replies.append(await client.receive_on(reply.thread))
        for r in replies:
            if r.is_error:
                print(error_line(r), file=sys.stderr)
                if args.payload_only:
                    continue
            sys.stdout.write(render_reply(r, payload_only=args.payload_only, pretty=args.pretty))
        sys.stdout.flush()
        return EXIT_FAILED if any(_failed(r) for r in replies) else EXIT_OK

    async def send() -> int | None:
        """The exit status, or None when a signal (Ctrl-C) interrupted the wait."""
        outcome: int | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_signal, nursery.cancel_scope)
            outcome = await exchange()
            nursery.cancel_scope.cancel()
        return outcome

    try:
        status = trio_run(send)
    except KeyboardInterrupt:
        # A Ctrl-C before the signal watcher started (it is one of the first things).
        status = None
    except RequestTimeout as exc:
        print(str(exc), file=sys.stderr)
        print(f"an agent's task goes on: {later(args, thread, wait=True)}", file=sys.stderr)
        return EXIT_TIMEOUT
    except ConfigurationError as exc:  # a CA, certificate or key file that cannot be used
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except (ClientError, OSError, trio.TooSlowError) as exc:
        print(connection_failure(args, exc), file=sys.stderr)
        if (
            sent
            and isinstance(exc, ConnectionClosed)
            and not isinstance(exc, AuthenticationRefused)
        ):
            print(
                f"the task was sent on thread {thread}; a task to an agent goes on (after a "
                f"restart too): {later(args, thread, wait=True)}",
                file=sys.stderr,
            )
        return EXIT_CONNECTION
    if status is None:
        if sent:
            print(
                f"interrupted; the task was sent on thread {thread}. A task to an agent goes "
                f"on: {later(args, thread, wait=False)}",
                file=sys.stderr,
            )
        else:
            print("interrupted before the task was sent", file=sys.stderr)
        return EXIT_INTERRUPTED
    return status


def later(args: argparse.Namespace, thread: str, *, wait: bool) -> str:
    """The command that collects the answer of the task sent on ``thread`` later."""
    words = ["agentserver", "result", thread]
    if args.client is not None:
        words += ["--client", args.client]
    if args.boot is not None:
        words += ["--boot", args.boot]
    if wait:
        words += ["--wait", "60"]
    return "collect its answer with: " + " ".join(words)


def render_reply(reply: Reply, *, payload_only: bool = False, pretty: bool = False) -> str:
    """A reply as ``send`` prints it: the envelope as received (one line), the envelope
    pretty-printed, or only the payload pretty-printed."""
    from lxml import etree

    if payload_only:
        return etree.tostring(reply.payload, encoding="unicode", pretty_print=True, with_tail=False)
    if pretty:
        root = reply.payload.getroottree().getroot()
        return etree.tostring(root, encoding="unicode", pretty_print=True)
    return reply.raw.decode("utf-8") + "\n"


def error_line(reply: Reply) -> str:
    """``huh from NAME: TEXT`` / ``SystemError (CODE) from NAME: TEXT``, with the
    explanation a server run with --explain-refusals adds."""
    from agentserver.core.namespaces import CORE_NS

    if reply.is_huh:
        kind = "huh"
    else:
        kind = f"SystemError ({reply.payload.findtext(f'{{{CORE_NS}}}code')})"
    line = f"{kind} from {reply.from_id}: {reply.error_text}"
    detail = reply.payload.findtext(f"{{{CORE_NS}}}detail")
    return f"{line} ({detail})" if detail else line
