"""Pump throughput vs the bare lxml loop, measured in the same run.

pump: bytes → parse → validate envelope and payload → route → echo handler (raw element)
      → validate the reply → route back → exclusive C14N serialise, through trio channels.
bare: the same message through parse → validate envelope and payload → C14N → serialise,
      in a plain loop.

Usage: python bench/pump.py [--messages N] [--rounds R]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import trio
from lxml import etree
from pydantic_xml import BaseXmlModel, element

from agentserver.envelope import build_envelope, load_envelope_schema
from agentserver.listener import HandlerResponse, Listener
from agentserver.payloads import PayloadType
from agentserver.pump import PumpConfig, open_pump
from agentserver.xmlsafe import SafeParser, canonicalize

NS = "urn:agentserver:bench"


class Ping(BaseXmlModel, tag="ping", nsmap={"": NS}):
    text: str = element()


class Pong(BaseXmlModel, tag="pong", nsmap={"": NS}):
    text: str = element()


PONG = f"{{{NS}}}pong"
TEXT = f"{{{NS}}}text"


def _pong_template() -> etree._Element:
    pong = etree.Element(PONG, nsmap={None: NS})
    etree.SubElement(pong, TEXT)
    return pong


PONG_TEMPLATE = _pong_template()


async def echo(payload: etree._Element, meta) -> HandlerResponse:
    # A raw handler builds its reply from a prepared tree (cheaper than new elements).
    pong = PONG_TEMPLATE.__deepcopy__(None)
    pong[0].text = payload[0].text
    return HandlerResponse.respond(pong)


def message() -> bytes:
    return etree.tostring(
        build_envelope(
            "bench",
            "echo",
            "6f1c2b1e-1c1d-4e8e-9f3a-0a6c4d1c2b3a",
            Ping(text="hello").to_xml_tree(),
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


async def pump_run(data: bytes, n: int) -> float:
    listener = Listener(
        "echo", (Ping,), echo, responses=(Pong,), raw=True, concurrency=4, queue_size=256
    )
    async with open_pump([listener], config=PumpConfig(endpoint_buffer=n + 16)) as pump:
        ep = pump.open_endpoint("bench")
        got = 0

        async def reader() -> None:
            nonlocal got
            while got < n:
                # Drain what is ready before waiting, as a socket writer batches its writes.
                try:
                    reply = ep.receive_nowait()
                except trio.WouldBlock:
                    reply = await ep.receive()
                if b"<pong" not in reply:
                    raise AssertionError(reply)
                got += 1

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            for _ in range(n):
                await ep.send(data)
        elapsed = time.perf_counter() - start
        ep.close()
    return n / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    data = message()
    pump_rates, bare_rates = [], []
    for r in range(args.rounds):
        bare_rates.append(bare_loop(data, args.messages))
        pump_rates.append(trio.run(pump_run, data, args.messages))
        print(
            f"round {r + 1}/{args.rounds}: pump {pump_rates[-1]:,.0f} msg/s, bare {bare_rates[-1]:,.0f} msg/s"
        )
    pump_best, bare_best = max(pump_rates), max(bare_rates)
    ratio = pump_best / bare_best
    print(
        f"pump {pump_best:,.0f} msg/s vs bare loop {bare_best:,.0f} msg/s: ratio {ratio:.2f} (target >= 0.50)"
    )
    print(
        json.dumps(
            {
                "pump_msgs_per_s": round(pump_best),
                "baseline_msgs_per_s": round(bare_best),
                "ratio": round(ratio, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
