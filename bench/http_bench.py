"""Echo over HTTP keep-alive vs over the TCP socket: one server, loaded in alternation.

One ``agentserver run boot.xml --http-port 0`` (subprocess) serves both. Socket load:
CONNECTIONS framed connections, each waiting for its reply before sending the next (load
(a) of bench/socket.py). HTTP load: CONNECTIONS keep-alive HTTP/1.1 connections, each
sending ``POST /v1/messages?to=echo&thread=T`` and waiting for its ``200`` reply envelope
before the next (HTTP/1.1 has no usable pipelining, so one request in flight per
connection on both sides). The load generator writes pre-built requests and reads
responses with a minimal parser, checking each body ends with the expected pong on the
connection's thread: a server answering with refusals must not look fast.

Also, same run: a bare Hypercorn trio server (this file with --bare-server: an ASGI app
that reads the body and answers a fixed 200 pong envelope, no Starlette, no pump), loaded
the same way. Its rate is the ceiling of any API served by Hypercorn's trio worker on this
machine: it shows how much of the gap is the HTTP server itself.

Target: HTTP >= 40% of the socket's rate. Under a minute with the defaults.

Usage: python bench/http.py [--seconds S] [--rounds R] [--connections N]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading

import trio
from lxml import etree

# wire_bench (its helpers) sits next to this file; appended, so that this directory's
# http.py and socket.py never shadow the standard modules here.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from wire_bench import WrongReply, load, measure, stop

from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import canonicalize
from agentserver.listeners.echo import Ping, Pong

REPO = pathlib.Path(__file__).resolve().parent.parent
SOCKET = re.compile(r"agentserver listening on (\S+?):(\d+)")
HTTP = re.compile(r"agentserver http listening on http://(\S+?):(\d+)")
TARGET = 0.40


def http_request(port: int) -> tuple[bytes, bytes]:
    """A pre-built keep-alive POST of a ping on a thread of its own (reused: each answer
    ends the conversation), and the ending every good reply body has."""
    thread = new_thread_id()
    body = etree.tostring(Ping(text="hello").to_xml_tree())
    head = (
        f"POST /v1/messages?to=echo&thread={thread} HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode("ascii")
    expected = b"<thread>%s</thread></meta>%s</message>" % (
        thread.encode(),
        canonicalize(Pong(text="hello").to_xml_tree()),
    )
    return head + body, expected


async def http_load(
    port: int,
    *,
    connections: int,
    seconds: float,
    server_pid: int | None,
    client_cpu: list[float] | None = None,
) -> tuple[float, float | None]:
    """Closed loop over keep-alive connections, one request in flight each. Returns
    replies/s over the measured window and the server's CPU microseconds per reply."""
    counts = [0] * connections
    window = {"measuring": False}

    async def one(i: int, ready: trio.Event) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        request, expected = http_request(port)
        buffer = b""
        async with stream:
            await ready.wait()
            while True:
                await stream.send_all(request)
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        raise RuntimeError("server closed the connection")
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise WrongReply(f"expected 200, got {head[:200]!r}")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                while len(buffer) < length:
                    data = await stream.receive_some(65536)
                    if not data:
                        raise RuntimeError("server closed the connection")
                    buffer += data
                body, buffer = buffer[:length], buffer[length:]
                if not body.endswith(expected):
                    raise WrongReply(f"expected {expected!r}, got {body[:600]!r}")
                if window["measuring"]:
                    counts[i] += 1

    return await measure(
        one, counts, window, seconds=seconds, server_pid=server_pid, client_cpu=client_cpu
    )


# -- the bare Hypercorn server ---------------------------------------------------------


async def bare_server() -> None:
    """Hypercorn's trio worker with a minimal ASGI app; prints its port like ``run``."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                done = message["type"].replace(".startup", ".startup.complete")
                done = done.replace(".shutdown", ".shutdown.complete")
                await send({"type": done})
                if message["type"] == "lifespan.shutdown":
                    return
        query = scope["query_string"].decode()
        thread = query.rpartition("thread=")[2]
        body = b"<message><meta><thread>%s</thread></meta>%s</message>" % (
            thread.encode(),
            canonicalize(Pong(text="hello").to_xml_tree()),
        )
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"application/xml"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(functools.partial(serve, app, config))
        port = urls[0].rsplit(":", 1)[1]
        print(f"agentserver http listening on http://127.0.0.1:{port}", file=sys.stderr)
        print(f"agentserver listening on 127.0.0.1:{port}", file=sys.stderr, flush=True)


def start_server(argv: list[str], cwd: pathlib.Path) -> tuple[subprocess.Popen, int, int]:
    """A server, its socket port and its HTTP port (from the lines it prints)."""
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=cwd,  # a scratch directory: the server's agent store (./state/) goes there
    )
    found: dict[str, int] = {}
    event = threading.Event()

    def read() -> None:
        for raw in proc.stderr:
            line = raw.decode("utf-8", "replace")
            for name, pattern in (("http", HTTP), ("socket", SOCKET)):
                match = pattern.search(line)
                if match and name not in found:
                    found[name] = int(match.group(2))
            if len(found) == 2:
                event.set()
        event.set()

    threading.Thread(target=read, daemon=True).start()
    if not event.wait(30) or len(found) != 2:
        proc.kill()
        raise RuntimeError("the server did not start")
    return proc, found["socket"], found["http"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="measured seconds per load")
    ap.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds; medians are reported"
    )
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--boot", default=str(REPO / "boot.xml"), help="topology (default: boot.xml)")
    ap.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_server:
        trio.run(bare_server)
        return
    with tempfile.TemporaryDirectory(prefix="agentserver-bench-") as scratch:
        run_benchmark(args, pathlib.Path(scratch))


def run_benchmark(args: argparse.Namespace, scratch: pathlib.Path) -> None:
    boot = str(pathlib.Path(args.boot).resolve())
    real = ["-m", "agentserver", "--log-level", "warning", "run", boot, "--port", "0"]
    proc, socket_port, http_port = start_server([*real, "--http-port", "0"], scratch)
    bare, _, bare_port = start_server(
        [str(pathlib.Path(__file__).resolve()), "--bare-server"], scratch
    )
    rates: dict[str, list[float]] = {"socket": [], "http": [], "bare_http": []}
    cpus: dict[str, list[float]] = {"socket": [], "http": [], "bare_http": []}
    #: The load generator's own CPU per reply: were it near the server's, the client
    #: would be what limits the rate.
    client: dict[str, list[float]] = {"socket": [], "http": [], "bare_http": []}
    ratios: list[float] = []
    try:
        for r in range(args.rounds):
            socket_rate, socket_cpu = trio.run(
                functools.partial(
                    load,
                    "127.0.0.1",
                    socket_port,
                    answer=Pong(text="hello"),
                    connections=args.connections,
                    depth=1,
                    seconds=args.seconds,
                    server_pid=proc.pid,
                    client_cpu=client["socket"],
                )
            )
            http_rate, http_cpu = trio.run(
                functools.partial(
                    http_load,
                    http_port,
                    connections=args.connections,
                    seconds=args.seconds,
                    server_pid=proc.pid,
                    client_cpu=client["http"],
                )
            )
            bare_rate, bare_cpu = trio.run(
                functools.partial(
                    http_load,
                    bare_port,
                    connections=args.connections,
                    seconds=args.seconds,
                    server_pid=bare.pid,
                    client_cpu=client["bare_http"],
                )
            )
            rates["socket"].append(socket_rate)
            rates["http"].append(http_rate)
            rates["bare_http"].append(bare_rate)
            for name, cpu in (("socket", socket_cpu), ("http", http_cpu), ("bare_http", bare_cpu)):
                if cpu is not None:
                    cpus[name].append(cpu)
            ratios.append(http_rate / socket_rate)
            print(
                f"round {r + 1}/{args.rounds} {args.connections} connections x 1 in flight: "
                f"socket {socket_rate:8,.0f} msg/s, http {http_rate:8,.0f} msg/s, "
                f"ratio {ratios[-1]:.0%} (bare Hypercorn {bare_rate:8,.0f} req/s)",
                flush=True,
            )
    except* WrongReply as group:
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        print(f"FAILED: {first}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        stop(proc)
        stop(bare)
    ratio = statistics.median(ratios)
    cpu_figures = {
        f"{name}_cpu_us": round(statistics.median(values), 1)
        for name, values in cpus.items()
        if values
    }
    if cpu_figures:
        print(
            "median server CPU per reply: "
            + ", ".join(f"{k[:-7]} {v:.0f} us" for k, v in cpu_figures.items())
        )
    client_figures = {
        f"{name}_client_cpu_us": round(statistics.median(values), 1)
        for name, values in client.items()
        if values
    }
    print(
        "median load generator CPU per reply: "
        + ", ".join(f"{k[:-14]} {v:.0f} us" for k, v in client_figures.items())
    )
    if {"socket_cpu_us", "http_cpu_us", "bare_http_cpu_us"} <= cpu_figures.keys():
        # What the rates would be if the server's CPU were the only limit.
        cpu_figures["cpu_ratio"] = round(
            cpu_figures["socket_cpu_us"] / cpu_figures["http_cpu_us"], 3
        )
        cpu_figures["bare_cpu_ratio"] = round(
            cpu_figures["socket_cpu_us"] / cpu_figures["bare_http_cpu_us"], 3
        )
        print(
            f"server-CPU ratio http/socket: {cpu_figures['cpu_ratio']:.0%} "
            f"(bare Hypercorn/socket: {cpu_figures['bare_cpu_ratio']:.0%})"
        )
    print(f"median ratio http/socket: {ratio:.0%}   (target >= {TARGET:.0%})")
    print(
        json.dumps(
            {
                "connections": args.connections,
                "seconds": args.seconds,
                "rounds": args.rounds,
                "socket": round(statistics.median(rates["socket"])),
                "http": round(statistics.median(rates["http"])),
                "bare_http": round(statistics.median(rates["bare_http"])),
                "bare_ratio": round(
                    statistics.median(
                        b / s for b, s in zip(rates["bare_http"], rates["socket"], strict=True)
                    ),
                    3,
                ),
                **cpu_figures,
                **client_figures,
                "ratio": round(ratio, 3),
                "target": TARGET,
            }
        )
    )


if __name__ == "__main__":
    main()
