"""Messages/s through the real server vs a bare trio server, over loopback, same run.

real: ``agentserver run boot.xml`` (subprocess): frame → parse → validate envelope and
      payload → route → echo listener → validate reply → route back → C14N → frame.
bare: a trio server (subprocess, this file with --bare-server) that only parses with the
      hardened parser, validates envelope and payload, canonicalises and echoes.

Two loads against each: (a) CONNECTIONS connections each waiting for its reply before
sending the next, (b) CONNECTIONS connections with DEPTH requests in flight each. The load
generator frames pre-built requests and counts reply frames without parsing them, so it
costs far less than either server; it only checks, with one byte comparison per frame,
that each reply is the expected answer on the connection's thread (a pong from the real
server, the canonical echo from the bare one). Any other reply (a ``<huh>``, a
``<SystemError>``) fails the run: a server answering everything with refusals must not
look fast.

Usage: python bench/socket.py (or bench/wire_bench.py) [--seconds S] [--rounds R]
       [--connections N] [--depth D]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import trio
from lxml import etree

from agentserver.envelope import build_envelope, load_envelope_schema
from agentserver.framing import FrameDecoder, encode_frame, encode_frames
from agentserver.listeners.echo import Ping, Pong
from agentserver.payloads import PayloadType
from agentserver.threads import new_thread_id
from agentserver.xmlsafe import SafeParser, canonicalize

REPO = pathlib.Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on (\S+?):(\d+)")


# -- the bare server --------------------------------------------------------------------


async def bare_server(port: int) -> None:
    parser = SafeParser()
    envelope_schema = load_envelope_schema()
    ping = PayloadType.from_model(Ping)

    async def handle(stream: trio.SocketStream) -> None:
        decoder = FrameDecoder(1024 * 1024)
        try:
            while data := await stream.receive_some(65536):
                decoder.feed(data)
                out = []
                while (frame := decoder.next_frame()) is not None:
                    root = parser.parse(frame)
                    if envelope_schema.validate(root) and ping.is_valid(root[1]):
                        out.append(canonicalize(root))
                if out:
                    await stream.send_all(encode_frames(out))
        except trio.BrokenResourceError:
            pass

    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    print(
        f"bare listening on 127.0.0.1:{listeners[0].socket.getsockname()[1]}",
        file=sys.stderr,
        flush=True,
    )
    await trio.serve_listeners(handle, listeners)


# -- load generator ---------------------------------------------------------------------


class WrongReply(RuntimeError):
    """A server answered something other than the expected reply."""


# What each server answers a ping with: the real one's echo listener a pong, the bare one
# the request itself (canonicalised).
ANSWERS = {"real": Pong(text="hello"), "bare": Ping(text="hello")}


def request_frame(answer: Ping | Pong) -> tuple[bytes, bytes]:
    """A framed ping on a new thread, and the ending every good reply to it has: the
    thread, then the expected payload in canonical form (what both servers send)."""
    thread = new_thread_id()
    body = etree.tostring(build_envelope("bench", "echo", thread, Ping(text="hello").to_xml_tree()))
    # A byte pattern to search replies for, not a document: the uuid needs no escaping.
    expected = b"<thread>%s</thread></meta>%s</message>" % (
        thread.encode(),
        canonicalize(answer.to_xml_tree()),
    )
    return encode_frame(body), expected


async def load(
    host: str, port: int, *, answer: Ping | Pong, connections: int, depth: int, seconds: float
) -> float:
    """Closed loop: each connection keeps ``depth`` requests outstanding. Returns replies/s
    over the measured window (after a short warm-up). Raises :class:`WrongReply` when a
    reply is not ``answer`` on the connection's thread."""
    counts = [0] * connections
    window = {"start": 0.0, "measuring": False}

    async def one(i: int, ready: trio.Event) -> None:
        stream = await trio.open_tcp_stream(host, port)
        frame, expected = request_frame(answer)  # one thread per connection, reused
        decoder = FrameDecoder(1024 * 1024)
        async with stream:
            await ready.wait()
            await stream.send_all(frame * depth)
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    raise RuntimeError("server closed the connection")
                decoder.feed(data)
                frames = decoder.frames()
                for reply in frames:
                    if not reply.endswith(expected):
                        raise WrongReply(f"expected {expected!r}, got {reply[:600]!r}")
                got = len(frames)
                if got:
                    if window["measuring"]:
                        counts[i] += got
                    await stream.send_all(frame * got)

    ready = trio.Event()
    async with trio.open_nursery() as nursery:
        for i in range(connections):
            nursery.start_soon(one, i, ready)
        await trio.sleep(0.3)
        ready.set()
        await trio.sleep(min(1.0, seconds / 3))  # warm-up
        window["measuring"] = True
        start = time.perf_counter()
        await trio.sleep(seconds)
        window["measuring"] = False
        elapsed = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return sum(counts) / elapsed


# -- orchestration ----------------------------------------------------------------------


def start(args: list[str], cwd: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=cwd,  # a scratch directory: the server's agent store (./state/) goes there
    )
    found: list[int] = []
    event = threading.Event()

    def read() -> None:
        for raw in proc.stderr:
            match = LISTENING.search(raw.decode("utf-8", "replace"))
            if match and not found:
                found.append(int(match.group(2)))
                event.set()
        event.set()

    threading.Thread(target=read, daemon=True).start()
    if not event.wait(30) or not found:
        proc.kill()
        raise RuntimeError(f"{args} did not start")
    return proc, found[0]


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--seconds", type=float, default=2.0, help="measured seconds per load (default 2)"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds; medians are reported"
    )
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument(
        "--depth", type=int, default=16, help="requests in flight per connection in load (b)"
    )
    ap.add_argument(
        "--boot",
        default=str(REPO / "boot.xml"),
        help="topology of the real server (default: boot.xml)",
    )
    ap.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_server:
        trio.run(bare_server, args.port)
        return

    servers = {
        "real": [
            "-m",
            "agentserver",
            "--log-level",
            "warning",
            "run",
            str(pathlib.Path(args.boot).resolve()),
            "--port",
            "0",
        ],
        "bare": [str(pathlib.Path(__file__).resolve()), "--bare-server"],
    }
    # Both servers run for the whole benchmark and are loaded in alternation, round after
    # round: a slower moment of this (shared) machine then hits both sides of a ratio.
    ports: dict[str, int] = {}
    procs = []
    rates: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {"a": [], "b": []}
    scratch = tempfile.TemporaryDirectory(prefix="agentserver-bench-")
    try:
        for name, argv in servers.items():
            proc, ports[name] = start(argv, scratch.name)
            procs.append(proc)
        for r in range(args.rounds):
            for load_name, depth in (("a", 1), ("b", args.depth)):
                got = {}
                for name in ("real", "bare"):
                    got[name] = trio.run(
                        lambda d=depth, p=ports[name], a=ANSWERS[name]: load(
                            "127.0.0.1",
                            p,
                            answer=a,
                            connections=args.connections,
                            depth=d,
                            seconds=args.seconds,
                        )
                    )
                    rates.setdefault(f"{name}_{load_name}", []).append(got[name])
                ratios[load_name].append(got["real"] / got["bare"])
                print(
                    f"round {r + 1}/{args.rounds} ({load_name}) {args.connections} connections x "
                    f"{depth:2} in flight: real {got['real']:8,.0f} msg/s, bare "
                    f"{got['bare']:8,.0f} msg/s, ratio {ratios[load_name][-1]:.0%}",
                    flush=True,
                )
    except* WrongReply as group:
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        print(f"FAILED: {first}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        for proc in procs:
            stop(proc)
        scratch.cleanup()
    figures = {key: round(statistics.median(values)) for key, values in rates.items()}
    ratio_a = statistics.median(ratios["a"])
    ratio_b = statistics.median(ratios["b"])
    print(
        f"median ratio (a) real/bare: {ratio_a:.0%}   (b) real/bare: {ratio_b:.0%}   "
        "(target >= 60%)"
    )
    print(
        json.dumps(
            {
                "connections": args.connections,
                "depth": args.depth,
                "seconds": args.seconds,
                "rounds": args.rounds,
                **figures,
                "ratio_a": round(ratio_a, 3),
                "ratio_b": round(ratio_b, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
