"""agentserver/http/sendonce.py: one holder per key, entries freed (a cancelled waiter's
too), and the bounded look at the store (MockClock)."""

from __future__ import annotations

import itertools

import trio
import trio.testing

from agentserver.http.sendonce import STORED_WAIT, SendOnce, until_stored


async def test_one_holder_per_key_in_arrival_order_and_no_entry_left():
    once = SendOnce()
    inside: list[str] = []
    order: list[int] = []

    async def hold(key: str, n: int) -> None:
        async with once.hold(key):
            inside.append(key)
            assert inside.count(key) == 1, inside
            order.append(n)
            await trio.sleep(0.01)
            inside.remove(key)

    async with trio.open_nursery() as nursery:
        for n in range(5):
            nursery.start_soon(hold, "t-1", n)
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, "t-2", 99)  # another key does not wait
        await trio.testing.wait_all_tasks_blocked()
        assert "t-2" in inside
    assert [n for n in order if n != 99] == [0, 1, 2, 3, 4]
    assert len(once) == 0


async def test_a_waiter_cancelled_frees_its_part_of_the_entry():
    once = SendOnce()
    release = trio.Event()

    async def holder() -> None:
        async with once.hold("t"):
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(0.01):
            async with once.hold("t"):
                raise AssertionError("held while the holder holds")
        assert len(once) == 1
        release.set()
    assert len(once) == 0


async def test_until_stored_returns_once_the_store_says_so(autojump_clock):
    looks = []

    async def stored() -> bool:
        looks.append(trio.current_time())
        return len(looks) == 4

    start = trio.current_time()
    assert await until_stored(stored)
    assert len(looks) == 4
    # The gaps grow (2, 4, 8 ms): a task stored at once is seen at once.
    gaps = [b - a for a, b in itertools.pairwise(looks)]
    assert gaps == sorted(gaps) and gaps[0] < 0.005, gaps
    assert looks[0] == start


async def test_until_stored_gives_up_after_its_wait(autojump_clock):
    looks = 0

    async def never() -> bool:
        nonlocal looks
        looks += 1
        return False

    start = trio.current_time()
    assert not await until_stored(never)
    assert trio.current_time() - start == STORED_WAIT
    assert looks < STORED_WAIT / 0.05 + 10  # bounded gaps: not a busy loop


async def test_the_next_holder_of_a_key_sent_recently_waits_until_it_is_stored(autojump_clock):
    once = SendOnce()
    looks = 0

    async def stored_on_the_third_look() -> bool:
        nonlocal looks
        looks += 1
        return looks >= 3

    await once.settle("never-sent", stored_on_the_third_look)
    assert looks == 0  # nothing sent: nothing to wait for
    once.sent("t")
    await once.settle("t", stored_on_the_third_look)
    assert looks == 3
    # Sent longer ago than STORED_WAIT: not waited for.
    once.sent("old")
    await trio.sleep(STORED_WAIT + 1)
    before = looks
    await once.settle("old", stored_on_the_third_look)
    assert looks == before


async def test_settling_a_send_never_stored_gives_up_within_its_time(autojump_clock):
    once = SendOnce()

    async def never() -> bool:
        return False

    once.sent("t")
    await trio.sleep(1)
    start = trio.current_time()
    await once.settle("t", never)
    assert trio.current_time() - start == STORED_WAIT - 1
    start = trio.current_time()
    await once.settle("t", never)  # forgotten after it gave up
    assert trio.current_time() == start
