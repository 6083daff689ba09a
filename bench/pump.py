"""Pump throughput vs the bare lxml loop, measured in the same run.

pump: bytes → parse → validate envelope and payload → route → the built-in echo handler
      (raw element)
      → validate the reply → route back → exclusive C14N serialise, through trio channels.
bare: the same message through parse → validate envelope and payload → C14N → serialise,
      in a plain loop.

traced: the pump with tracing on (--tracing; needs the OpenTelemetry SDK): every message
      gets its span (``handle``), kept by an in-memory exporter.

Usage: python bench/pump.py [--messages N] [--rounds R] [--text-bytes B] [--floor] [--tracing]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import trio
from lxml import etree

from agentserver.envelope import build_envelope, load_envelope_schema
from agentserver.listener import Listener
from agentserver.listeners.echo import Ping, Pong
from agentserver.listeners.echo import handle as echo
from agentserver.observability import Tracing
from agentserver.payloads import PayloadType
from agentserver.pump import PumpConfig, open_pump
from agentserver.xmlsafe import SafeParser, canonicalize


def message(text_bytes: int = 5) -> bytes:
    text = "hello" if text_bytes == 5 else ("hello " * (text_bytes // 6 + 1))[:text_bytes]
    return etree.tostring(
        build_envelope(
            "bench",
            "echo",
            "6f1c2b1e-1c1d-4e8e-9f3a-0a6c4d1c2b3a",
            Ping(text=text).to_xml_tree(),
        )
    )


def bare_loop(data: bytes, n: int) -> float:
    parser = SafeParser()
    env_schema = load_envelope_schema()
    ptype = PayloadType.from_model(Ping)
    start = time.perf_counter()
    for _ in range(n):
        root = parser.parse(data)
        if not env_schema.validate(root) or not ptype.schema.validate(root[1]):
            raise AssertionError("bench message invalid")
        out = canonicalize(root)
    elapsed = time.perf_counter() - start
    assert out
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


async def pump_run(data: bytes, n: int, tracing: Tracing | None = None) -> float:
    listener = Listener(
        "echo", (Ping,), echo, responses=(Pong,), raw=True, concurrency=4, queue_size=256
    )
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

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            for _ in range(n):
                await ep.send(data)
        elapsed = time.perf_counter() - start
        ep.close()
        # Every message was answered by the handler (no refusal or failure was counted).
        stats = pump.stats()
        if stats["delivered"] != n or stats["refused"] or stats["handler_errors"]:
            raise AssertionError(f"not every message was echoed: {stats}")
        if b"<pong" not in last:
            raise AssertionError(last)
    return n / elapsed


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
            out = (await echo(payload, None)).payload
            if not pong.schema.validate(out):
                raise AssertionError("reply invalid")
            to_reader.send_nowait(canonicalize(build_envelope("echo", "bench", thread, out)))

    async def reader() -> None:
        for _ in range(n):
            try:
                replies.receive_nowait()
            except trio.WouldBlock:
                await replies.receive()

    start = time.perf_counter()
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
    return n / (time.perf_counter() - start)


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
    args = ap.parse_args()
    data = message(args.text_bytes)
    print(f"message: {len(data)} bytes; {args.messages:,} messages per run")
    rates: dict[str, list[float]] = {"pump": [], "bare": [], "floor": [], "traced": []}
    spans = 0
    for r in range(args.rounds):
        rates["bare"].append(bare_loop(data, args.messages))
        rates["pump"].append(trio.run(pump_run, data, args.messages))
        line = f"pump {rates['pump'][-1]:,.0f} msg/s, bare {rates['bare'][-1]:,.0f} msg/s"
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
        print(f"round {r + 1}/{args.rounds}: {line}")
    pump_best, bare_best = max(rates["pump"]), max(rates["bare"])
    ratio = pump_best / bare_best
    print(
        f"pump {pump_best:,.0f} msg/s vs bare loop {bare_best:,.0f} msg/s: ratio {ratio:.2f} (target >= 0.50)"
    )
    figures: dict[str, object] = {"message_bytes": len(data)}
    if args.floor:
        floor_best = max(rates["floor"])
        figures["floor_msgs_per_s"] = round(floor_best)
        figures["floor_ratio"] = round(floor_best / bare_best, 3)
        print(f"floor {floor_best:,.0f} msg/s: ratio {floor_best / bare_best:.2f}")
    if args.tracing:
        traced_best = max(rates["traced"])
        cost = 1 - traced_best / pump_best
        figures["traced_msgs_per_s"] = round(traced_best)
        figures["tracing_on_cost"] = round(cost, 3)
        figures["spans_per_run"] = spans
        print(f"tracing on: {traced_best:,.0f} msg/s, {cost:.1%} below tracing off (target < 25%)")
    figures.update(
        pump_msgs_per_s=round(pump_best),
        baseline_msgs_per_s=round(bare_best),
        ratio=round(ratio, 3),
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
