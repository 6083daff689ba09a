"""In-process tool listeners' steps (issue 26): step-timeout, retries and idempotent as
remote listeners have them, every attempt with the same idempotency key (MockClock, the
real loader and pump, no socket)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from idem_support import FLAKY_CALLS, FLAKY_EFFECTS, Flaky

from agentserver.testing import in_process

BOOT = """<?xml version="1.0"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="idem">
  <listeners>
    <listener name="flaky" handler="idem_support:flaky" {attrs}>
      <accepts type="idem_support:Flaky"/>
      <responds type="idem_support:Done"/>
    </listener>
  </listeners>
</organism>"""


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture(autouse=True)
def _fresh_calls():
    FLAKY_CALLS.clear()
    FLAKY_EFFECTS.clear()
    yield
    FLAKY_CALLS.clear()
    FLAKY_EFFECTS.clear()


def boot_file(tmp_path, attrs: str):
    path = tmp_path / "boot.xml"
    path.write_text(BOOT.format(attrs=attrs))
    return path


@pytest.mark.parametrize("mode", ["hang", "raise"])
async def test_an_idempotent_step_is_retried_with_the_same_key(tmp_path, autojump_clock, mode):
    path = boot_file(tmp_path, 'step-timeout="2" idempotent="true" retries="2"')
    async with in_process(path) as organism:
        start = trio.current_time()
        reply = await organism.request(Flaky(mode=mode), to="flaky", timeout=60)
        took = trio.current_time() - start
    assert not reply.is_huh, reply.raw
    assert reply.payload.findtext("{urn:test:idem}attempts") == "2"
    [(key1, hop1), (key2, hop2)] = FLAKY_CALLS
    assert key1 == key2 == hop1 == hop2  # one delivery: its hop is its key
    assert list(FLAKY_EFFECTS) == [key1]  # the effect, deduped by key, was written once
    # A timed-out attempt costs its step-timeout; then backoff(1) = 1 s before the retry.
    assert took == pytest.approx(3 if mode == "hang" else 1, abs=0.05)


async def test_two_calls_get_two_keys(tmp_path, autojump_clock):
    path = boot_file(tmp_path, 'step-timeout="2" idempotent="true"')
    async with in_process(path) as organism:
        await organism.request(Flaky(mode="raise"), to="flaky", timeout=60)
        await organism.request(Flaky(mode="raise"), to="flaky", timeout=60)
    keys = [k for k, _ in FLAKY_CALLS]
    assert len(keys) == 4 and keys[0] == keys[1] != keys[2] == keys[3]


async def test_a_non_idempotent_step_times_out_once_and_the_caller_is_told(
    tmp_path, autojump_clock
):
    path = boot_file(tmp_path, 'step-timeout="2"')
    async with in_process(path) as organism:
        start = trio.current_time()
        reply = await organism.request(Flaky(mode="hang"), to="flaky", timeout=60)
        took = trio.current_time() - start
    assert reply.payload.tag.endswith("SystemError")
    assert "timeout" in reply.raw.decode()
    assert len(FLAKY_CALLS) == 1
    assert took == pytest.approx(2, abs=0.05)  # the step-timeout, not the pump's 30 s


async def test_retries_used_up_end_the_step_with_the_failure(tmp_path, autojump_clock):
    path = boot_file(tmp_path, 'idempotent="true" retries="0"')
    async with in_process(path) as organism:
        reply = await organism.request(Flaky(mode="raise"), to="flaky", timeout=60)
    assert reply.is_huh
    assert len(FLAKY_CALLS) == 1
