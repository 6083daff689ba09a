"""Router scenarios against loopback fakes, on trio's MockClock (time is virtual).

Arrival times recorded by the fakes are on the same clock as the router's
sleeps, so "the router waited exactly what the header said" is an equality.
"""

from __future__ import annotations

import itertools
import random

import pytest
import trio
import trio.testing
from llm_fakes import (
    FakeServer,
    Script,
    anthropic_error,
    anthropic_stream,
    backend_for,
    ollama_stream,
    openai_error,
    openai_ok,
    openai_stream,
    start_fake,
)

from agentserver.llm import (
    BreakerConfig,
    Completion,
    ErrorKind,
    LLMError,
    Message,
    Price,
    Request,
    RetryConfig,
    Router,
    RouterConfig,
    Strategy,
)


def router(
    *backends, strategy=Strategy.FAILOVER, retry=None, breaker=None, timeout=600.0, env=None
):
    cfg = RouterConfig(
        backends=tuple(backends),
        strategy=strategy,
        retry=retry or RetryConfig(max_attempts=4, base_delay=1.0, max_delay=8.0),
        breaker=breaker or BreakerConfig(failures=3, cooldown=30.0),
        timeout=timeout,
    )
    return Router(cfg, environ=env or {}, rng=random.Random(7))


def req(text="hi", model="m", **kw) -> Request:
    return Request([Message.user(text)], model=model, **kw)


def gaps(fake: FakeServer) -> list[float]:
    times = [r.at for r in fake.requests]
    return [b - a for a, b in itertools.pairwise(times)]


def rate_limited(seconds: str, **kw) -> Script:
    return openai_error(
        429,
        "Rate limit reached",
        type="requests",
        code="rate_limit_exceeded",
        headers=[("retry-after", seconds)],
        **kw,
    )


QUOTA = openai_error(
    429,
    "You exceeded your current quota, please check your plan and billing details.",
    type="insufficient_quota",
    code="insufficient_quota",
)
OVERLOADED = openai_error(503, "The server is overloaded", type="server_error")


# -- Retry-After ------------------------------------------------------------------


async def test_429_retry_after_sleep_matches_that_responses_header(nursery, autojump_clock):
    fake = await start_fake(
        nursery, "openai", rate_limited("7"), rate_limited("3"), openai_ok("done")
    )
    async with router(backend_for(fake, "a")) as r:
        out = await r.complete(req())
    assert out.content == "done" and out.attempts == 3
    assert gaps(fake) == [pytest.approx(7.0), pytest.approx(3.0)]
    assert out.latency == pytest.approx(10.0)
    assert r.stats().backends["a"].counters.errors == {"RATE_LIMIT": 2}


async def test_retry_after_ms_is_preferred(nursery, autojump_clock):
    fake = await start_fake(
        nursery,
        "openai",
        openai_error(429, "slow", headers=[("retry-after", "2"), ("retry-after-ms", "1500")]),
    )
    async with router(backend_for(fake, "a")) as r:
        await r.complete(req())
    assert gaps(fake) == [pytest.approx(1.5)]


async def test_retry_after_beyond_cap_fails_over_at_once(nursery, autojump_clock):
    a = await start_fake(nursery, "openai", rate_limited("120"))
    b = await start_fake(nursery, "openai")
    async with router(backend_for(a, "a", priority=1), backend_for(b, "b", priority=2)) as r:
        out = await r.complete(req())
        assert out.backend == "b" and out.latency == 0.0
        # The backend cools for everyone, but only as long as max-retry-after (30 s).
        assert r.stats().backends["a"].cooling_for == pytest.approx(30.0)
        again = await r.complete(req())
    assert again.backend == "b" and len(a.requests) == 1


async def test_retry_after_beyond_cap_with_one_backend_raises_with_the_wait(
    nursery, autojump_clock
):
    a = await start_fake(nursery, "openai", rate_limited("120"))
    async with router(backend_for(a, "a")) as r:
        with pytest.raises(LLMError) as info:
            await r.complete(req())
    err = info.value
    assert (err.kind, err.status, err.backend, err.retry_after) == (
        ErrorKind.RATE_LIMIT,
        429,
        "a",
        120.0,
    )
    assert trio.current_time() == 0.0 and len(a.requests) == 1


async def test_retry_after_of_an_hour_cools_for_the_cap_then_lets_one_probe_through(
    nursery, autojump_clock
):
    # One 429 asking for an hour must not take the backend out for an hour: it cools for
    # max-retry-after (30 s), then exactly one probe goes out and the rest follow its answer.
    fake = await start_fake(nursery, "openai", rate_limited("3600"))
    async with router(backend_for(fake, "a"), breaker=BreakerConfig(failures=10)) as r:
        with pytest.raises(LLMError) as info:
            await r.complete(req())
        assert info.value.kind is ErrorKind.RATE_LIMIT and info.value.retry_after == 3600.0
        assert r.stats().backends["a"].cooling_for == pytest.approx(30.0)
        fake.push(openai_ok("probe", delay=5.0))
        results: list[Completion] = []

        async def caller() -> None:
            results.append(await r.complete(req(deadline=trio.current_time() + 120)))

        async with trio.open_nursery() as callers:
            for _ in range(4):
                callers.start_soon(caller)
        assert r.stats().backends["a"].cooling_for == 0.0
    arrivals = [s.at for s in fake.requests[1:]]
    assert arrivals[0] == pytest.approx(30.0)  # the probe, when the capped cooling ends
    assert all(t == pytest.approx(35.0) for t in arrivals[1:])  # the rest after its answer
    assert len(arrivals) == 4 and sorted(c.content for c in results)[-1] == "probe"


async def test_rate_limited_probe_cools_again_and_others_keep_waiting(nursery, autojump_clock):
    fake = await start_fake(nursery, "openai", rate_limited("3600"), rate_limited("3600"))
    retry = RetryConfig(max_attempts=1, max_retry_after=20.0)
    async with router(backend_for(fake, "a"), retry=retry, breaker=BreakerConfig(failures=10)) as r:
        with pytest.raises(LLMError):
            await r.complete(req())
        results: list[Completion | LLMError] = []

        async def caller() -> None:
            try:
                results.append(await r.complete(req(deadline=trio.current_time() + 100)))
            except LLMError as err:
                results.append(err)

        async with trio.open_nursery() as callers:
            for _ in range(3):
                callers.start_soon(caller)
    times = [s.at for s in fake.requests]
    # t=0 the 429; t=20 the probe, 429 again (that caller's budget of one call is spent);
    # t=40 the next probe succeeds, then the last caller goes.
    assert times == [0.0, pytest.approx(20.0), pytest.approx(40.0), pytest.approx(40.0)]
    assert sum(isinstance(x, Completion) for x in results) == 2


async def test_abandoned_cooling_probe_passes_to_the_next_caller(nursery, autojump_clock):
    fake = await start_fake(nursery, "openai", rate_limited("3600"))
    retry = RetryConfig(max_attempts=1, max_retry_after=10.0)
    async with router(backend_for(fake, "a"), retry=retry, breaker=BreakerConfig(failures=10)) as r:
        with pytest.raises(LLMError):
            await r.complete(req())
        fake.push(openai_ok("slow", delay=50.0))
        with trio.move_on_after(12):  # the probe goes at t=10 and is cancelled at t=12
            await r.complete(req(deadline=trio.current_time() + 100))
        out = await r.complete(req(deadline=trio.current_time() + 100))
    assert out.content != "slow" and [s.at for s in fake.requests][1:] == [
        pytest.approx(10.0),
        pytest.approx(12.0),
    ]


async def test_backoff_without_header_is_exponential_with_jitter(nursery, autojump_clock):
    fake = await start_fake(
        nursery,
        "openai",
        openai_error(500, "oops", type="server_error"),
        openai_error(500, "oops", type="server_error"),
        openai_error(500, "oops", type="server_error"),
    )
    async with router(backend_for(fake, "a"), breaker=BreakerConfig(failures=10)) as r:
        await r.complete(req())
    g = gaps(fake)
    assert len(g) == 3
    for i, gap in enumerate(g):
        assert 2**i / 2 <= gap <= 2**i  # base 1 s, equal jitter


# -- BILLING ----------------------------------------------------------------------


async def test_429_insufficient_quota_is_billing_no_retry_failover(nursery, autojump_clock):
    a = await start_fake(nursery, "openai", QUOTA)
    b = await start_fake(nursery, "openai", openai_ok("from b"))
    async with router(backend_for(a, "a", priority=1), backend_for(b, "b", priority=2)) as r:
        out = await r.complete(req())
        stats = r.stats()
    assert (out.backend, out.content, out.attempts) == ("b", "from b", 2)
    assert len(a.requests) == 1 and out.latency == 0.0  # no retry, no wait
    assert stats.backends["a"].counters.errors == {"BILLING": 1}
    assert stats.backends["a"].breaker == "closed"


async def test_billing_alone_raises_after_one_call(nursery, autojump_clock):
    a = await start_fake(nursery, "openai", QUOTA, openai_ok())
    async with router(backend_for(a, "a")) as r:
        with pytest.raises(LLMError) as info:
            await r.complete(req(agent="scribe"))
        assert r.stats().agents["scribe"].counters.errors == {"BILLING": 1}
    assert info.value.kind is ErrorKind.BILLING and info.value.status == 429
    assert "exceeded your current quota" in info.value.provider_message
    assert len(a.requests) == 1


# -- breaker ------------------------------------------------------------------------


async def test_503_three_times_opens_breaker_then_one_probe(nursery, autojump_clock):
    fake = await start_fake(
        nursery, "openai", OVERLOADED, OVERLOADED, OVERLOADED, openai_ok("back")
    )
    breaker = BreakerConfig(failures=3, cooldown=30.0)
    retry = RetryConfig(max_attempts=4, base_delay=1.0, max_delay=1.0)
    async with router(backend_for(fake, "a"), retry=retry, breaker=breaker) as r:
        out = await r.complete(req())
        stats = r.stats().backends["a"]
    assert out.content == "back" and out.attempts == 4
    times = [s.at for s in fake.requests]
    # Two backoffs of 0.5-1 s, then the breaker opened at the third failure and
    # the fourth call is the probe, exactly one cooldown later.
    assert times[3] - times[2] == pytest.approx(30.0)
    assert stats.breaker == "closed" and stats.breaker_opens == 1


async def test_open_breaker_lets_exactly_one_probe_through(nursery, autojump_clock):
    fake = await start_fake(nursery, "openai", OVERLOADED, OVERLOADED, OVERLOADED)
    breaker = BreakerConfig(failures=3, cooldown=30.0)
    retry = RetryConfig(max_attempts=3, base_delay=1.0, max_delay=1.0)
    async with router(backend_for(fake, "a"), retry=retry, breaker=breaker) as r:
        with pytest.raises(LLMError):
            await r.complete(req())  # budget of 3 spent: breaker now open
        opened = fake.requests[-1].at
        assert r.stats().backends["a"].breaker == "open"
        # The probe is slow; four more callers arrive while the breaker is open.
        fake.push(openai_ok("probe", delay=5.0))
        results: list[Completion] = []

        async def caller() -> None:
            results.append(await r.complete(req()))

        async with trio.open_nursery() as callers:
            for _ in range(4):
                callers.start_soon(caller)
    arrivals = [s.at - opened for s in fake.requests[3:]]
    assert arrivals[0] == pytest.approx(30.0)  # one probe at the end of the cooldown
    assert all(t == pytest.approx(35.0) for t in arrivals[1:])  # the rest after it succeeded
    assert len(results) == 4


async def test_failed_probe_reopens_and_others_keep_waiting(nursery, autojump_clock):
    fake = await start_fake(nursery, "openai", OVERLOADED, OVERLOADED)
    breaker = BreakerConfig(failures=1, cooldown=10.0)
    retry = RetryConfig(max_attempts=2, base_delay=1.0, max_delay=1.0)
    async with router(backend_for(fake, "a"), retry=retry, breaker=breaker) as r:
        # call 1 fails and opens; call 2 (probe at t=10) fails and reopens; budget spent
        with pytest.raises(LLMError) as info:
            await r.complete(req())
        assert info.value.kind is ErrorKind.OVERLOADED
        assert [s.at for s in fake.requests] == [0.0, pytest.approx(10.0)]
        # A new request must wait for the next probe window at t=20.
        out = await r.complete(req())
    assert out.latency == pytest.approx(10.0) and fake.requests[-1].at == pytest.approx(20.0)


# -- context overflow ------------------------------------------------------------------


async def test_context_overflow_never_goes_to_a_smaller_window(nursery, autojump_clock):
    mid = await start_fake(
        nursery,
        "anthropic",
        anthropic_error(400, "prompt is too long: 9000 tokens > 8192 maximum"),
    )
    small = await start_fake(nursery, "openai")
    big = await start_fake(nursery, "openai", openai_ok("big enough"))
    async with router(
        backend_for(mid, "mid", priority=1, context_window=8192),
        backend_for(small, "small", priority=2, context_window=4096),
        backend_for(big, "big", priority=3, context_window=128000),
    ) as r:
        out = await r.complete(req())
    assert out.backend == "big" and out.attempts == 2
    assert len(small.requests) == 0 and len(mid.requests) == 1


async def test_context_overflow_without_larger_window_stops(nursery, autojump_clock):
    big = await start_fake(
        nursery,
        "openai",
        openai_error(
            400,
            "This model's maximum context length is 128000 tokens.",
            code="context_length_exceeded",
        ),
    )
    small = await start_fake(nursery, "openai")
    unknown = await start_fake(nursery, "openai")
    async with router(
        backend_for(big, "big", priority=1, context_window=128000),
        backend_for(small, "small", priority=2, context_window=8192),
        backend_for(unknown, "unknown", priority=3),
    ) as r:
        with pytest.raises(LLMError) as info:
            await r.complete(req())
    assert info.value.kind is ErrorKind.CONTEXT_OVERFLOW and info.value.backend == "big"
    assert len(small.requests) == 0 and len(unknown.requests) == 0


# -- timeouts ------------------------------------------------------------------------------


async def test_timeout_fails_over(nursery, autojump_clock):
    slow = await start_fake(nursery, "openai", openai_ok(delay=100.0))
    ok = await start_fake(nursery, "ollama")
    async with router(
        backend_for(slow, "slow", priority=1, timeout=5.0), backend_for(ok, "ok", priority=2)
    ) as r:
        out = await r.complete(req("x"))
        stats = r.stats()
    assert (out.backend, out.content) == ("ok", "echo: x")
    assert out.latency == pytest.approx(5.0)
    assert stats.backends["slow"].counters.errors == {"TIMEOUT": 1}
    assert stats.backends["slow"].consecutive_failures == 1


async def test_connection_refused_fails_over(nursery, autojump_clock):
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = FakeServer("openai")
    dead.port = port
    ok = await start_fake(nursery, "openai")
    async with router(
        backend_for(dead, "dead", priority=1), backend_for(ok, "ok", priority=2)
    ) as r:
        out = await r.complete(req())
        errors = r.stats().backends["dead"].counters.errors
    assert out.backend == "ok" and errors == {"UNREACHABLE": 1}
    assert trio.current_time() < 0.1  # at once: no backoff before failing over


async def test_unreachable_backend_with_open_breaker_fails_at_once(nursery, autojump_clock):
    # Three refused connections open the breaker; then requests fail at once (no wait for
    # the probe: a backend that is down is not busy), until the cool-down lets one probe.
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = FakeServer("openai")
    dead.port = port
    async with router(backend_for(dead, "dead")) as r:
        kinds = []
        for _ in range(5):
            with pytest.raises(LLMError) as info:
                await r.complete(req())
            kinds.append(info.value.kind)
        assert trio.current_time() == 0
        assert kinds == [ErrorKind.UNREACHABLE] * 5
        assert r.stats().backends["dead"].counters.requests == 3  # two never left
        assert "unreachable" in str(info.value) and info.value.retry_after == 30.0
        await trio.sleep(30)
        with pytest.raises(LLMError) as info:
            await r.complete(req())
        assert info.value.kind is ErrorKind.UNREACHABLE
        assert r.stats().backends["dead"].counters.requests == 4  # the probe
        assert trio.current_time() == 30


async def test_a_rate_limited_backend_is_still_waited_for(nursery, autojump_clock):
    # Not down, only cooling: the request waits for it within its deadline, as before.
    fake = await start_fake(nursery, "openai", rate_limited("5"))
    async with router(backend_for(fake, "a")) as r:
        out = await r.complete(req("x"))
    assert out.backend == "a" and trio.current_time() == pytest.approx(5.0)


async def test_request_deadline_cuts_the_attempt_and_is_no_breaker_verdict(nursery, autojump_clock):
    slow = await start_fake(nursery, "openai", openai_ok(delay=100.0))
    other = await start_fake(nursery, "openai")
    async with router(
        backend_for(slow, "slow", priority=1, timeout=60.0), backend_for(other, "other", priority=2)
    ) as r:
        with pytest.raises(LLMError) as info:
            await r.complete(req(deadline=trio.current_time() + 3))
        assert r.stats().backends["slow"].consecutive_failures == 0
    assert info.value.kind is ErrorKind.TIMEOUT
    assert trio.current_time() == pytest.approx(3.0) and not other.requests


# -- all cooling -------------------------------------------------------------------------


async def test_all_cooling_waits_for_the_first_back_within_deadline(nursery, autojump_clock):
    a = await start_fake(nursery, "openai", rate_limited("3600"))  # cools 20 s, the cap
    b = await start_fake(nursery, "openai", rate_limited("10"))
    retry = RetryConfig(max_attempts=2, max_retry_after=20.0)  # budget spent, both cool
    async with router(
        backend_for(a, "a", priority=1), backend_for(b, "b", priority=2), retry=retry
    ) as r:
        with pytest.raises(LLMError):
            await r.complete(req())  # a and b both rate-limited, waits beyond the cap
        t0 = trio.current_time()
        out = await r.complete(req(deadline=t0 + 15))
    assert out.backend == "b" and out.latency == pytest.approx(10.0)


async def test_all_cooling_fails_at_once_when_the_wait_exceeds_the_deadline(
    nursery, autojump_clock
):
    a = await start_fake(nursery, "openai", rate_limited("3600"))
    b = await start_fake(nursery, "openai", rate_limited("10"))
    retry = RetryConfig(max_attempts=2, max_retry_after=20.0)
    async with router(
        backend_for(a, "a", priority=1), backend_for(b, "b", priority=2), retry=retry
    ) as r:
        with pytest.raises(LLMError):
            await r.complete(req())
        t0 = trio.current_time()
        with pytest.raises(LLMError) as info:
            await r.complete(req(deadline=t0 + 4))
    err = info.value
    assert err.kind is ErrorKind.RATE_LIMIT and err.retry_after == pytest.approx(10.0)
    assert trio.current_time() == t0  # failed at once, did not sit out the deadline
    assert len(a.requests) == len(b.requests) == 1


async def test_all_breakers_open_fails_with_overloaded_and_the_wait(nursery, autojump_clock):
    a = await start_fake(nursery, "openai", OVERLOADED)
    breaker = BreakerConfig(failures=1, cooldown=60.0)
    async with router(backend_for(a, "a"), breaker=breaker) as r:
        with pytest.raises(LLMError):
            await r.complete(req(deadline=trio.current_time() + 10))
        with pytest.raises(LLMError) as info:
            await r.complete(req(deadline=trio.current_time() + 10))
    assert info.value.kind is ErrorKind.OVERLOADED
    assert info.value.retry_after == pytest.approx(60.0)
    assert len(a.requests) == 1


# -- budget ------------------------------------------------------------------------------


async def test_attempt_budget_is_shared_by_retries_and_failovers(nursery, autojump_clock):
    fakes = [await start_fake(nursery, "openai", *[OVERLOADED] * 10) for _ in range(3)]
    retry = RetryConfig(max_attempts=5, base_delay=0.1, max_delay=0.1)
    breaker = BreakerConfig(failures=2, cooldown=1000.0)
    async with router(
        *[backend_for(f, n, priority=i) for i, (f, n) in enumerate(zip(fakes, "abc", strict=True))],
        retry=retry,
        breaker=breaker,
    ) as r:
        with pytest.raises(LLMError) as info:
            await r.complete(req())
    assert [len(f.requests) for f in fakes] == [2, 2, 1]  # exactly 5 calls in all
    assert len(info.value.attempts) == 5
    assert [a.backend for a in info.value.attempts] == ["a", "a", "b", "b", "c"]


async def test_budget_smaller_than_backends(nursery, autojump_clock):
    fakes = [await start_fake(nursery, "openai", openai_ok(delay=50.0)) for _ in range(3)]
    async with router(
        *[
            backend_for(f, n, priority=i, timeout=1.0)
            for i, (f, n) in enumerate(zip(fakes, "abc", strict=True))
        ],
        retry=RetryConfig(max_attempts=2),
    ) as r:
        with pytest.raises(LLMError) as info:
            await r.complete(req())
    assert [len(f.requests) for f in fakes] == [1, 1, 0]
    assert info.value.kind is ErrorKind.TIMEOUT


@pytest.mark.parametrize(
    "script",
    [
        openai_error(400, "messages: invalid role 'robot'"),
        openai_error(
            400, "Your request was rejected by our safety system", code="content_policy_violation"
        ),
        openai_error(401, "Your account has been deactivated", code="account_deactivated"),
    ],
    ids=["format", "content", "auth-permanent"],
)
async def test_stop_kinds_do_not_fail_over(nursery, autojump_clock, script):
    a = await start_fake(nursery, "openai", script)
    b = await start_fake(nursery, "openai")
    async with router(backend_for(a, "a", priority=1), backend_for(b, "b", priority=2)) as r:
        with pytest.raises(LLMError) as info:
            await r.complete(req())
    assert info.value.backend == "a" and not b.requests
    assert info.value.kind in (
        ErrorKind.FORMAT_ERROR,
        ErrorKind.CONTENT_BLOCKED,
        ErrorKind.AUTH_PERMANENT,
    )


async def test_auth_and_model_not_found_fail_over(nursery, autojump_clock):
    a = await start_fake(
        nursery, "openai", openai_error(401, "Incorrect API key", code="invalid_api_key")
    )
    b = await start_fake(
        nursery, "openai", openai_error(404, "The model does not exist", code="model_not_found")
    )
    c = await start_fake(nursery, "openai", openai_ok("c"))
    fakes = [(a, "a"), (b, "b"), (c, "c")]
    async with router(*[backend_for(f, n, priority=i) for i, (f, n) in enumerate(fakes)]) as r:
        out = await r.complete(req())
        stats = r.stats()
    assert out.backend == "c" and out.attempts == 3 and out.latency == 0.0
    assert stats.backends["a"].counters.errors == {"AUTH": 1}
    assert stats.backends["b"].counters.errors == {"MODEL_NOT_FOUND": 1}


# -- streaming ---------------------------------------------------------------------------


async def collect(
    r: Router, request: Request
) -> tuple[list[str], Completion | None, LLMError | None]:
    chunks: list[str] = []
    final = None
    try:
        async with r.stream(request) as s:
            async for item in s:
                if isinstance(item, Completion):
                    final = item
                else:
                    chunks.append(item)
    except LLMError as err:
        return chunks, final, err
    return chunks, final, None


async def test_stream_break_after_first_chunk_surfaces_and_never_repeats(nursery, autojump_clock):
    # Chunks: role, "a", "b", ...; breaking after 3 delivers "a" and "b".
    a = await start_fake(nursery, "openai", openai_stream(["a", "b", "c", "d"], break_after=3))
    b = await start_fake(nursery, "openai")
    async with router(backend_for(a, "a", priority=1), backend_for(b, "b", priority=2)) as r:
        chunks, final, err = await collect(r, req(agent="w"))
        stats = r.stats()
    assert chunks == ["a", "b"] and final is None
    assert err is not None and err.kind is ErrorKind.TIMEOUT and err.backend == "a"
    assert not b.requests  # no failover after a chunk was delivered
    assert stats.backends["a"].counters.errors == {"TIMEOUT": 1}
    assert stats.agents["w"].counters.errors == {"TIMEOUT": 1}
    assert stats.backends["a"].active == 0


async def test_stream_break_before_first_chunk_fails_over(nursery, autojump_clock):
    a = await start_fake(nursery, "anthropic", anthropic_stream(["x", "y"], break_after=2))
    b = await start_fake(nursery, "ollama", ollama_stream(["p", "q"]))
    async with router(backend_for(a, "a", priority=1), backend_for(b, "b", priority=2)) as r:
        chunks, final, err = await collect(r, req())
    assert err is None and chunks == ["p", "q"]
    assert (
        final is not None and final.backend == "b" and final.content == "pq" and final.attempts == 2
    )


async def test_stream_error_event_before_text_is_retried(nursery, autojump_clock):
    # OVERLOADED says "retry same backend"; nothing was delivered yet, so it may.
    a = await start_fake(
        nursery, "anthropic", anthropic_stream([], error=("overloaded_error", "Overloaded"))
    )
    b = await start_fake(nursery, "openai")
    async with router(backend_for(a, "a", priority=1), backend_for(b, "b", priority=2)) as r:
        chunks, final, err = await collect(r, req())
        assert r.stats().backends["a"].counters.errors == {"OVERLOADED": 1}
    assert err is None and chunks == ["echo:", " hi"]
    assert (final.backend, final.content, final.attempts) == ("a", "echo: hi", 2)
    assert len(a.requests) == 2 and not b.requests


async def test_stream_accounts_and_prices(nursery, autojump_clock):
    a = await start_fake(
        nursery, "openai", openai_stream(["a", "b"], prompt_tokens=1000, completion_tokens=500)
    )
    async with router(backend_for(a, "a", price=Price(2.0, 10.0))) as r:
        _, final, _ = await collect(r, req(agent="poet"))
        stats = r.stats()
    assert final.cost == pytest.approx((1000 * 2.0 + 500 * 10.0) / 1e6)
    assert stats.agents["poet"].counters.cost == pytest.approx(final.cost)
    assert stats.backends["a"].counters.completion_tokens == 500


async def test_abandoned_stream_releases_its_slot(nursery, autojump_clock):
    a = await start_fake(nursery, "openai", openai_stream(["a", "b", "c"], chunk_delay=1.0))
    async with router(backend_for(a, "a", max_concurrent=1)) as r:
        async with r.stream(req()) as s:
            assert await s.__anext__() == "a"
        assert r.stats().backends["a"].active == 0
        out = await r.complete(req("again"))  # the slot is free again
    assert out.content == "echo: again"


# -- strategies, keys, accounting -------------------------------------------------------------


async def test_round_robin_alternates(nursery, autojump_clock):
    a = await start_fake(nursery, "openai")
    b = await start_fake(nursery, "openai")
    async with router(backend_for(a, "a"), backend_for(b, "b"), strategy=Strategy.ROUND_ROBIN) as r:
        names = [(await r.complete(req())).backend for _ in range(4)]
    assert names == ["a", "b", "a", "b"]


async def test_least_loaded_picks_the_idle_backend(nursery, autojump_clock):
    a = await start_fake(nursery, "openai", openai_ok(delay=10.0))
    b = await start_fake(nursery, "openai", openai_ok(delay=10.0))
    used: list[str] = []
    async with router(
        backend_for(a, "a", priority=1),
        backend_for(b, "b", priority=2),
        strategy=Strategy.LEAST_LOADED,
    ) as r:

        async def caller() -> None:
            used.append((await r.complete(req())).backend)

        async with trio.open_nursery() as n:
            n.start_soon(caller)
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(caller)
    assert sorted(used) == ["a", "b"]


async def test_failover_strategy_prefers_priority(nursery, autojump_clock):
    a = await start_fake(nursery, "openai")
    b = await start_fake(nursery, "openai")
    async with router(backend_for(a, "a", priority=5), backend_for(b, "b", priority=1)) as r:
        assert {(await r.complete(req())).backend for _ in range(3)} == {"b"}


async def test_aliases_and_exact_names_only(nursery, autojump_clock):
    a = await start_fake(nursery, "openai")
    async with router(backend_for(a, "a", models=("gpt-4o",), aliases={"fast": "gpt-4o"})) as r:
        await r.complete(req(model="fast"))
        assert a.requests[0].body["model"] == "gpt-4o"
        with pytest.raises(LLMError) as info:
            await r.complete(req(model="gpt-4"))
    assert info.value.kind is ErrorKind.MODEL_NOT_FOUND and info.value.backend is None


async def test_backend_with_unset_key_is_skipped_with_reason(nursery, autojump_clock):
    a = await start_fake(nursery, "openai")
    b = await start_fake(nursery, "openai")
    async with router(
        backend_for(a, "a", priority=1, api_key_env="A_KEY"),
        backend_for(b, "b", priority=2, api_key_env="B_KEY", models=("m", "only-b")),
        env={"A_KEY": "sk-a"},
    ) as r:
        assert "B_KEY" in r.skipped["b"]
        assert (await r.complete(req())).backend == "a"
        with pytest.raises(LLMError) as info:
            await r.complete(req(model="only-b"))
    assert info.value.kind is ErrorKind.AUTH and "B_KEY" in info.value.provider_message
    assert a.requests[0].headers["authorization"] == "Bearer sk-a"


async def test_request_no_bucket_can_hold_fails_at_once(nursery, autojump_clock):
    a = await start_fake(nursery, "openai")
    async with router(backend_for(a, "a", tokens_per_minute=100)) as r:
        with pytest.raises(LLMError) as info:
            await r.complete(req(max_tokens=500))
    assert info.value.kind is ErrorKind.CONTEXT_OVERFLOW and "could never be admitted" in str(
        info.value
    )
    assert not a.requests and trio.current_time() == 0.0


async def test_accounting_per_backend_and_agent(nursery, autojump_clock):
    a = await start_fake(nursery, "openai", QUOTA)
    b = await start_fake(nursery, "openai", openai_ok(prompt_tokens=100, completion_tokens=50))
    async with router(
        backend_for(a, "a", priority=1, requests_per_minute=60, tokens_per_minute=10000),
        backend_for(b, "b", priority=2, price=Price(1.0, 2.0), tokens_per_minute=10000),
    ) as r:
        await r.complete(req(agent="x"))
        s = r.stats()
    assert s.backends["a"].counters.requests == 1 and s.backends["a"].counters.errors == {
        "BILLING": 1
    }
    assert s.backends["a"].requests_bucket_fill == pytest.approx(59 / 60)
    assert s.backends["a"].tokens_bucket_fill == pytest.approx(1.0)  # failed call refunded
    bb = s.backends["b"]
    assert (bb.counters.successes, bb.counters.prompt_tokens, bb.counters.completion_tokens) == (
        1,
        100,
        50,
    )
    assert bb.counters.cost == pytest.approx(200 / 1e6)
    assert bb.tokens_bucket_fill == pytest.approx(1 - 150 / 10000)  # reconciled to reported usage
    ag = s.agents["x"].counters
    assert (ag.requests, ag.successes, ag.prompt_tokens, ag.cost) == (
        1,
        1,
        100,
        pytest.approx(200 / 1e6),
    )
    d = s.as_dict()
    assert d["backends"]["b"]["breaker"] == "closed"


async def test_max_concurrent_is_never_exceeded(nursery, autojump_clock):
    a = await start_fake(nursery, "openai", *[openai_ok(delay=1.0)] * 10)
    async with router(backend_for(a, "a", max_concurrent=3)) as r:
        async with trio.open_nursery() as n:
            for _ in range(10):
                n.start_soon(r.complete, req())
    assert a.max_in_flight == 3 and len(a.requests) == 10
    assert trio.current_time() == pytest.approx(4.0)  # ceil(10 / 3) rounds of 1 s


# -- deadlines, queues, cancellation ------------------------------------------------------


async def test_local_limit_wait_beyond_deadline_fails_with_rate_limit(nursery, autojump_clock):
    a = await start_fake(nursery, "openai")
    async with router(backend_for(a, "a", requests_per_minute=1)) as r:
        await r.complete(req())
        with pytest.raises(LLMError) as info:
            await r.complete(req(deadline=trio.current_time() + 10))
        assert r.stats().backends["a"].active == 0
    assert info.value.kind is ErrorKind.RATE_LIMIT and "local limits" in info.value.provider_message
    assert trio.current_time() == pytest.approx(10.0) and len(a.requests) == 1


async def test_queue_limit_refuses_at_once(nursery, autojump_clock):
    a = await start_fake(nursery, "openai")
    cfg = RouterConfig(backends=(backend_for(a, "a", requests_per_minute=1),), queue_limit=2)
    async with Router(cfg, environ={}) as r:
        await r.complete(req())
        async with trio.open_nursery() as n:
            n.start_soon(r.complete, req())
            n.start_soon(r.complete, req())
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(LLMError) as info:
                await r.complete(req())
            assert trio.current_time() == 0.0
            n.cancel_scope.cancel()
    assert info.value.kind is ErrorKind.RATE_LIMIT and "queue full" in info.value.provider_message


async def test_concurrency_queue_is_bounded_too(nursery, autojump_clock):
    a = await start_fake(nursery, "openai", *[openai_ok(delay=9.0)] * 3)
    cfg = RouterConfig(backends=(backend_for(a, "a", max_concurrent=1),), queue_limit=1)
    async with Router(cfg, environ={}) as r:
        async with trio.open_nursery() as n:
            n.start_soon(r.complete, req())  # in flight
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(r.complete, req())  # waits for the slot
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(LLMError) as info:
                await r.complete(req())
            assert trio.current_time() == 0.0
    assert "queue full" in info.value.provider_message and len(a.requests) == 2


async def test_usage_above_the_reservation_becomes_debt(nursery, autojump_clock):
    # Reported usage (1000) far above the reservation (~8 + 10): the excess is
    # charged, so the next caller waits until the bucket is out of debt.
    a = await start_fake(nursery, "openai", openai_ok(prompt_tokens=500, completion_tokens=500))
    async with router(backend_for(a, "a", tokens_per_minute=600)) as r:
        await r.complete(req(max_tokens=10))
        assert r.stats().backends["a"].tokens_bucket_fill == pytest.approx(-400 / 600)
        await r.complete(req(max_tokens=10))
    # From -400 to the ~18 tokens the second call reserves, at 10 tokens/s.
    assert 40.0 < a.requests[1].at < 43.0


async def test_cancelled_in_flight_call_is_no_breaker_verdict(nursery, autojump_clock):
    a = await start_fake(nursery, "openai", openai_ok(delay=50.0))
    async with router(
        backend_for(a, "a", max_concurrent=1), breaker=BreakerConfig(failures=1)
    ) as r:
        with trio.move_on_after(5):
            await r.complete(req())
        s = r.stats().backends["a"]
        assert (s.breaker, s.consecutive_failures, s.active) == ("closed", 0, 0)
        out = await r.complete(req("again"))  # slot released
    assert out.content == "echo: again"


async def test_stream_deadline_mid_stream_is_no_breaker_verdict(nursery, autojump_clock):
    # The request's own deadline passing mid-stream says nothing about the backend, as
    # when it passes before the first chunk: the breaker (opening at one failure) stays
    # closed.
    a = await start_fake(nursery, "openai", openai_stream(["a", "b", "c"], chunk_delay=4.0))
    async with router(backend_for(a, "a", timeout=30.0), breaker=BreakerConfig(failures=1)) as r:
        chunks, final, err = await collect(r, req(deadline=trio.current_time() + 6))
        s = r.stats().backends["a"]
        assert (s.breaker, s.consecutive_failures, s.active) == ("closed", 0, 0)
        assert s.counters.errors == {ErrorKind.TIMEOUT.value: 1}
    assert chunks == ["a"] and final is None
    assert err.kind is ErrorKind.TIMEOUT and "mid-stream" in err.provider_message


def test_request_and_error_values():
    r = Request([Message.user("x")], "m", stop=["a"])
    assert r.stop == ("a",) and hash(r) == hash(Request([Message.user("x")], "m", stop=("a",)))
    with pytest.raises(ValueError):
        Request([], "m")
    with pytest.raises(ValueError):
        Request([Message.user("x")], "m", max_tokens=0)
    err = LLMError(ErrorKind.BILLING, "no credit", backend="b", status=402, retry_after=3.0)
    assert str(err) == "BILLING from b (HTTP 402): no credit; retry after 3s"
