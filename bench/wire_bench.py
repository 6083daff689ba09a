"""Messages/s through the real server vs a bare trio server, over loopback, same run.

real: ``agentserver run boot.xml`` (subprocess): frame → parse → validate envelope and
      payload → route → echo listener → validate reply → route back → C14N → frame.
bare: a trio server (subprocess, this file with --bare-server) that does the same XML work
      per message and nothing else (no routing, threads or accounting): parse with the
      hardened parser, validate envelope and payload, the echo handler (builds the pong),
      validate the reply, build the reply envelope, C14N, frame.

Two loads against each: (a) CONNECTIONS connections each waiting for its reply before
sending the next, (b) CONNECTIONS connections with DEPTH requests in flight each. The load
generator frames pre-built requests and counts reply frames without parsing them, so it
costs far less than either server; it only checks, with one byte comparison per frame,
that each reply is the expected answer on the connection's thread (a pong from either). Any other reply (a ``<huh>``, a
``<SystemError>``) fails the run: a server answering everything with refusals must not
look fast. Under load (a) each request's time to its reply is recorded: p50 and p99 of
each server are printed (target for the real one: p99 <= 3x p50).

With --tls, the real server over TLS against the real server over plaintext instead (a
copy of the topology with ``<tls>``, certificates made by trustme in a temporary
directory); the ratio is TLS/plaintext (targets: load (a) >= 75%, load (b) >= 90%). Then
TLS handshakes per second against the TLS server, full and resumed (a TLS 1.3 ticket
from a first connection), HANDSHAKE_CONNECTORS at once, each connecting, shaking hands
and closing (with ``close_notify``) in a loop (target: resumed >= 2x full).

Usage: python bench/socket.py (or bench/wire_bench.py) [--tls] [--seconds S] [--rounds R]
       [--connections N] [--depth D]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import re
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable

import trio
from lxml import etree

from agentserver.core.envelope import build_envelope, load_envelope_schema
from agentserver.core.framing import FrameDecoder, encode_frame, encode_frames
from agentserver.core.payloads import PayloadType
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser, canonicalize
from agentserver.listeners.echo import Ping, Pong
from agentserver.listeners.echo import respond as echo

REPO = pathlib.Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on (\S+?):(\d+)")


# -- the bare server --------------------------------------------------------------------


async def bare_server(port: int) -> None:
    parser = SafeParser()
    envelope_schema = load_envelope_schema()
    ping, pong = PayloadType.from_model(Ping), PayloadType.from_model(Pong)

    def answer(frame: bytes) -> bytes | None:
        root = parser.parse(frame)
        if not (envelope_schema.validate(root) and ping.is_valid(root[1])):
            return None
        reply = echo(root[1], None).payload
        if not pong.is_valid(reply):
            return None
        return canonicalize(build_envelope("echo", "bench", root[0][-1].text, reply))

    async def handle(stream: trio.SocketStream) -> None:
        decoder = FrameDecoder(1024 * 1024)
        try:
            while data := await stream.receive_some(65536):
                decoder.feed(data)
                out = []
                while (frame := decoder.next_frame()) is not None:
                    if (reply := answer(frame)) is not None:
                        out.append(reply)
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


# What each server answers a ping with: a pong (the bare one builds it as the echo
# listener does).
ANSWERS = {
    "real": Pong(text="hello"),
    "tls": Pong(text="hello"),
    "plain": Pong(text="hello"),
    "bare": Pong(text="hello"),
}


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
    host: str,
    port: int,
    *,
    answer: Ping | Pong,
    connections: int,
    depth: int,
    seconds: float,
    ssl_context: ssl.SSLContext | None = None,
    server_pid: int | None = None,
    client_cpu: list[float] | None = None,
    latencies: list[float] | None = None,
) -> tuple[float, float | None]:
    """Closed loop: each connection keeps ``depth`` requests outstanding. Returns replies/s
    over the measured window (after a short warm-up), and the server's CPU microseconds
    per reply in that window (None where /proc is missing): unlike the rate, the CPU cost
    hardly depends on what else this machine is running. Raises :class:`WrongReply` when a
    reply is not ``answer`` on the connection's thread. With ``depth`` 1, each measured
    request's time to its reply (seconds) is appended to ``latencies`` if given."""
    timed = latencies is not None and depth == 1
    perf_counter = time.perf_counter
    counts = [0] * connections
    window = {"start": 0.0, "measuring": False}

    async def one(i: int, ready: trio.Event) -> None:
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
        if ssl_context is not None:
            # The library's own TLS stream (as open_client uses): trio.SSLStream costs the
            # load generator several times more per message, and it shares the machine.
            from agentserver.net.tlsstream import TlsStream

            stream = TlsStream(stream, ssl_context, server_hostname=host)
            await stream.do_handshake()
        frame, expected = request_frame(answer)  # one thread per connection, reused
        decoder = FrameDecoder(1024 * 1024)
        async with stream:
            await ready.wait()
            sent = perf_counter()
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
                        if timed:
                            latencies.append(perf_counter() - sent)
                    sent = perf_counter()
                    await stream.send_all(frame * got)

    return await measure(
        one, counts, window, seconds=seconds, server_pid=server_pid, client_cpu=client_cpu
    )


async def measure(
    one: Callable[[int, trio.Event], Awaitable[None]],
    counts: list[int],
    window: dict,
    *,
    seconds: float,
    server_pid: int | None,
    client_cpu: list[float] | None = None,
) -> tuple[float, float | None]:
    """Run ``one(i, ready)`` for each of ``len(counts)`` connections, open the measured
    window (``window["measuring"]``) after a warm-up, and return replies/s over it and the
    server's CPU microseconds per reply (None where /proc is missing). ``client_cpu``, if
    given, gets this load generator's own CPU microseconds per reply (is it the limit?)."""
    ready = trio.Event()
    async with trio.open_nursery() as nursery:
        for i in range(len(counts)):
            nursery.start_soon(one, i, ready)
        await trio.sleep(0.3)
        ready.set()
        await trio.sleep(min(1.0, seconds / 3))  # warm-up
        window["measuring"] = True
        cpu_start = cpu_seconds(server_pid)
        own_start = time.process_time()
        start = time.perf_counter()
        await trio.sleep(seconds)
        window["measuring"] = False
        elapsed = time.perf_counter() - start
        own = time.process_time() - own_start
        cpu_end = cpu_seconds(server_pid)
        nursery.cancel_scope.cancel()
    replies = sum(counts)
    if client_cpu is not None and replies:
        client_cpu.append(own / replies * 1e6)
    cpu = None
    if cpu_start is not None and cpu_end is not None and replies:
        cpu = (cpu_end - cpu_start) / replies * 1e6
    return replies / elapsed, cpu


#: Connections opening at once in the handshake measurement.
HANDSHAKE_CONNECTORS = 8


async def handshakes(
    host: str,
    port: int,
    *,
    context: ssl.SSLContext,
    resume: bool,
    seconds: float,
    server_pid: int | None = None,
    client_cpu: list[float] | None = None,
) -> tuple[float, float | None, int]:
    """TLS handshakes per second (connect, handshake, close) over ``seconds``, full or
    resuming one session (taken by a first connection, after a ping answered so that its
    TLS 1.3 ticket has arrived); the server's CPU microseconds per handshake; and how many
    handshakes did not do what was asked (resumed when full was measured, or the reverse:
    must be 0). ``client_cpu``, if given, gets this load generator's own CPU microseconds
    per handshake: the client's side of a full handshake (verifying the certificate) costs
    more than the server's, and both share the machine."""
    from agentserver.net.tlsstream import TlsStream

    session = None
    if resume:
        stream = TlsStream(await trio.open_tcp_stream(host, port), context, server_hostname=host)
        await stream.do_handshake()
        frame, _ = request_frame(ANSWERS["tls"])
        await stream.send_all(frame)
        decoder = FrameDecoder(1024 * 1024)
        while not decoder.frames():
            decoder.feed(await stream.receive_some())
        session = stream.session
        await stream.aclose()
    counts = [0] * HANDSHAKE_CONNECTORS
    wrong = [0]
    window = {"start": 0.0, "measuring": False}

    async def one(i: int, ready: trio.Event) -> None:
        await ready.wait()
        while True:
            tcp = await trio.open_tcp_stream(host, port)
            stream = TlsStream(tcp, context, server_hostname=host, session=session)
            await stream.do_handshake()
            if stream.session_reused != resume:
                wrong[0] += 1
            await stream.aclose()
            if window["measuring"]:
                counts[i] += 1

    rate, cpu = await measure(
        one, counts, window, seconds=seconds, server_pid=server_pid, client_cpu=client_cpu
    )
    return rate, cpu, wrong[0]


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of process ``pid`` so far (Linux /proc), else None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``samples``, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- orchestration ----------------------------------------------------------------------


def start(
    args: list[str], cwd: pathlib.Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, int]:
    """Start ``python ARGS`` (a server) in ``cwd`` and wait for the port it prints."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=cwd,  # a scratch directory: the server's agent store (./state/) goes there
        env=env,
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


def tls_setup(
    boot: pathlib.Path, directory: pathlib.Path, key_type: str = "ecdsa"
) -> tuple[pathlib.Path, ssl.SSLContext]:
    """A copy of ``boot`` in ``directory`` with ``<tls>``, its certificate and key (made by
    trustme, a dev dependency: ECDSA P-256 or RSA 2048), and a client context that trusts
    them."""
    import trustme

    from agentserver.core.namespaces import BOOT_NS

    kind = trustme.KeyType.RSA if key_type == "rsa" else trustme.KeyType.ECDSA
    ca = trustme.CA(key_type=kind)
    issued = ca.issue_cert("127.0.0.1", "localhost", key_type=kind)
    issued.cert_chain_pems[0].write_to_path(str(directory / "server.pem"))
    issued.private_key_pem.write_to_path(str(directory / "server.key"))
    tree = etree.parse(str(boot))
    tree.getroot().insert(
        0, etree.Element(f"{{{BOOT_NS}}}tls", cert="server.pem", key="server.key")
    )
    target = directory / "boot.xml"
    tree.write(str(target), xml_declaration=True, encoding="UTF-8")
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return target, context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--tls",
        action="store_true",
        help="compare the real server over TLS with itself over plaintext (not with bare)",
    )
    ap.add_argument(
        "--tls-key",
        choices=("ecdsa", "rsa"),
        default="ecdsa",
        help="the TLS certificate's key: ECDSA P-256 (default) or RSA 2048",
    )
    ap.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="measured seconds per load (default 2; 1.5 with --tls, to stay under a minute)",
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
    if args.seconds is None:
        args.seconds = 1.5 if args.tls else 2.0
    with tempfile.TemporaryDirectory(prefix="agentserver-bench-") as scratch:
        run_benchmark(args, pathlib.Path(scratch))


def run_benchmark(args: argparse.Namespace, scratch: pathlib.Path) -> None:
    def real(boot: pathlib.Path) -> list[str]:
        return ["-m", "agentserver", "--log-level", "warning", "run", str(boot), "--port", "0"]

    boot = pathlib.Path(args.boot).resolve()
    contexts: dict[str, ssl.SSLContext | None] = {}
    if args.tls:
        # Both from the scratch directory, so they differ only in <tls> (the store too).
        plain_dir, tls_dir = scratch / "plain", scratch / "tls"
        plain_dir.mkdir()
        tls_dir.mkdir()
        (plain_dir / "boot.xml").write_bytes(boot.read_bytes())
        tls_boot, contexts["tls"] = tls_setup(boot, tls_dir, args.tls_key)
        servers = {
            "tls": (real(tls_boot), tls_dir),
            "plain": (real(plain_dir / "boot.xml"), plain_dir),
        }
        targets = {"a": 0.75, "b": 0.90}
    else:
        servers = {
            "real": (real(boot), scratch),
            "bare": ([str(pathlib.Path(__file__).resolve()), "--bare-server"], scratch),
        }
        targets = {"a": 0.80, "b": 0.60}
    first, second = servers
    # Both servers run for the whole benchmark and are loaded in alternation, round after
    # round: a slower moment of this (shared) machine then hits both sides of a ratio.
    ports: dict[str, int] = {}
    pids: dict[str, int] = {}
    procs = []
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {"a": [], "b": []}
    latencies: dict[str, list[float]] = {}  # load (a), every round
    try:
        for name, (argv, cwd) in servers.items():
            proc, ports[name] = start(argv, cwd)
            procs.append(proc)
            pids[name] = proc.pid
        for r in range(args.rounds):
            for load_name, depth in (("a", 1), ("b", args.depth)):
                got = {}
                for name in servers:
                    own: list[float] = []
                    got[name], cpu = trio.run(
                        functools.partial(
                            load,
                            "127.0.0.1",
                            ports[name],
                            answer=ANSWERS[name],
                            connections=args.connections,
                            depth=depth,
                            seconds=args.seconds,
                            ssl_context=contexts.get(name),
                            server_pid=pids[name],
                            latencies=latencies.setdefault(name, []),
                            client_cpu=own,
                        )
                    )
                    if own:
                        # The load generator's own CPU per reply: is it the limit?
                        cpus.setdefault(f"{name}_{load_name}_loadgen_cpu_us", []).append(own[0])
                    rates.setdefault(f"{name}_{load_name}", []).append(got[name])
                    if cpu is not None:
                        cpus.setdefault(f"{name}_{load_name}_cpu_us", []).append(cpu)
                ratios[load_name].append(got[first] / got[second])
                print(
                    f"round {r + 1}/{args.rounds} ({load_name}) {args.connections} connections x "
                    f"{depth:2} in flight: {first} {got[first]:8,.0f} msg/s, {second} "
                    f"{got[second]:8,.0f} msg/s, ratio {ratios[load_name][-1]:.0%}",
                    flush=True,
                )
        if args.tls:
            for r in range(args.rounds):
                for kind in ("full", "resumed"):
                    own = []
                    rate, cpu, wrong = trio.run(
                        functools.partial(
                            handshakes,
                            "127.0.0.1",
                            ports["tls"],
                            context=contexts["tls"],
                            resume=kind == "resumed",
                            seconds=args.seconds / 2,
                            server_pid=pids["tls"],
                            client_cpu=own,
                        )
                    )
                    if own:
                        cpus.setdefault(f"handshake_{kind}_loadgen_cpu_us", []).append(own[0])
                    if wrong:
                        raise WrongReply(f"{wrong} handshakes were not {kind}")
                    rates.setdefault(f"handshakes_{kind}", []).append(rate)
                    if cpu is not None:
                        cpus.setdefault(f"handshake_{kind}_cpu_us", []).append(cpu)
                ratios.setdefault("handshakes", []).append(
                    rates["handshakes_resumed"][-1] / rates["handshakes_full"][-1]
                )
                print(
                    f"round {r + 1}/{args.rounds} handshakes/s, {HANDSHAKE_CONNECTORS} at once: "
                    f"full {rates['handshakes_full'][-1]:,.0f}, resumed "
                    f"{rates['handshakes_resumed'][-1]:,.0f}, ratio "
                    f"{ratios['handshakes'][-1]:.2f}x",
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
    figures = {key: round(statistics.median(values)) for key, values in rates.items()}
    cpu_figures = {key: round(statistics.median(values), 1) for key, values in cpus.items()}
    if cpu_figures:
        print(
            "median server CPU per reply (per handshake): "
            + ", ".join(f"{key[:-7]} {value:.0f} us" for key, value in cpu_figures.items())
        )
    extra: dict[str, float | str] = {}
    if "handshakes" in ratios:
        extra["tls_key"] = args.tls_key
        extra["ratio_handshakes"] = round(statistics.median(ratios["handshakes"]), 2)
        print(
            f"median handshakes/s: full {figures['handshakes_full']:,}, resumed "
            f"{figures['handshakes_resumed']:,}, ratio {extra['ratio_handshakes']:.2f}x "
            "(target >= 2x)"
        )
        if "handshake_full_cpu_us" in cpu_figures and cpu_figures["handshake_resumed_cpu_us"]:
            # Per handshake of the server's CPU: steadier than the rate on a busy machine.
            extra["ratio_handshake_server_cpu"] = round(
                cpu_figures["handshake_full_cpu_us"] / cpu_figures["handshake_resumed_cpu_us"], 2
            )
            print(
                "server CPU per handshake, full / resumed: "
                f"{extra['ratio_handshake_server_cpu']:.2f}x"
            )
    latency_figures: dict[str, float] = {}
    for name, samples in latencies.items():
        if not samples:
            continue
        p50, p99 = percentile(samples, 0.50), percentile(samples, 0.99)
        latency_figures[f"{name}_a_p50_us"] = round(p50 * 1e6, 1)
        latency_figures[f"{name}_a_p99_us"] = round(p99 * 1e6, 1)
        print(
            f"latency (a) {name}: p50 {p50 * 1e6:,.0f} us, p99 {p99 * 1e6:,.0f} us "
            f"({p99 / p50:.1f}x p50; target <= 3x)"
        )
    ratio_a = statistics.median(ratios["a"])
    ratio_b = statistics.median(ratios["b"])
    print(
        f"median ratio (a) {first}/{second}: {ratio_a:.0%}   (b) {first}/{second}: "
        f"{ratio_b:.0%}   (targets >= {targets['a']:.0%} and {targets['b']:.0%})"
    )
    print(
        json.dumps(
            {
                "mode": "tls" if args.tls else "bare",
                "connections": args.connections,
                "depth": args.depth,
                "seconds": args.seconds,
                "rounds": args.rounds,
                **figures,
                **cpu_figures,
                **latency_figures,
                "ratio_a": round(ratio_a, 3),
                "ratio_b": round(ratio_b, 3),
                **extra,
            }
        )
    )


if __name__ == "__main__":
    main()
