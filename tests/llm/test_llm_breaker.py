"""Circuit breaker state machine (pure: the tests pass the time)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agentserver.llm.breaker import Breaker, BreakerState, Cooling


def fail(b: Breaker, now: float) -> None:
    permit = b.try_acquire(now)
    assert permit is not None
    b.record(permit, False, now)


def test_opens_after_threshold_consecutive_failures():
    b = Breaker(3, 10.0)
    fail(b, 0)
    fail(b, 0)
    assert b.state(0) is BreakerState.CLOSED
    fail(b, 1)
    assert b.state(1) is BreakerState.OPEN
    assert b.try_acquire(5) is None
    assert b.available_at(5) == 11.0


def test_success_resets_the_count():
    b = Breaker(2, 10.0)
    fail(b, 0)
    ok = b.try_acquire(0)
    b.record(ok, True, 0)
    fail(b, 0)
    assert b.state(0) is BreakerState.CLOSED


def test_exactly_one_probe_after_cooldown():
    b = Breaker(1, 10.0)
    fail(b, 0)
    assert b.state(10) is BreakerState.HALF_OPEN
    probe = b.try_acquire(10)
    assert probe is not None and probe.probe
    assert b.try_acquire(10) is None
    assert b.available_at(10) is None  # depends on the probe
    b.record(probe, True, 11)
    assert b.state(11) is BreakerState.CLOSED
    assert b.try_acquire(11) is not None


def test_failed_probe_reopens_for_another_cooldown():
    b = Breaker(1, 10.0)
    fail(b, 0)
    probe = b.try_acquire(10)
    b.record(probe, False, 12)
    assert b.state(12) is BreakerState.OPEN
    assert b.available_at(12) == 22.0
    assert b.opens == 2


def test_abandoned_probe_lets_another_caller_probe():
    b = Breaker(1, 10.0)
    fail(b, 0)
    probe = b.try_acquire(10)
    b.release(probe)
    again = b.try_acquire(10)
    assert again is not None and again.probe


def test_outcomes_from_before_opening_are_ignored():
    b = Breaker(2, 10.0)
    old = b.try_acquire(0)  # in flight while others fail
    fail(b, 0)
    fail(b, 0)
    assert b.state(0) is BreakerState.OPEN
    b.record(old, True, 1)  # a late success does not close it
    assert b.state(1) is BreakerState.OPEN


def test_non_retryable_outcome_counts_as_healthy():
    b = Breaker(2, 10.0)
    fail(b, 0)
    p = b.try_acquire(0)
    b.record(p, True, 0)  # e.g. a FORMAT_ERROR: the server answered
    fail(b, 0)
    assert b.state(0) is BreakerState.CLOSED


@given(st.lists(st.tuples(st.floats(0, 5), st.booleans(), st.booleans()), max_size=80))
def test_never_more_than_one_probe_out(ops):
    b = Breaker(2, 3.0)
    now = 0.0
    out = []
    for dt, healthy, settle in ops:
        now += dt
        p = b.try_acquire(now)
        if p is not None:
            out.append(p)
        assert sum(1 for q in out if q.probe and q.generation == b.generation) <= 1
        if settle and out:
            q = out.pop(0)
            b.record(q, healthy, now)


def test_cooling_holds_back_then_grants_exactly_one_probe():
    c = Cooling()
    assert c.try_acquire(0) is False and c.available_at(0) == 0  # not cooling: call freely
    c.cool(0, 30)
    assert c.try_acquire(29.9) is None and c.available_at(10) == 30 and c.remaining(10) == 20
    assert c.try_acquire(30) is True  # the probe
    assert c.try_acquire(31) is None and c.available_at(31) is None  # its outcome decides
    c.release()  # abandoned: the next caller probes
    assert c.try_acquire(32) is True
    c.probe_done()
    assert c.try_acquire(33) is False and c.remaining(33) == 0


@given(st.lists(st.tuples(st.floats(0, 1e4), st.floats(0, 1e4)), min_size=1, max_size=20))
def test_cooling_ends_at_the_latest_requested_time(cools):
    c = Cooling()
    for now, seconds in cools:
        c.cool(now, seconds)
    end = max(now + seconds for now, seconds in cools)
    assert c.try_acquire(end - 1e-3) is None
    assert c.try_acquire(end) is True
