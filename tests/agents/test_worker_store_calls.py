"""The store calls a Turn costs the worker (each one transaction, on PostgreSQL one thread
hop): its reads are folded into the transactions around them, and a runner does not poll
for a report that cannot be due yet."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agents_fakes import make_harness, result, task
from test_agents_protocol import answer_after_tool


def count_calls(store: Any) -> list[str]:
    """The store functions ``store`` runs from now on, in order."""
    calls: list[str] = []

    def wrap(method: Callable) -> Callable:
        async def counted(fn: Callable, *args: Any) -> Any:
            calls.append(fn.__name__)
            return await method(fn, *args)

        return counted

    for name in ("_run", "_read", "_run1"):
        setattr(store, name, wrap(getattr(store, name)))
    return calls


async def test_a_turn_with_one_tool_call_takes_its_steps_with_its_claims(tmp_path):
    h = make_harness(tmp_path, answer_after_tool)
    calls = count_calls(h.rt.store)
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    assert calls == ["enqueue_turn"]
    del calls[:]
    assert await h.rt.worker.process_agent("assistant", poll_waiting=False) == 1
    # The claim, with the Turn started and its first step begun in the same transaction
    # (head and cards read in it); the step written with the loop detector's decision;
    # suspend; no claim after it: no report was due.
    assert calls == ["claim_next", "complete_screened_step", "suspend"]
    [(sub, _, _)] = h.tools.calls
    del calls[:]
    await h.rt.report_tool_result("assistant", sub, result("3"))
    assert await h.rt.worker.process_agent("assistant", poll_waiting=False) == 1
    # The report's claim applies it, resumes the Turn and opens its second step (and
    # returns the reply reference); the last step is written with the Turn's end.
    assert calls == [
        "report_tool_result",
        "claim_next",
        "finish",
        "mark_reply_sent",
        "claim_next",
    ]
    assert [e.status for e in h.task_events()] == ["succeeded"]
    assert h.replies.sent[0][1].endswith("3</sum>")
    assert len(h.llm.requests) == 2
    # The model saw the whole Turn: the task, its own call, the result.
    assert [m.role for m in h.llm.requests[1].messages] == ["system", "user", "assistant", "user"]
    assert h.sql("SELECT step_no, status, total_tokens FROM agent_steps ORDER BY step_no") == [
        (1, "completed", 15),
        (2, "completed", 15),
    ]
    assert [t for (t,) in h.sql("SELECT card_type FROM cards ORDER BY seq")] == [
        "task.input",
        "llm.message",
        "tool.call",
        "tool.result",
        "llm.message",
        "task.deliverable",
    ]


async def test_process_agent_polls_after_a_suspend_unless_told_not_to(tmp_path):
    h = make_harness(tmp_path, answer_after_tool)
    calls = count_calls(h.rt.store)
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    assert await h.rt.worker.process_agent("assistant") == 1
    assert calls[-2:] == ["suspend", "claim_next"]  # drains: one claim more, empty


async def test_a_runner_goes_on_when_a_report_came_before_the_suspend(tmp_path):
    h = make_harness(tmp_path, answer_after_tool)

    async def answer_immediately(sub, to):
        # The peer answers while the worker is still between the call and its suspend.
        await h.rt.report_tool_result("assistant", sub, result("3"))

    h.tools.on_call = answer_immediately
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    # The suspend made the early report due: the runner claims it and ends the Turn.
    assert await h.rt.worker.process_agent("assistant", poll_waiting=False) == 2
    assert [e.status for e in h.task_events()] == ["succeeded"]


async def test_a_claim_whose_step_fails_is_claimed_again_alone(tmp_path):
    """The claim with its first step raised (rolled back, nothing claimed): the worker
    claims the row alone and takes the step the old way, so the Turn goes on."""
    h = make_harness(tmp_path, answer_after_tool)
    calls = count_calls(h.rt.store)

    async def broken(*args: Any) -> Any:
        raise RuntimeError("the step's transaction failed")

    h.rt.store.claim_next = broken
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    assert await h.rt.worker.process_agent("assistant", poll_waiting=False) == 1
    assert calls[1:3] == ["claim_due", "start_turn_step"]
    [(sub, _, _)] = h.tools.calls
    await h.rt.report_tool_result("assistant", sub, result("3"))
    await h.rt.worker.process_agent("assistant")
    assert [e.status for e in h.task_events()] == ["succeeded"]
