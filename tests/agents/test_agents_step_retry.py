"""Step retry (issue 12): the worker retries a step the router gave up on, durably.

A real SQLite store and the manual wall clock: a retry wait is a ``resume`` row due at
``now + delay``, so the tests move the clock and check what becomes due when.
"""

from __future__ import annotations

import json

import pytest
from agents_fakes import make_harness, profile, task
from hypothesis import given
from hypothesis import strategies as st

from agentserver.agents.errors import LLMUnavailable
from agentserver.agents.events import StepEvent
from agentserver.agents.ports import LLMCompletion, LLMUsage
from agentserver.agents.profile.retry import (
    RETRY_TABLE,
    GiveUp,
    RetryPolicy,
    RetryStep,
    decide_retry,
)
from agentserver.agents.store.sql import head as sql_head


class FlakyLLM:
    """Raises ``failures`` (kind, retry_after) in order, then answers."""

    def __init__(self, failures: list[tuple[str, float | None]], answer: str = "done") -> None:
        self.failures = list(failures)
        self.answer = answer
        self.calls = 0

    async def complete(self, request):
        self.calls += 1
        if self.failures:
            kind, after = self.failures.pop(0)
            raise LLMUnavailable(f"{kind} from the fake", kind=kind, retry_after=after)
        return LLMCompletion(self.answer, LLMUsage(10, 5, 15), model="m", backend="fake")


def flaky_harness(tmp_path, failures, **profile_kw):
    h = make_harness(tmp_path, lambda req: "unused", profiles={"assistant": profile(**profile_kw)})
    h.rt.worker.llm = llm = FlakyLLM(failures)
    return h, llm


async def run_waits(h) -> list[float]:
    """Pump, and each time a retry wait is pending move the clock to its due time."""
    waits = []
    await h.pump()
    while due := h.sql(
        "SELECT next_retry_at FROM agent_inbox WHERE message_type = 'resume' AND status = 'pending'"
    ):
        waits.append(round(due[0][0] - h.clock.now(), 6))
        assert await h.pump() == 0  # not due yet: nothing runs early
        h.clock.set(due[0][0])
        await h.pump()
    return waits


async def test_503_five_times_then_success_with_five_step_retries(tmp_path):
    h, llm = flaky_harness(tmp_path, [("OVERLOADED", None)] * 5, step_retries=5)
    await h.rt.enqueue("assistant", task("x"), "ref")
    assert await run_waits(h) == [2, 4, 8, 16, 32]
    assert llm.calls == 6
    assert [(r[1], r[2]) for r in h.replies.sent] == [("done", False)]
    # The failed attempts left no card: one llm.message for the one step that answered.
    assert h.sql("SELECT count(*) FROM cards WHERE card_type = 'llm.message'") == [(1,)]
    steps = h.sql("SELECT status, metadata FROM agent_steps ORDER BY started_at, rowid")
    assert [s for s, _ in steps] == ["retrying"] * 5 + ["completed"]
    metas = [json.loads(m) for s, m in steps if s == "retrying"]
    assert [(m["attempt"], m["kind"], m["delay_s"]) for m in metas] == [
        (n, "OVERLOADED", 2.0 * 2 ** (n - 1)) for n in range(1, 6)
    ]
    retrying = [e for e in h.events.drain() if isinstance(e, StepEvent) and e.phase == "retrying"]
    assert [(e.attempt, e.kind, e.delay_s) for e in retrying] == [
        (n, "OVERLOADED", 2.0 * 2 ** (n - 1)) for n in range(1, 6)
    ]
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.status == "idle"


async def test_retries_exhausted_give_one_failed_answer(tmp_path):
    h, llm = flaky_harness(tmp_path, [("SERVER_ERROR", None)] * 10)
    await h.rt.enqueue("assistant", task("x"), "ref")
    assert await run_waits(h) == [2, 4, 8]
    assert llm.calls == 4
    [(_, text, failed, _)] = h.replies.sent
    assert failed and "SERVER_ERROR" in text


async def test_retry_after_45_is_honoured(tmp_path):
    h, _llm = flaky_harness(tmp_path, [("RATE_LIMIT", 45.0)])
    await h.rt.enqueue("assistant", task("x"), "ref")
    assert await run_waits(h) == [45]
    assert [(r[1], r[2]) for r in h.replies.sent] == [("done", False)]


async def test_retry_after_3600_is_capped_then_fails(tmp_path):
    h, _llm = flaky_harness(tmp_path, [("RATE_LIMIT", 3600.0)] * 10)
    await h.rt.enqueue("assistant", task("x"), "ref")
    assert await run_waits(h) == [60, 60, 60]
    [(_, _text, failed, _)] = h.replies.sent
    assert failed and len(h.task_events()) == 1


async def test_auth_failure_is_one_call_and_one_failed_answer(tmp_path):
    h, llm = flaky_harness(tmp_path, [("AUTH_PERMANENT", None)] * 3)
    await h.rt.enqueue("assistant", task("x"), "ref")
    assert await run_waits(h) == []
    assert llm.calls == 1
    [(_, _, failed, _)] = h.replies.sent
    assert failed


async def test_retry_counts_do_not_use_up_the_step_limit(tmp_path):
    h, _llm = flaky_harness(tmp_path, [("OVERLOADED", None)] * 3, max_steps=1)
    await h.rt.enqueue("assistant", task("x"), "ref")
    await run_waits(h)
    assert [(r[1], r[2]) for r in h.replies.sent] == [("done", False)]


async def test_stop_during_the_wait_ends_the_turn_at_once(tmp_path):
    h, llm = flaky_harness(tmp_path, [("OVERLOADED", None)])
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    assert (await h.rt.store.read(sql_head.read, "assistant")).status == "running"
    assert await h.rt.stop("assistant")
    assert [e.status for e in h.task_events()] == ["stopped"]
    assert h.sql("SELECT status FROM agent_inbox WHERE message_type = 'resume'") == [("skipped",)]
    h.clock.advance(10)
    assert await h.pump() == 0
    assert llm.calls == 1 and len(h.replies.sent) == 1


async def test_restart_during_the_wait_keeps_the_due_time_and_the_count(tmp_path):
    h, llm = flaky_harness(tmp_path, [("OVERLOADED", None)] * 2, step_retries=2)
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    await h.pump()  # first wait (2 s) pending, not due
    h.clock.advance(1)
    await h.rt.aclose()  # "crash" one second into the two-second wait
    h2 = make_harness(
        tmp_path,
        lambda req: "unused",
        profiles={"assistant": profile(step_retries=2)},
        clock=h.clock,
    )
    h2.rt.worker.llm = llm
    await h2.rt.recover()
    assert await h2.pump() == 0  # the wait goes on: one second left
    h2.clock.advance(1)
    assert await run_waits(h2) == [4]  # second retry: the count survived the restart
    assert [(r[1], r[2]) for r in h2.replies.sent] == [("done", False)]
    assert llm.calls == 3


def test_the_decision_table_covers_every_router_error_kind():
    from agentserver.llm.classify import ErrorKind

    assert set(RETRY_TABLE) == {k.value for k in ErrorKind}


@given(
    kind=st.sampled_from([*RETRY_TABLE, "connect", "stream"]),
    after=st.none() | st.floats(0, 10_000),
    done=st.integers(0, 10),
    retries=st.integers(0, 6),
    base=st.floats(0, 10),
    cap=st.floats(0, 600),
)
def test_decide_retry_rule(kind, after, done, retries, base, cap):
    policy = RetryPolicy(retries, base, cap)
    d = decide_retry(kind, after, done, policy)
    if not RETRY_TABLE.get(kind, False) or done >= retries:
        assert isinstance(d, GiveUp)
        return
    assert isinstance(d, RetryStep) and d.attempt == done + 1
    expected = min(after, cap) if after is not None else base * 2**done
    assert d.delay_s == pytest.approx(expected)


async def test_chunks_of_a_failed_attempt_are_marked_by_the_retrying_event(tmp_path):
    import contextlib

    from agentserver.agents.events import ChunkEvent

    class CutStream:
        def __init__(self) -> None:
            self.calls = 0

        @contextlib.asynccontextmanager
        async def stream(self, request):
            self.calls += 1
            first = self.calls == 1

            async def items():
                yield "Half an ans"
                if first:
                    raise LLMUnavailable("overloaded mid-stream", kind="OVERLOADED")
                yield "wer, whole."
                yield LLMCompletion("Half an answer, whole.")

            yield items()

        async def complete(self, request):  # pragma: no cover - stream is preferred
            raise AssertionError("complete() used although stream() exists")

    h = make_harness(tmp_path, lambda req: "unused")
    h.rt.worker.llm = CutStream()
    await h.rt.enqueue("assistant", task("x"), "ref")
    assert await run_waits(h) == [2]
    events = [e for e in h.events.drain() if isinstance(e, (ChunkEvent, StepEvent))]
    retrying = next(e for e in events if isinstance(e, StepEvent) and e.phase == "retrying")
    failed_chunks = [
        e.text for e in events if isinstance(e, ChunkEvent) and e.step_id == retrying.step_id
    ]
    assert failed_chunks == ["Half an ans"]  # published before the failure, then disowned
    cards = h.sql("SELECT content FROM cards WHERE card_type = 'llm.message'")
    assert cards == [("Half an answer, whole.",)]  # no partial text in the history
    assert [r[1] for r in h.replies.sent] == ["Half an answer, whole."]
