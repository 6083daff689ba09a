"""``agentserver result THREAD [--wait SECONDS]``: the answer of a task sent earlier (by
``send`` interrupted, or whose connection was lost), collected later, with ``send``'s exit
statuses.

Where it looks: the project's store (the boot.xml's ``<store>``, read as ``store stats``
reads it: with the server stopped, or beside it running), unless an HTTP API is named
(``--url`` or ``$AGENTSERVER_HTTP_URL``) or there is no project here; then the HTTP API
(``GET /v1/agents/{name}/tasks/{thread}`` of each agent the caller may see). Either way
a task is found only for the client that sent it: with clients declared, ``--client
NAME`` (and its token in ``$AGENTSERVER_TOKEN`` for the HTTP API); another client's task
reads as missing.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from agentserver.cli.common import (
    EXIT_CONNECTION,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    TOKEN_ENV,
    Subcommands,
    add_http_api_options,
    http_api_client,
    http_unreachable,
    trio_run,
)
from agentserver.core.threads import is_uuid4

#: How often ``--wait`` looks again.
POLL_S = 0.5
#: A task in one of these states has not ended yet.
PENDING = ("queued", "running")


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``result`` subcommand."""
    result = sub.add_parser(
        "result",
        parents=[common],
        help="print the answer of a task sent earlier (by its thread)",
        description="Print the answer of the task sent on THREAD (the thread 'send' names "
        "when it is interrupted or loses the server), from the project's store (read beside "
        "a running server, or with it stopped) or, given --url or $AGENTSERVER_HTTP_URL (or "
        "with no project here), through the HTTP API. Only the client that sent the task "
        f"finds it: with clients declared, pass --client NAME (over HTTP, its token in "
        f"${TOKEN_ENV}). Exit as 'send': 0 answered, 1 a failed answer or no such task, "
        "3 not answered (within --wait), 4 unreachable.",
    )
    result.add_argument("thread", metavar="THREAD", help="the task's thread (a uuid4)")
    result.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for a task still queued or running (default: 0, look once)",
    )
    result.add_argument(
        "--client",
        metavar="NAME",
        help="the client that sent the task (needed where boot.xml declares clients)",
    )
    result.add_argument(
        "--store",
        metavar="PATH|URL",
        help="the agent store: a SQLite file or a postgresql:// URL (default: BOOT's <store>)",
    )
    add_http_api_options(result)


class _Refused(Exception):
    """The caller cannot be told: a message and an exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _from_store(args: argparse.Namespace) -> dict[str, Any] | None:
    from agentserver.agents.errors import AgentError
    from agentserver.app.results import task_answer
    from agentserver.config.problems import BootError

    try:
        found = trio_run(lambda: task_answer(args.project.boot, args.thread, store=args.store))
    except (AgentError, BootError, OSError) as exc:
        raise _Refused(f"result: {exc}", EXIT_FAILED) from None
    task = found.task
    if found.clients_declared:
        if args.client is None:
            raise _Refused(
                f"authentication required: pass --client NAME and set {TOKEN_ENV}", EXIT_USAGE
            )
        if task is not None and task.get("sender") != args.client:
            return None  # another client's task reads as missing
    return task


def _from_http(args: argparse.Namespace) -> dict[str, Any] | None:
    import httpx

    base = args.url.rstrip("/")
    try:
        with http_api_client(args, 10.0) as client:
            listed = client.get(f"{base}/v1/agents")
            _check(listed, args)
            found: list[dict[str, Any]] = []
            for agent in listed.json().get("agents", []):
                one = client.get(f"{base}/v1/agents/{agent['name']}/tasks/{args.thread}")
                if one.status_code == 404:
                    if one.json().get("type", "").endswith("/pruned"):
                        found.append({"agent": agent["name"], "pruned": True})
                    continue
                _check(one, args)
                found.append(one.json())
    except httpx.HTTPError as exc:
        raise _Refused(http_unreachable(args, exc), EXIT_CONNECTION) from None
    # The latest, should several agents have a task on it.
    return max(found, key=lambda t: t.get("created_at") or 0.0, default=None)


def _check(response: Any, args: argparse.Namespace) -> None:
    if response.status_code in (401, 403):
        raise _Refused(
            f"authentication required: pass --client NAME and set {TOKEN_ENV}"
            if args.client is None
            else f"authentication refused: check ${TOKEN_ENV} (the token of client "
            f"{args.client!r})",
            EXIT_USAGE,
        )
    if response.status_code != 200:
        raise _Refused(f"{response.url}: {response.status_code} {response.text}", EXIT_FAILED)


def cmd_result(args: argparse.Namespace) -> int:
    if not is_uuid4(args.thread):
        print("THREAD must be a lowercase uuid4 (as send prints it)", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _collect(args)
    except KeyboardInterrupt:
        print(f"interrupted; 'agentserver result {args.thread}' looks again", file=sys.stderr)
        return EXIT_INTERRUPTED


def _collect(args: argparse.Namespace) -> int:
    from_store = args.project is not None and args.url_from in ("project", "default")
    deadline = time.monotonic() + max(args.wait, 0.0)
    while True:
        try:
            task = _from_store(args) if from_store else _from_http(args)
        except _Refused as exc:
            print(str(exc), file=sys.stderr)
            return exc.status
        if task is not None and task.get("status") not in PENDING:
            return _show(task, args.thread)
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    if task is None:
        print(_missing(args), file=sys.stderr)
        return EXIT_FAILED
    print(
        f"the task on thread {args.thread} (agent {task['agent']}) is {task['status']}: no "
        f"answer yet{' within ' + format(args.wait, 'g') + ' s' if args.wait > 0 else ''} "
        f"(agentserver result {args.thread} --wait SECONDS waits for it)",
        file=sys.stderr,
    )
    return EXIT_TIMEOUT


def _missing(args: argparse.Namespace) -> str:
    who = f" sent by client {args.client!r}" if args.client is not None else ""
    return f"no task{who} on thread {args.thread}"


def _show(task: dict[str, Any], thread: str) -> int:
    """Print a finished task's answer; its exit status."""
    from lxml import etree

    from agentserver.core.xmlsafe import SafeParser

    if task.get("pruned"):
        print(
            f"the task on thread {thread} (agent {task['agent']}) was removed by retention",
            file=sys.stderr,
        )
        return EXIT_FAILED
    status = task.get("status")
    answer = task.get("answer")
    if answer is None:
        print(
            f"the task on thread {thread} (agent {task['agent']}) ended {status} without "
            f"an answer{': ' + task['error'] if task.get('error') else ''}",
            file=sys.stderr,
        )
        return EXIT_OK if status == "succeeded" else EXIT_FAILED
    try:
        payload = SafeParser().parse(answer.encode("utf-8"))
    except Exception:
        sys.stdout.write(answer + "\n")
        failed = True
    else:
        sys.stdout.write(etree.tostring(payload, encoding="unicode", pretty_print=True))
        failed = payload.get("status") == "failed"
    sys.stdout.flush()
    if failed or task.get("answer_failed") or status != "succeeded":
        return EXIT_FAILED
    return EXIT_OK
