"""The in-flight bound of one connection (agentserver.net.inflight), without a socket."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from agentserver.net.inflight import Inflight
from agentserver.net.limits import Limits


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


def test_one_request_is_always_admitted_when_none_waits_however_large():
    inflight = Inflight(Limits(max_inflight=2, max_inflight_bytes=10))
    assert inflight.has_room(1000)
    inflight.add(0.0, 1000)
    assert not inflight.has_room(1)


def test_the_count_and_the_bytes_both_bound_and_a_reply_retires_the_oldest():
    inflight = Inflight(Limits(max_inflight=2, max_inflight_bytes=10))
    inflight.add(0.0, 4)
    assert inflight.has_room(6) and not inflight.has_room(7)
    inflight.add(0.0, 6)
    assert not inflight.has_room(0)  # two in flight: the count is full
    inflight.replied(1)
    assert inflight.bytes == 6 and len(inflight.requests) == 1
    assert inflight.has_room(4) and not inflight.has_room(5)
    inflight.replied(5)  # more replies than requests (a broadcast): none left, no error
    assert inflight.bytes == 0 and not inflight.requests


async def test_waiting_for_room_ends_at_a_reply_or_when_the_oldest_stops_counting(
    autojump_clock,
):
    inflight = Inflight(Limits(max_inflight=1, inflight_ttl=30.0))
    inflight.add(trio.current_time(), 1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inflight.wait_for_room, 1)
        await trio.sleep(5)
        inflight.replied(1)  # the waiter is woken by the reply
    assert not inflight.requests

    start = trio.current_time()
    inflight.add(start, 1)
    await inflight.wait_for_room(1)  # no reply: the request stops counting after the ttl
    assert trio.current_time() - start == pytest.approx(30.0)
    assert not inflight.requests and inflight.bytes == 0
