"""``agentserver status``: what a running server is doing, from its HTTP API."""

from __future__ import annotations

import argparse
import json
import sys

from agentserver.cli.common import (
    EXIT_CONNECTION,
    EXIT_FAILED,
    EXIT_OK,
    TOKEN_ENV,
    Subcommands,
    add_http_api_options,
    http_api_client,
    http_unreachable,
    parse_positive,
    plural,
    refusal_text,
)


def add_parsers(
    sub: Subcommands, common: argparse.ArgumentParser, remote: argparse.ArgumentParser
) -> None:
    """The ``status`` subcommand."""
    status = sub.add_parser(
        "status",
        parents=[common],
        help="show what a running server is doing",
        description="Ask a running server's HTTP API (GET /v1/status) for its listeners and "
        "queues, agents with their state and queue, LLM backends with breaker and bucket "
        "state, and connections. Needs the HTTP API (<http> in boot.xml or run --http-port). "
        f"With declared clients the token is read from ${TOKEN_ENV}. Exit 4 if unreachable.",
    )
    add_http_api_options(status)
    status.add_argument("--json", action="store_true", help="print the status document as JSON")
    status.add_argument(
        "--timeout",
        type=parse_positive,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the answer (default: 10)",
    )


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    url = args.url.rstrip("/") + "/v1/status"
    try:
        with http_api_client(args, args.timeout) as client:
            response = client.get(url)
    except httpx.HTTPError as exc:
        hint = (
            ""
            if getattr(args, "url_from", None) == "default" and getattr(args, "project", None)
            else (" (is the server running with <http> in boot.xml or run --http-port?)")
        )
        print(http_unreachable(args, exc) + hint, file=sys.stderr)
        return EXIT_CONNECTION
    if response.status_code != 200:
        print(f"{url}: {response.status_code} {refusal_text(response)}", file=sys.stderr)
        return EXIT_FAILED
    doc = response.json()
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(format_status(doc))
    return EXIT_OK


def format_status(doc: dict) -> str:
    """The status document (GET /v1/status) for a terminal."""
    ready = doc.get("ready", {})
    checks = ", ".join(f"{k} {_yes(v)}" for k, v in ready.get("checks", {}).items())
    pump = doc.get("pump", {})
    lines = [
        f"organism {doc.get('organism')!r} (agentserver {doc.get('version')}): "
        f"{'ready' if ready.get('ready') else 'NOT ready'} ({checks})",
        f"pump {pump.get('state')}: {pump.get('inflight', 0)} in flight, "
        f"{plural(pump.get('threads', 0), 'thread')}, "
        f"{plural(pump.get('endpoints', 0), 'endpoint')}",
        "listeners:",
    ]
    for lst in doc.get("listeners", []):
        lines.append(
            f"  {lst['name']:<20} queue {lst['queue']:<5} waiting {lst['waiting']:<5} "
            f"handled {lst['handled']}{'  (agent)' if lst.get('agent') else ''}"
        )
    agents = doc.get("agents", [])
    if agents:
        lines.append("agents:")
        for agent in agents:
            turn = agent.get("active_turn")
            active = f", turn {turn['id'][:8]} step {turn['steps']}" if turn else ""
            if turn and turn.get("version"):
                pinned = " pinned" if turn.get("pinned") else ""
                active += f" on{pinned} version {turn['version']}"
                if turn.get("waiting_for_version"):
                    active += f", WAITING for version {turn['waiting_for_version']}"
            version = f" version {agent['version']}" if agent.get("version") else ""
            lines.append(
                f"  {agent['name']:<20} {agent['state']:<10} queue {agent['queue']}{active}"
                f"{',' if version else ''}{version and ' serving' + version}"
            )
            by_version = agent.get("versions") or {}
            if len(by_version) > 1 or (by_version and set(by_version) != {agent.get("version")}):
                counts = ", ".join(
                    f"{v or 'unversioned'}: {c.get('active', 0)} active, {c.get('queued', 0)} queued"
                    for v, c in sorted(by_version.items())
                )
                lines.append(f"    turns by version: {counts}")
            error = agent.get("last_error")
            if error:
                # Whole (the API keeps its first 500 characters), on lines of its own.
                text = " ".join(str(error.get("text", "")).split())
                lines.append(f"    last error ({error['status']}): {text}")
    backends = doc.get("backends", {})
    if backends:
        lines.append("LLM backends:")
        for name, b in backends.items():
            if b.get("skipped"):
                lines.append(f"  {name:<20} skipped: {b['skipped']}")
                continue
            buckets = ", ".join(
                f"{label} bucket {b[key]:.0%}"
                for key, label in (
                    ("requests_bucket_fill", "requests"),
                    ("tokens_bucket_fill", "tokens"),
                )
                if b.get(key) is not None
            )
            cooling = f", cooling {b['cooling_for']:.1f}s" if b.get("cooling_for") else ""
            lines.append(
                f"  {name:<20} breaker {b['breaker']}, {b['active']} active{cooling}"
                f"{', ' + buckets if buckets else ''}"
            )
    hooks = doc.get("webhooks", [])
    if hooks:
        lines.append("webhooks:")
        for w in hooks:
            state = "DISABLED" if w.get("disabled") else ("FAILING" if w.get("failing") else "ok")
            error = f", last error: {w['last_error']}" if w.get("failing") else ""
            lines.append(
                f"  {w['name']:<20} {state}, {w.get('pending', 0)} pending, "
                f"{w.get('delivered', 0)} delivered{error}"
            )
    conns = doc.get("connections", {})
    lines.append(
        f"connections: socket {conns.get('socket', 0)}, HTTP pending {conns.get('http_pending', 0)}, "
        f"HTTP kept threads {conns.get('http_kept_threads', 0)}, "
        f"event streams {conns.get('sse_streams', 0)}"
    )
    return "\n".join(lines)


def _yes(value: object) -> str:
    return "n/a" if value is None else ("ok" if value else "FAILING")
