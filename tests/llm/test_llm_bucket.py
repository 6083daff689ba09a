"""Token buckets: pure invariants (hypothesis) and the trio limiter's queue semantics."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserver.llm.bucket import ExceedsCapacity, Limiter, QueueFull, TokenBucket


def window_excess(grants: list[tuple[float, float]], capacity: float, rate: float) -> float:
    """max over windows [t_i, t_j] of granted - (capacity + rate * (t_j - t_i))."""
    worst = -float("inf")
    for i in range(len(grants)):
        total = 0.0
        for j in range(i, len(grants)):
            total += grants[j][1]
            worst = max(worst, total - (capacity + rate * (grants[j][0] - grants[i][0])))
    return worst


@given(
    capacity=st.integers(min_value=1, max_value=1000),
    steps=st.lists(
        st.tuples(st.floats(min_value=0, max_value=30), st.integers(min_value=1, max_value=1000)),
        max_size=60,
    ),
)
def test_pure_bucket_never_grants_more_than_capacity_plus_refill(capacity, steps):
    bucket = TokenBucket.per_minute(capacity, 0.0)
    now, grants = 0.0, []
    for dt, amount in steps:
        now += dt
        amount = min(amount, capacity)
        if bucket.wait_time(amount, now) == 0.0:
            bucket.take(amount, now)
            grants.append((now, amount))
        assert bucket.level <= bucket.capacity
    assert window_excess(grants, capacity, bucket.rate) <= 1e-6 * capacity


@given(
    capacity=st.integers(min_value=1, max_value=100),
    amount=st.integers(min_value=1, max_value=100),
    level=st.floats(min_value=-100, max_value=100),
)
def test_wait_time_is_exactly_enough(capacity, amount, level):
    def fresh() -> TokenBucket:
        return TokenBucket(capacity=capacity, rate=2.0, level=min(level, capacity), stamp=0.0)

    if amount > capacity:
        return
    wait = fresh().wait_time(amount, 0.0)
    assert fresh().wait_time(amount, wait) == 0.0
    if wait > 0.01:
        assert fresh().wait_time(amount, wait - 0.01) > 0.0


async def test_waiters_are_served_in_order_even_when_a_later_one_is_small(autojump_clock):
    limiter = Limiter([TokenBucket.per_minute(60, trio.current_time())])  # 1 per second
    await limiter.acquire([60])  # empty it
    served: list[tuple[str, float]] = []

    async def take(name: str, amount: int) -> None:
        await limiter.acquire([amount])
        served.append((name, trio.current_time()))

    async with trio.open_nursery() as nursery:
        for name, amount in [("big", 30), ("small1", 1), ("small2", 1)]:
            nursery.start_soon(take, name, amount)
            await trio.testing.wait_all_tasks_blocked()
    assert [n for n, _ in served] == ["big", "small1", "small2"]
    assert [t for _, t in served] == pytest.approx([30.0, 31.0, 32.0])


async def test_cancelled_wait_takes_nothing_and_the_next_moves_up(autojump_clock):
    limiter = Limiter([TokenBucket.per_minute(60, trio.current_time())])  # 1 per second
    await limiter.acquire([60])
    served: dict[str, float] = {}
    head_scope = trio.CancelScope()

    async def head() -> None:
        with head_scope:
            await limiter.acquire([40])
            served["head"] = trio.current_time()

    async def second() -> None:
        await limiter.acquire([10])
        served["second"] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(head)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert limiter.waiting == 2
        await trio.sleep(5)
        head_scope.cancel()
    # The head gave up at t=5 having taken nothing, so "second" (10 tokens) is
    # served at t=10, as if the head had never queued; had the head been
    # charged, it would wait until t=50.
    assert "head" not in served
    assert served["second"] == pytest.approx(10.0)
    assert limiter.waiting == 0


async def test_small_waiter_does_not_overtake_a_waiting_head(autojump_clock):
    limiter = Limiter([TokenBucket.per_minute(60, trio.current_time())])
    await limiter.acquire([60])
    served: dict[str, float] = {}

    async def take(name: str, amount: int) -> None:
        await limiter.acquire([amount])
        served[name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, "head", 20)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(take, "small", 5)
    # "small" could have had 5 tokens at t=5 but waits behind the head.
    assert served == {"head": pytest.approx(20.0), "small": pytest.approx(25.0)}


async def test_request_larger_than_capacity_fails_at_once():
    limiter = Limiter([TokenBucket.per_minute(100, trio.current_time())])
    with trio.fail_after(1):  # would otherwise hang forever
        with pytest.raises(ExceedsCapacity):
            await limiter.acquire([101])


async def test_queue_is_bounded(autojump_clock):
    limiter = Limiter([TokenBucket.per_minute(1, trio.current_time())], max_waiters=2)
    await limiter.acquire([1])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(limiter.acquire, [1])
        nursery.start_soon(limiter.acquire, [1])
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueFull):
            await limiter.acquire([1])
        nursery.cancel_scope.cancel()


async def test_all_buckets_are_charged_at_the_same_instant(autojump_clock):
    now = trio.current_time()
    requests, tokens = TokenBucket.per_minute(60, now), TokenBucket.per_minute(600, now)
    limiter = Limiter([requests, tokens])
    await limiter.acquire([1, 600])  # tokens empty, requests 59 of 60
    granted: list[float] = []

    async def caller() -> None:
        await limiter.acquire([1, 300])
        granted.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(caller)
        await trio.sleep(0.5)
        # Waiting for tokens, the caller holds no request token either:
        # 59 + 0.5 refilled, not 58.5.
        assert limiter.fill(trio.current_time())[0] * 60 == pytest.approx(59.5)
    assert granted == [pytest.approx(30.0)]
    assert limiter.fill(trio.current_time())[0] * 60 == pytest.approx(59.0)


async def test_give_back_wakes_the_head_early(autojump_clock):
    limiter = Limiter([TokenBucket.per_minute(60, trio.current_time())])
    await limiter.acquire([60])
    done: list[float] = []

    async def waiter() -> None:
        await limiter.acquire([30])
        done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(1)
        limiter.give_back([40])  # reconciliation returned unused tokens
    assert done == [pytest.approx(1.0)]


@settings(max_examples=25, deadline=None)
@given(
    amounts=st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=40),
    cancel_every=st.integers(min_value=2, max_value=7),
)
def test_concurrent_callers_never_overshoot_and_keep_order(amounts, cancel_every):
    grants: list[tuple[float, float, int]] = []

    async def main() -> None:
        limiter = Limiter([TokenBucket.per_minute(100, trio.current_time())])

        async def caller(i: int, amount: int, scope: trio.CancelScope) -> None:
            with scope:
                await limiter.acquire([amount])
                grants.append((trio.current_time(), amount, i))

        async with trio.open_nursery() as nursery:
            scopes = []
            for i, amount in enumerate(amounts):
                scope = trio.CancelScope()
                scopes.append(scope)
                nursery.start_soon(caller, i, amount, scope)
                await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.5)
            for i in range(0, len(scopes), cancel_every):
                scopes[i].cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    order = [i for _, _, i in grants]
    assert order == sorted(order)
    assert window_excess([(t, a) for t, a, _ in grants], 100, 100 / 60) <= 1e-6


async def test_agents_take_turns_on_a_shared_bucket(autojump_clock):
    """A hot agent with 20 calls waiting delays another agent's call by at most one grant;
    each agent's own calls keep their order."""
    limiter = Limiter([TokenBucket.per_minute(60, trio.current_time())])  # 1 per second
    await limiter.acquire([60], "hot")  # empty it
    served: list[str] = []

    async def take(agent: str, n: int) -> None:
        await limiter.acquire([10], agent)
        served.append(f"{agent}{n}")

    async with trio.open_nursery() as nursery:
        for n in range(20):
            nursery.start_soon(take, "hot", n)
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(take, "cool", 0)
        await trio.testing.wait_all_tasks_blocked()
        assert limiter.waiting == 21
    assert served.index("cool0") <= 1
    assert [s for s in served if s.startswith("hot")] == [f"hot{n}" for n in range(20)]
    assert limiter.waiting == 0


async def test_two_agents_alternate_while_both_wait(autojump_clock):
    """Two agents share one bucket through two keys: grants alternate while both wait."""
    limiter = Limiter([TokenBucket.per_minute(60, trio.current_time())])
    await limiter.acquire([60])
    served: list[str] = []

    async def take(agent: str) -> None:
        await limiter.acquire([5], agent)
        served.append(agent)

    async with trio.open_nursery() as nursery:
        for agent in ["a"] * 6 + ["b"] * 6:
            nursery.start_soon(take, agent)
            await trio.testing.wait_all_tasks_blocked()
    assert served == ["a", "b"] * 6
