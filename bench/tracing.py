"""What tracing costs the echo pump, and how much of it is the OpenTelemetry SDK's floor.

All in one run, alternating, the best of each kept (bench/pump.py's echo pipeline):

pump:     the pump with tracing off (no ``Tracing`` given).
off:      the pump with ``Tracing.from_environ({})``: the SDK installed, no ``OTEL_*``
          variable set, so tracing is off (what a server without tracing configured runs).
batch:    tracing on, every ``handle`` span kept by an in-memory exporter behind a
          ``BatchSpanProcessor`` (what ``Tracing.from_environ`` builds, with OTLP).
simple:   the same behind a ``SimpleSpanProcessor`` (exports each span as it ends).
floor:    no pump: one bare SDK span per message (start and end, nothing else) on the
          batch provider: the least one span per message can cost with this SDK.
ours:     no pump: the same span as the pump makes it (``Tracing.start_handle``: name,
          kind, three attributes; made current and back; ended).

Costs are ``1 - traced rate / pump rate``; for floor and ours, the rate the pump would have
if it added that per-message time and nothing else: ``t_span / (t_pump + t_span)``.
Sampler: the SDK default, parent-based always-on (every span recorded; nothing sampled out).

Usage: python bench/tracing.py [--messages N] [--rounds R]
The last line printed is one JSON object with the figures. Needs ``agentserver[otel]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import trio

# bench/pump.py sits next to this file; appended, so that this directory's http.py and
# socket.py never shadow the standard modules.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from pump import message, pump_run

from agentserver.observability import Tracing
from agentserver.observability.tracing import attach, detach

ON_TARGET = 0.25
OFF_TARGET = 0.02


def memory_provider(processor: str):
    """An SDK provider whose spans go to memory through ``processor`` (batch|simple)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    if processor == "batch":
        provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 20))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def traced_run(data: bytes, n: int, processor: str) -> float:
    gc.collect()
    provider, exporter = memory_provider(processor)
    tracing = Tracing(provider)
    rate = trio.run(pump_run, data, n, tracing)
    tracing.shutdown()  # flushes a batch processor
    spans = len(exporter.get_finished_spans())
    if spans != n:  # one handle span per message, none sampled out
        raise AssertionError(f"{processor}: {spans} spans for {n} messages")
    return rate


def span_seconds(n: int, *, like_pump: bool) -> float:
    """Seconds per span: a bare start/end (``like_pump`` False), or the pump's own span
    (``Tracing.start_handle`` + attach/detach + end)."""
    from opentelemetry import context as otel_context

    provider, exporter = memory_provider("batch")
    tracing = Tracing(provider)
    thread = "6f1c2b1e-1c1d-4e8e-9f3a-0a6c4d1c2b3a"
    start = time.perf_counter()
    if like_pump:
        for _ in range(n):
            span = tracing.start_handle("echo", None, "bench", thread, True)
            token = attach(span)
            detach(token)
            span.end()
    else:
        tracer, root = tracing.tracer, otel_context.Context()
        for _ in range(n):
            tracer.start_span("handle echo", context=root).end()
    elapsed = time.perf_counter() - start
    tracing.shutdown()
    if len(exporter.get_finished_spans()) != n:
        raise AssertionError("spans lost")
    return elapsed / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=10_000)
    ap.add_argument(
        "--rounds", type=int, default=5, help="alternating rounds; the best of each is kept"
    )
    args = ap.parse_args()
    data, n = message(), args.messages
    print(f"message: {len(data)} bytes; {n:,} messages per run")
    rates: dict[str, list[float]] = {"pump": [], "off": [], "batch": [], "simple": []}
    secs: dict[str, list[float]] = {"floor": [], "ours": []}
    off = Tracing.from_environ({})
    assert not off.enabled
    for r in range(args.rounds):
        # pump and off are the same code path: alternate which goes first, and start each
        # run with the previous run's garbage collected, so neither inherits a handicap.
        for name in ("pump", "off") if r % 2 == 0 else ("off", "pump"):
            gc.collect()
            rates[name].append(trio.run(pump_run, data, n, None if name == "pump" else off))
        gc.collect()
        rates["batch"].append(traced_run(data, n, "batch"))
        rates["simple"].append(traced_run(data, n, "simple"))
        secs["floor"].append(span_seconds(n, like_pump=False))
        secs["ours"].append(span_seconds(n, like_pump=True))
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{k} {v[-1]:,.0f} msg/s" for k, v in rates.items())
            + ", "
            + ", ".join(f"{k} {v[-1] * 1e6:.1f} us/span" for k, v in secs.items())
        )
    best = {k: max(v) for k, v in rates.items()}
    span = {k: min(v) for k, v in secs.items()}
    t_pump = 1 / best["pump"]
    figures: dict[str, object] = {
        "messages": n,
        "pump_msgs_per_s": round(best["pump"]),
        "pump_us_per_msg": round(t_pump * 1e6, 1),
        "off_cost": round(1 - best["off"] / best["pump"], 3),
        "on_cost_batch": round(1 - best["batch"] / best["pump"], 3),
        "on_cost_simple": round(1 - best["simple"] / best["pump"], 3),
        "span_floor_us": round(span["floor"] * 1e6, 1),
        "span_ours_us": round(span["ours"] * 1e6, 1),
        "floor_cost": round(span["floor"] / (t_pump + span["floor"]), 3),
        "ours_cost": round(span["ours"] / (t_pump + span["ours"]), 3),
    }
    print(
        f"pump {best['pump']:,.0f} msg/s ({t_pump * 1e6:.0f} us/msg); "
        f"tracing off costs {figures['off_cost']:.1%} (target < {OFF_TARGET:.0%}); "
        f"on costs {figures['on_cost_batch']:.1%} with the batch processor, "
        f"{figures['on_cost_simple']:.1%} with the simple one (target < {ON_TARGET:.0%})"
    )
    print(
        f"SDK floor: a bare span costs {figures['span_floor_us']} us = "
        f"{figures['floor_cost']:.1%} of the pump's rate; the pump's span as made "
        f"(attributes, context) {figures['span_ours_us']} us = {figures['ours_cost']:.1%}"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
