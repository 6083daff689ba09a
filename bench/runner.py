"""Echo through a remote runner over loopback vs the same echo in process, same run.

in-process: ``agentserver run`` (subprocess) with the built-in ``echo`` listener.
remote:     ``agentserver run`` (subprocess) with ``echo`` declared ``remote="true"``,
            served by one ``agentserver runner --handler agentserver.listeners.echo:handle``
            (another subprocess) with ``--concurrency`` = DEPTH.

The load generator (this process) keeps DEPTH requests in flight on one named connection
for S seconds per round and checks every reply: the ``<pong>`` with the request's text on
its thread (a refusal fails the run: a server answering with errors must not look fast). Rounds alternate between the two servers; the figure is the median per path.
Target: remote >= 50% of in-process with 16 jobs in flight.

Usage: python bench/runner.py [--seconds S] [--rounds R] [--depth D]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import trio
from lxml import etree

# wire_bench (its server start/stop) sits next to this file; appended, so that this
# directory's socket.py cannot shadow the standard library's socket module.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from wire_bench import start, stop

from agentserver.core.envelope import build_envelope
from agentserver.core.framing import FrameDecoder, encode_frame
from agentserver.core.namespaces import CORE_NS
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import canonicalize
from agentserver.listeners.echo import Ping, Pong

TOKENS = {"BENCH_CLIENT_TOKEN": "bench-client-token", "BENCH_RUNNER_TOKEN": "bench-runner-token"}


def boot_xml(remote: bool, depth: int) -> str:
    if remote:
        listener = (
            f'<listener name="echo" remote="true" concurrency="{depth}" timeout="30">'
            '<accepts type="echo.ping"/><responds type="echo.pong"/></listener>'
        )
    else:
        listener = f'<listener name="echo" handler="echo" concurrency="{depth}"/>'
    runner = (
        '<client name="echo-runner" token-env="BENCH_RUNNER_TOKEN" serves="echo"/>'
        if remote
        else ""
    )
    return f"""<?xml version="1.0"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="bench">
  <limits drain-timeout="1" max-inflight="{max(64, depth * 2)}"/>
  <clients>
    <client name="bench" token-env="BENCH_CLIENT_TOKEN"/>
    {runner}
  </clients>
  <listeners>{listener}</listeners>
</organism>"""


def _run_args(boot: pathlib.Path) -> list[str]:
    return ["-m", "agentserver", "run", str(boot), "--port", "0"]


def hello_frame() -> bytes:
    hello = etree.Element(f"{{{CORE_NS}}}hello", nsmap={None: CORE_NS})
    etree.SubElement(hello, f"{{{CORE_NS}}}client").text = "bench"
    etree.SubElement(hello, f"{{{CORE_NS}}}token").text = TOKENS["BENCH_CLIENT_TOKEN"]
    return encode_frame(etree.tostring(build_envelope("bench", None, new_thread_id(), hello)))


def cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU seconds of processes ``pids`` (None where /proc is missing)."""
    total = 0.0
    try:
        for pid in pids:
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


async def load(
    port: int, depth: int, seconds: float, pids: list[int]
) -> tuple[float, float | None, list[float | None]]:
    """Closed loop on one named connection with ``depth`` requests outstanding; returns
    checked replies per second over the window (after a warm-up), and the CPU
    microseconds per reply that processes ``pids`` spent in it (the servers' cost,
    which hardly depends on what else the machine runs). The generator frames
    pre-built requests and checks each reply with one byte comparison (the pong with the
    request's text, on its thread), so it costs far less than the servers."""
    thread = new_thread_id()
    body = etree.tostring(build_envelope("bench", "echo", thread, Ping(text="hi").to_xml_tree()))
    frame = encode_frame(body)
    expected = b"<thread>%s</thread></meta>%s</message>" % (
        thread.encode(),
        canonicalize(Pong(text="hi").to_xml_tree()),
    )
    counted = {"n": 0, "measuring": False}
    first = trio.Event()

    async def run(stream: trio.SocketStream) -> None:
        decoder = FrameDecoder(1024 * 1024)
        await stream.send_all(hello_frame() + frame * depth)
        while True:
            data = await stream.receive_some(65536)
            if not data:
                raise RuntimeError("server closed the connection")
            decoder.feed(data)
            frames = decoder.frames()
            for reply in frames:
                if not reply.endswith(expected):
                    raise RuntimeError(f"unexpected reply: {reply[:300]!r}")
            if frames:
                first.set()
                if counted["measuring"]:
                    counted["n"] += len(frames)
                await stream.send_all(frame * len(frames))

    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream, trio.open_nursery() as nursery:
        nursery.start_soon(run, stream)
        with trio.fail_after(60):
            await first.wait()  # the path works (a runner is serving)
        await trio.sleep(min(1.0, seconds / 3))  # warm-up
        counted["measuring"] = True
        cpu_start = cpu_seconds(pids)
        each_start = [cpu_seconds([pid]) for pid in pids]
        began = time.perf_counter()
        await trio.sleep(seconds)
        counted["measuring"] = False
        elapsed = time.perf_counter() - began
        cpu_end = cpu_seconds(pids)
        each_end = [cpu_seconds([pid]) for pid in pids]
        nursery.cancel_scope.cancel()
    n = counted["n"]
    if not n:
        raise RuntimeError("no reply in the window")
    cpu = None if cpu_start is None or cpu_end is None else (cpu_end - cpu_start) / n * 1e6
    # Each process's share (the server's and, on the remote path, the runner's).
    each = [
        None if a is None or b is None else (b - a) / n * 1e6
        for a, b in zip(each_start, each_end, strict=True)
    ]
    return n / elapsed, cpu, each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=16)
    args = parser.parse_args()
    env = {**os.environ, **TOKENS}
    with tempfile.TemporaryDirectory(prefix="bench-runner-") as tmp:
        scratch = pathlib.Path(tmp)
        boots = {}
        for name, remote in (("in_process", False), ("remote", True)):
            boots[name] = scratch / f"{name}.xml"
            boots[name].write_text(boot_xml(remote, args.depth))
        local, local_port = start(_run_args(boots["in_process"]), scratch, env)
        remote, remote_port = start(_run_args(boots["remote"]), scratch, env)
        runner = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentserver",
                "runner",
                "--connect",
                f"127.0.0.1:{remote_port}",
                "--client",
                "echo-runner",
                "--token-env",
                "BENCH_RUNNER_TOKEN",
                "--listener",
                "echo",
                "--handler",
                "agentserver.listeners.echo:handle",
                "--concurrency",
                str(args.depth),
            ],
            cwd=scratch,
            env=env,
        )
        rates: dict[str, list[float]] = {"in_process": [], "remote": []}
        cpus: dict[str, list[float]] = {"in_process": [], "remote": []}
        #: The remote path's CPU per reply, by process (server, runner).
        sides: dict[str, list[float]] = {"server": [], "runner": []}
        paths = (
            ("in_process", local_port, [local.pid]),
            ("remote", remote_port, [remote.pid, runner.pid]),
        )
        try:
            for r in range(args.rounds):
                for name, port, pids in paths:
                    rate, cpu, each = trio.run(load, port, args.depth, args.seconds, pids)
                    rates[name].append(rate)
                    if cpu is not None:
                        cpus[name].append(cpu)
                    shown = f", {cpu:.0f} CPU us/reply" if cpu is not None else ""
                    if name == "remote" and None not in each:
                        sides["server"].append(each[0])
                        sides["runner"].append(each[1])
                        shown += f" (server {each[0]:.0f}, runner {each[1]:.0f})"
                    print(f"round {r + 1} {name}: {rate:.0f} replies/s{shown}", flush=True)
        finally:
            runner.terminate()
            runner.wait(15)
            stop(local)
            stop(remote)
    median = {name: statistics.median(values) for name, values in rates.items()}
    ratio = median["remote"] / median["in_process"]
    cpu = {name: statistics.median(v) if v else None for name, v in cpus.items()}
    print(
        json.dumps(
            {
                "bench": "runner",
                "depth": args.depth,
                "seconds": args.seconds,
                "rounds": args.rounds,
                "in_process_per_s": round(median["in_process"]),
                "remote_per_s": round(median["remote"]),
                "ratio": round(ratio, 3),
                "in_process_cpu_us": round(cpu["in_process"]) if cpu["in_process"] else None,
                "remote_cpu_us": round(cpu["remote"]) if cpu["remote"] else None,
                "remote_server_cpu_us": round(statistics.median(sides["server"]))
                if sides["server"]
                else None,
                "remote_runner_cpu_us": round(statistics.median(sides["runner"]))
                if sides["runner"]
                else None,
                # What the ratio would be with a core per process: CPU per reply only.
                "cpu_ratio": round(cpu["in_process"] / cpu["remote"], 3)
                if cpu["in_process"] and cpu["remote"]
                else None,
                "target": 0.5,
                "meets_target": ratio >= 0.5,
            }
        )
    )


if __name__ == "__main__":
    main()
