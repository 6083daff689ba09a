"""Benchmark: one MCP tool call through the pump (an ``<mcp>`` tool listener) against the
same call made directly with the SDK's ``Client`` (both in its automatic mode, so both at
the revision the server speaks: 2026-07-28 for the SDK's own server).

A tiny MCP server (written with the SDK's MCPServer, over stdio) offers ``echo``; the
direct path calls it with ``call_tool``; the pump path sends ``<echo>`` payloads to the
``bench-echo`` listener of an in-process topology (``agentserver.testing``): the
envelope, validation against the XSD derived from the tool's JSON Schema, routing, the
payload → JSON conversion, the same kind of SDK call, the ``<result>`` answer. Every
answer is checked, so a broken path fails the run instead of looking fast. Calls are
sequential (latency, not throughput).

Usage: python bench/mcp.py [--calls N] [--rounds R]
The last line printed is one JSON object: ``direct_us`` and ``pump_us`` per call (best
of R rounds, alternated: other processes only ever add time) and ``overhead_us``, their
difference, with ``ratio``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import trio

SERVER = """
from mcp.server.mcpserver import MCPServer
server = MCPServer("bench")

@server.tool(description="Echo the text.")
def echo(text: str, count: int = 1) -> str:
    return text * count

server.run()
"""

BOOT = """<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="bench">
  <listeners>
    <mcp name="bench" command="{python}" args="{server}" concurrency="1"/>
  </listeners>
</organism>"""
NS = "urn:agentserver:mcp:bench"


async def direct(server: pathlib.Path, calls: int) -> float:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=sys.executable, args=[str(server)])
    # As <mcp> connects (agentserver/remote/mcp_client.py): the automatic mode, no cache.
    async with Client(stdio_client(params), mode="auto", cache=None) as session:
        await session.call_tool("echo", {"text": "w"})  # warm
        started = time.perf_counter()
        for _ in range(calls):
            result = await session.call_tool("echo", {"text": "ab", "count": 2})
            assert result.content[0].text == "abab", result
        return (time.perf_counter() - started) / calls


async def through_pump(boot: pathlib.Path, calls: int) -> float:
    from agentserver.testing import in_process

    payload = f'<echo xmlns="{NS}"><text>ab</text><count>2</count></echo>'
    async with in_process(boot) as organism:
        await organism.request(payload, to="bench-echo", timeout=30)  # warm
        started = time.perf_counter()
        for _ in range(calls):
            reply = await organism.request(payload, to="bench-echo", timeout=30)
            assert reply.payload.findtext("{urn:agentserver:mcp}text") == "abab", reply
        return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        server = folder / "bench_server.py"
        server.write_text(SERVER)
        boot = folder / "boot.xml"
        boot.write_text(BOOT.format(python=sys.executable, server=server))
        # Alternated, so a burst of load elsewhere hits both paths alike.
        direct_s = pump_s = float("inf")
        for _ in range(args.rounds):
            direct_s = min(direct_s, trio.run(direct, server, args.calls))
            pump_s = min(pump_s, trio.run(through_pump, boot, args.calls))
    result = {
        "calls": args.calls,
        "rounds": args.rounds,
        "direct_us": round(direct_s * 1e6, 1),
        "pump_us": round(pump_s * 1e6, 1),
        "overhead_us": round((pump_s - direct_s) * 1e6, 1),
        "ratio": round(pump_s / direct_s, 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
