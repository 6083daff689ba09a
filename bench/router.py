"""Measure the LLM router's own overhead per call.

Same run, same loopback fake server (OpenAI wire format, from tests/llm_fakes.py), same
httpx client settings: a bare ``httpx`` POST + JSON decode versus
``router.complete`` on a backend with request, token and concurrency limits
and a price table (so the whole hot path runs: limiter, breaker, accounting,
cost). Rounds alternate between the two; the overhead is the median of the
per-round differences, which cancels most drift from other load on the machine.

A second pair measures the same two paths over ``httpx.MockTransport`` (no
sockets, no server), which isolates the router's cost from network noise.

Usage: python bench/router.py [--rounds N] [--calls N]
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from llm_fakes import openai_ok, start_fake  # noqa: E402

from agentserver.llm import (  # noqa: E402
    BackendConfig,
    Message,
    Price,
    Provider,
    Request,
    Router,
    RouterConfig,
)

BODY_OK = openai_ok("pong", prompt_tokens=12, completion_tokens=3).body


def backend(base_url: str) -> BackendConfig:
    return BackendConfig(
        name="bench",
        provider=Provider.OPENAI,
        base_url=base_url,
        models=("gpt-bench",),
        aliases={"fast": "gpt-bench"},
        api_key_env="BENCH_KEY",
        requests_per_minute=10**9,
        tokens_per_minute=10**12,
        max_concurrent=64,
        price=Price(0.15, 0.60),
    )


async def bare_call(client: httpx.AsyncClient, url: str) -> str:
    body = {
        "model": "gpt-bench",
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 16,
    }
    resp = await client.post(url, json=body, headers={"authorization": "Bearer k"}, timeout=60.0)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


async def measure(rounds: int, calls: int, bare, routed) -> tuple[list[float], list[float]]:
    bare_means: list[float] = []
    router_means: list[float] = []
    for i in range(rounds):
        # Alternate which goes first, so neither always gets the warmer cache.
        order = (
            (("bare", bare), ("router", routed))
            if i % 2 == 0
            else (
                ("router", routed),
                ("bare", bare),
            )
        )
        for name, fn in order:
            t0 = time.perf_counter()
            for _ in range(calls):
                await fn()
            mean = (time.perf_counter() - t0) / calls * 1e6
            (bare_means if name == "bare" else router_means).append(mean)
    return bare_means, router_means


def summarise(bare: list[float], routed: list[float]) -> tuple[float, float, float]:
    """Medians of the round means, and the median of the paired per-round
    differences (pairing cancels drift that affects both halves of a round)."""
    diffs = [r - b for b, r in zip(bare, routed, strict=True)]
    return statistics.median(bare), statistics.median(routed), statistics.median(diffs)


async def loopback(rounds: int, calls: int) -> tuple[float, float, float]:
    async with trio.open_nursery() as nursery:
        fake = await start_fake(nursery, "openai")
        # One reply built (and checked) once: the fake's own cost stays out of the figures.
        reply = openai_ok("pong", prompt_tokens=12, completion_tokens=3)
        fake.default = lambda seen: reply
        url = fake.base_url + "/chat/completions"
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
        async with (
            httpx.AsyncClient(limits=limits) as bare_client,
            httpx.AsyncClient(limits=limits) as router_client,
        ):
            router = Router(
                RouterConfig(backends=(backend(fake.base_url),)),
                environ={"BENCH_KEY": "k"},
                client=router_client,
            )
            request = Request([Message.user("ping")], "fast", max_tokens=16, agent="bench")

            async def bare() -> None:
                await bare_call(bare_client, url)

            async def routed() -> None:
                await router.complete(request)

            for _ in range(200):  # warm up connections, caches
                await bare()
                await routed()
            b, r = await measure(rounds, calls, bare, routed)
            stats = router.stats().backends["bench"].counters
            assert stats.failures == 0, stats
        nursery.cancel_scope.cancel()
    return summarise(b, r)


async def mock_transport(rounds: int, calls: int) -> tuple[float, float, float]:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=BODY_OK, headers={"content-type": "application/json"})

    transport = httpx.MockTransport(handler)
    async with (
        httpx.AsyncClient(transport=transport) as bare_client,
        httpx.AsyncClient(transport=transport) as router_client,
    ):
        router = Router(
            RouterConfig(backends=(backend("http://bench.invalid/v1"),)),
            environ={"BENCH_KEY": "k"},
            client=router_client,
        )
        request = Request([Message.user("ping")], "fast", max_tokens=16, agent="bench")
        url = "http://bench.invalid/v1/chat/completions"

        async def bare() -> None:
            await bare_call(bare_client, url)

        async def routed() -> None:
            await router.complete(request)

        for _ in range(200):
            await bare()
            await routed()
        b, r = await measure(rounds, calls, bare, routed)
    return summarise(b, r)


async def main(rounds: int, calls: int) -> dict[str, float]:
    bare_us, router_us, overhead_us = await loopback(rounds, calls)
    mock_bare_us, mock_router_us, mock_overhead_us = await mock_transport(rounds, calls)
    return {
        "router_overhead_us": round(overhead_us, 1),
        "router_call_us": round(router_us, 1),
        "bare_call_us": round(bare_us, 1),
        "mock_transport_overhead_us": round(mock_overhead_us, 1),
        "mock_router_call_us": round(mock_router_us, 1),
        "mock_bare_call_us": round(mock_bare_us, 1),
        "rounds": rounds,
        "calls_per_round": calls,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    started = time.perf_counter()
    result = trio.run(main, args.rounds, args.calls)
    print(
        f"loopback HTTP:   router {result['router_call_us']:.0f} us/call, "
        f"bare httpx {result['bare_call_us']:.0f} us/call, "
        f"overhead {result['router_overhead_us']:.0f} us/call"
    )
    print(
        f"mock transport:  router {result['mock_router_call_us']:.0f} us/call, "
        f"bare httpx {result['mock_bare_call_us']:.0f} us/call, "
        f"overhead {result['mock_transport_overhead_us']:.0f} us/call"
    )
    print(
        f"({args.rounds} alternating rounds of {args.calls} calls; overhead = median of "
        f"per-round differences; {time.perf_counter() - started:.1f}s)"
    )
    print(json.dumps(result))
