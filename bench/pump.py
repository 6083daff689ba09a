"""Pump throughput vs a plain loop doing the same XML work, measured in the same run.

pump: bytes → parse → validate envelope and payload → route → the built-in echo handler
      (raw element)
      → validate the reply → route back → exclusive C14N serialise, through trio channels.
same-work (the baseline of ``ratio``): the same message through parse → validate envelope
      and payload → the echo handler (it builds the pong) → validate the reply → build the
      reply envelope → C14N, in a plain loop: no scheduler, no routing, no bookkeeping.
half-work (for reference): parse → validate envelope and payload → C14N of the request,
      in a plain loop (the baseline before issue #18: it does no reply work at all).
floor (--floor): the same-work steps through a minimal trio pipeline (see floor_run).

Throughput is measured in this process's CPU time (--wall: wall-clock time): on a machine
shared with other work, CPU time hardly moves when another process takes the core.

latency: load (a) in process: CONNECTIONS endpoints each sending its next ping only once
      it has the pong to the last one; p50 and p99 of request → reply.

traced: the pump with tracing on (--tracing; needs the OpenTelemetry SDK): every message
      gets its span (``handle``), kept by an in-memory exporter.

Usage: python bench/pump.py [--messages N] [--rounds R] [--text-bytes B] [--floor] [--tracing]
       [--connections C] [--latency-seconds S] [--wall]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import trio
from lxml import etree

from agentserver.core.envelope import build_envelope, load_envelope_schema
from agentserver.core.listener import Listener
from agentserver.core.payloads import PayloadType
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser, canonicalize
from agentserver.listeners.echo import Ping, Pong
from agentserver.listeners.echo import respond as echo
from agentserver.observability import Tracing
from agentserver.pump.pump import PumpConfig, open_pump

#: The clock of the throughput figures: this process's CPU time by default (on a shared
#: machine other processes' bursts then hardly move a ratio), wall time with --wall.
CLOCK = [time.process_time]


def message(text_bytes: int = 5, thread: str = "6f1c2b1e-1c1d-4e8e-9f3a-0a6c4d1c2b3a") -> bytes:
    text = "hello" if text_bytes == 5 else ("hello " * (text_bytes // 6 + 1))[:text_bytes]
    return etree.tostring(build_envelope("bench", "echo", thread, Ping(text=text).to_xml_tree()))


def half_work_loop(data: bytes, n: int) -> float:
    parser = SafeParser()
    env_schema = load_envelope_schema()
    ptype = PayloadType.from_model(Ping)
    start = CLOCK[0]()
    for _ in range(n):
        root = parser.parse(data)
        if not env_schema.validate(root) or not ptype.schema.validate(root[1]):
            raise AssertionError("bench message invalid")
        out = canonicalize(root)
    elapsed = CLOCK[0]() - start
    assert out
    return n / elapsed


def same_work_loop(data: bytes, n: int) -> float:
    """What the pump must do per echo, with nothing else: the figure ``ratio`` divides by."""
    parser = SafeParser()
    env_schema = load_envelope_schema()
    ping, pong = PayloadType.from_model(Ping), PayloadType.from_model(Pong)
    start = CLOCK[0]()
    for _ in range(n):
        root = parser.parse(data)
        if not env_schema.validate(root) or not ping.schema.validate(root[1]):
            raise AssertionError("bench message invalid")
        thread = root[0][-1].text
        reply = echo(root[1], None).payload
        if not pong.schema.validate(reply):
            raise AssertionError("reply invalid")
        out = canonicalize(build_envelope("echo", "bench", thread, reply))
    elapsed = CLOCK[0]() - start
    if b"<pong" not in out:
        raise AssertionError(out)
    return n / elapsed


def memory_tracing():
    """Tracing on, spans exported to memory (what the tracing figure measures)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 20))
    return Tracing(provider), exporter


def echo_listener() -> Listener:
    """The built-in echo as the server declares it (the synchronous fast path)."""
    return Listener(
        "echo",
        (Ping,),
        echo,
        responses=(Pong,),
        raw=True,
        sync=True,
        concurrency=4,
        queue_size=256,
    )


async def pump_run(data: bytes, n: int, tracing: Tracing | None = None) -> float:
    listener = echo_listener()
    # Room for every reply: the reader may fall behind the pump (it only counts them).
    config = PumpConfig(endpoint_buffer=n + 16, endpoint_buffer_bytes=n * (2 * len(data) + 512))
    async with open_pump([listener], config=config, tracing=tracing) as pump:
        ep = pump.open_endpoint("bench")
        got = 0
        last = b""

        async def reader() -> None:
            nonlocal got, last
            while got < n:
                # Drain what is ready before waiting, as a socket writer batches its writes.
                try:
                    last = ep.receive_nowait()
                except trio.WouldBlock:
                    last = await ep.receive()
                got += 1

        start = CLOCK[0]()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            for _ in range(n):
                await ep.send(data)
        elapsed = CLOCK[0]() - start
        ep.close()
        # Every message was answered by the handler (no refusal or failure was counted).
        stats = pump.stats()
        if stats["delivered"] != n or stats["refused"] or stats["handler_errors"]:
            raise AssertionError(f"not every message was echoed: {stats}")
        if b"<pong" not in last:
            raise AssertionError(last)
    return n / elapsed


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``samples``, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def latency_run(text_bytes: int, connections: int, seconds: float) -> list[float]:
    """Load (a) in process: ``connections`` endpoints, each with one ping in flight on its
    own thread. Returns the request → reply times (seconds) after a short warm-up; every
    reply must be the pong on the endpoint's thread."""
    listener = echo_listener()
    samples: list[float] = []
    window = {"measuring": False}
    perf_counter = time.perf_counter
    async with open_pump([listener]) as pump:

        async def client(i: int) -> None:
            ep = pump.open_endpoint(f"client-{i}")
            thread = new_thread_id()
            data = message(text_bytes, thread)
            ending = b"<thread>%s</thread></meta><pong" % thread.encode()
            while True:
                sent = perf_counter()
                await ep.send(data)
                reply = await ep.receive()
                if window["measuring"]:
                    samples.append(perf_counter() - sent)
                if ending not in reply:
                    raise AssertionError(f"expected the pong on {thread}, got {reply!r}")

        async with trio.open_nursery() as nursery:
            for i in range(connections):
                nursery.start_soon(client, i)
            await trio.sleep(min(0.5, seconds / 3))
            window["measuring"] = True
            await trio.sleep(seconds)
            window["measuring"] = False
            nursery.cancel_scope.cancel()
    return samples


async def floor_run(data: bytes, n: int) -> float:
    """The pump's XML work (the same parse, validations, echo handler, reply envelope and
    C14N) through two trio channels and three tasks, with the pump's scheduling (no
    checkpoint per message) but no routing, thread registry, metadata or accounting:
    roughly the least any trio pipeline doing this work costs."""
    parser = SafeParser()
    env_schema = load_envelope_schema()
    ping, pong = PayloadType.from_model(Ping), PayloadType.from_model(Pong)
    to_worker, work = trio.open_memory_channel[etree._Element](256)
    to_reader, replies = trio.open_memory_channel[bytes](n + 16)
    thread = "6f1c2b1e-1c1d-4e8e-9f3a-0a6c4d1c2b3a"

    async def worker() -> None:
        streak = 0
        while True:
            try:
                payload = work.receive_nowait()
                streak += 1
                if streak >= 16:
                    streak = 0
                    await trio.lowlevel.checkpoint()
            except trio.WouldBlock:
                try:
                    payload = await work.receive()
                except trio.EndOfChannel:
                    return
            except trio.EndOfChannel:
                return
            out = echo(payload, None).payload
            if not pong.schema.validate(out):
                raise AssertionError("reply invalid")
            to_reader.send_nowait(canonicalize(build_envelope("echo", "bench", thread, out)))

    async def reader() -> None:
        for _ in range(n):
            try:
                replies.receive_nowait()
            except trio.WouldBlock:
                await replies.receive()

    start = CLOCK[0]()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker)
        nursery.start_soon(reader)
        async with to_worker:
            for _ in range(n):
                root = parser.parse(data)
                if not env_schema.validate(root) or not ping.schema.validate(root[1]):
                    raise AssertionError("bench message invalid")
                try:
                    to_worker.send_nowait(root[1])
                except trio.WouldBlock:
                    await to_worker.send(root[1])
    return n / (CLOCK[0]() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument(
        "--rounds", type=int, default=5, help="alternating rounds; the best of each is kept"
    )
    ap.add_argument(
        "--text-bytes",
        type=int,
        default=5,
        help="length of the ping's text (default 5: 'hello', a 224-byte message)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also measure the same XML work through a minimal trio pipeline (see floor_run)",
    )
    ap.add_argument(
        "--tracing",
        action="store_true",
        help="also run the pump with tracing on (OpenTelemetry SDK, spans kept in memory)",
    )
    ap.add_argument("--connections", type=int, default=50, help="endpoints in the latency load (a)")
    ap.add_argument(
        "--latency-seconds", type=float, default=2.0, help="measured seconds of load (a)"
    )
    ap.add_argument(
        "--wall",
        action="store_true",
        help="throughput by wall-clock time instead of this process's CPU time",
    )
    args = ap.parse_args()
    if args.wall:
        CLOCK[0] = time.perf_counter
    data = message(args.text_bytes)
    print(f"message: {len(data)} bytes; {args.messages:,} messages per run")
    rates: dict[str, list[float]] = {
        "pump": [],
        "same": [],
        "half": [],
        "floor": [],
        "traced": [],
    }
    spans = 0
    for r in range(args.rounds):
        rates["same"].append(same_work_loop(data, args.messages))
        rates["pump"].append(trio.run(pump_run, data, args.messages))
        rates["half"].append(half_work_loop(data, args.messages))
        line = (
            f"pump {rates['pump'][-1]:,.0f} msg/s, same-work {rates['same'][-1]:,.0f} msg/s, "
            f"half-work {rates['half'][-1]:,.0f} msg/s"
        )
        if args.tracing:
            tracing, exporter = memory_tracing()
            rates["traced"].append(trio.run(pump_run, data, args.messages, tracing))
            tracing.shutdown()  # flushes the batch processor
            spans = len(exporter.get_finished_spans())
            if spans != args.messages:  # one handle span per message
                raise AssertionError(f"tracing on recorded {spans} spans")
            line += f", traced {rates['traced'][-1]:,.0f} msg/s"
        if args.floor:
            rates["floor"].append(trio.run(floor_run, data, args.messages))
            line += f", floor {rates['floor'][-1]:,.0f} msg/s"
        print(f"round {r + 1}/{args.rounds}: {line}", flush=True)
    pump_best, same_best, half_best = max(rates["pump"]), max(rates["same"]), max(rates["half"])
    ratio = pump_best / same_best
    print(
        f"pump {pump_best:,.0f} msg/s vs same-work loop {same_best:,.0f} msg/s: ratio "
        f"{ratio:.2f} (target >= 0.65); half-work loop {half_best:,.0f} msg/s"
    )
    figures: dict[str, object] = {
        "message_bytes": len(data),
        "clock": "wall" if args.wall else "cpu",
    }
    if args.floor:
        floor_best = max(rates["floor"])
        figures["floor_msgs_per_s"] = round(floor_best)
        figures["floor_ratio"] = round(floor_best / same_best, 3)
        print(f"floor {floor_best:,.0f} msg/s: ratio {floor_best / same_best:.2f}")
    if args.tracing:
        traced_best = max(rates["traced"])
        cost = 1 - traced_best / pump_best
        figures["traced_msgs_per_s"] = round(traced_best)
        figures["tracing_on_cost"] = round(cost, 3)
        figures["spans_per_run"] = spans
        print(f"tracing on: {traced_best:,.0f} msg/s, {cost:.1%} below tracing off (target < 25%)")
    samples = trio.run(latency_run, args.text_bytes, args.connections, args.latency_seconds)
    p50, p99 = percentile(samples, 0.50), percentile(samples, 0.99)
    print(
        f"load (a), {args.connections} endpoints x 1 in flight: {len(samples) / args.latency_seconds:,.0f}"
        f" msg/s, p50 {p50 * 1e6:,.0f} us, p99 {p99 * 1e6:,.0f} us ({p99 / p50:.1f}x p50; "
        "target <= 3x)"
    )
    figures.update(
        pump_msgs_per_s=round(pump_best),
        baseline_msgs_per_s=round(same_best),
        half_work_msgs_per_s=round(half_best),
        half_work_ratio=round(pump_best / half_best, 3),
        latency_a_p50_us=round(p50 * 1e6, 1),
        latency_a_p99_us=round(p99 * 1e6, 1),
        ratio=round(ratio, 3),
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
