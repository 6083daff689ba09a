"""Token and request limits under 50 concurrent callers, on trio's MockClock.

The fake records when each request arrives (virtual time) and what usage it
reports; a limit is respected if, over every interval [t_i, t_j] between two
arrivals, what arrived is at most one minute's limit plus the refill of
t_j - t_i (the token-bucket contract). Callers enqueue in a known order and
must be served in that order.
"""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing
from llm_fakes import Script, backend_for, openai_ok, start_fake

from agentserver.llm import Message, Request, RetryConfig, Router, RouterConfig
from agentserver.llm.tokens import estimate_prompt_tokens

CALLERS = 50


def worst_excess(events: list[tuple[float, float]], per_minute: float) -> float:
    events = sorted(events)
    worst = -float("inf")
    for i in range(len(events)):
        total = 0.0
        for j in range(i, len(events)):
            total += events[j][1]
            allowed = per_minute + per_minute / 60 * (events[j][0] - events[i][0])
            worst = max(worst, total - allowed)
    return worst


async def run_callers(r: Router, max_tokens: int) -> list[int]:
    finished: list[int] = []

    async def caller(i: int) -> None:
        req = Request(
            [Message.user(f"caller {i:02d}")], "m", max_tokens=max_tokens, agent=f"a{i % 5}"
        )
        await r.complete(req)
        finished.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(CALLERS):
            nursery.start_soon(caller, i)
            # Let caller i reach the limiter's queue before caller i+1 starts.
            await trio.testing.wait_all_tasks_blocked()
    return finished


def arrival_order(fake) -> list[tuple[float, int]]:
    out = []
    for seen in fake.requests:
        text = seen.body["messages"][-1]["content"]
        out.append((seen.at, int(text.split()[-1])))
    return out


async def test_request_limit_under_50_callers(nursery, autojump_clock):
    fake = await start_fake(nursery, "openai")
    cfg = RouterConfig(backends=(backend_for(fake, "a", requests_per_minute=10),), timeout=1000)
    async with Router(cfg, environ={}, rng=random.Random(1)) as r:
        finished = await run_callers(r, max_tokens=10)
    assert sorted(finished) == list(range(CALLERS))
    arrivals = arrival_order(fake)
    assert worst_excess([(t, 1) for t, _ in arrivals], 10) <= 1e-6
    # Order kept: arrival time never decreases with the caller's place in line.
    by_caller = sorted(arrivals, key=lambda a: a[1])
    assert [t for t, _ in by_caller] == sorted(t for t, _ in by_caller)
    # And the limit really bit: 10 at once, then one every 6 s.
    assert by_caller[-1][0] == pytest.approx((CALLERS - 10) * 6.0)


async def test_token_limit_under_50_callers(nursery, autojump_clock):
    # Each call reserves its estimate + max_tokens = 100 tokens and reports 60.
    def reply(seen) -> Script:
        return openai_ok("x", prompt_tokens=10, completion_tokens=50)

    fake = await start_fake(nursery, "openai", *[reply] * CALLERS)
    cfg = RouterConfig(
        backends=(backend_for(fake, "a", tokens_per_minute=1000, max_concurrent=50),),
        retry=RetryConfig(max_attempts=1),
        timeout=1000,
    )
    probe = Request([Message.user("caller 00")], "m", max_tokens=1)
    max_tokens = 100 - estimate_prompt_tokens(probe.messages)
    async with Router(cfg, environ={}, rng=random.Random(1)) as r:
        finished = await run_callers(r, max_tokens=max_tokens)
        stats = r.stats()
    assert sorted(finished) == list(range(CALLERS))
    arrivals = arrival_order(fake)
    # What the provider counts (reported usage) never exceeds the limit ...
    assert worst_excess([(t, 60) for t, _ in arrivals], 1000) <= 1e-6
    by_caller = sorted(arrivals, key=lambda a: a[1])
    assert [t for t, _ in by_caller] == sorted(t for t, _ in by_caller)
    # Reconciliation returned 40 of every 100 reserved: 50 calls * 60 = 3000
    # tokens need (3000 - 1000) / (1000/60) = 120 s, not the 240 s that
    # 100-token reservations alone would take.
    assert by_caller[-1][0] == pytest.approx(120.0, abs=7.0)
    assert stats.backends["a"].counters.prompt_tokens == 10 * CALLERS
    assert sum(a.counters.requests for a in stats.agents.values()) == CALLERS


async def test_cancelled_caller_takes_nothing_from_the_router_limits(nursery, autojump_clock):
    fake = await start_fake(nursery, "openai")
    cfg = RouterConfig(backends=(backend_for(fake, "a", requests_per_minute=1),))
    async with Router(cfg, environ={}) as r:
        await r.complete(Request([Message.user("first")], "m"))
        with trio.move_on_after(30):  # would need 60 s
            await r.complete(Request([Message.user("gives up")], "m"))
        assert r.stats().backends["a"].active == 0
        t0 = trio.current_time()
        await r.complete(Request([Message.user("next")], "m"))
    # The one who gave up took nothing: the next waits only the remaining 30 s.
    assert trio.current_time() - t0 == pytest.approx(30.0)
    assert [s.body["messages"][-1]["content"] for s in fake.requests] == ["first", "next"]
