"""The store calls a Turn costs the worker (each one transaction, on PostgreSQL one thread
hop): its reads are folded into the transactions around them, and a runner does not poll
for a report that cannot be due yet."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agents_fakes import make_harness, result, task
from test_agents_protocol import answer_after_tool

from agentserver.agents.store.sql import head as sql_head


def count_calls(store: Any) -> list[str]:
    """The store functions ``store`` runs from now on, in order."""
    calls: list[str] = []

    def wrap(method: Callable) -> Callable:
        async def counted(fn: Callable, *args: Any, **kwargs: Any) -> Any:
            calls.append(fn.__name__)
            return await method(fn, *args, **kwargs)

        return counted

    for name in ("run", "read", "run1"):
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
    # (head and cards read in it); the step written with the loop detector's decision
    # and the suspend, in one transaction; no claim after it: no report was due.
    assert calls == ["claim_next", "suspend"]
    [(sub, _, _)] = h.tools.calls
    del calls[:]
    await h.rt.report_tool_result("assistant", sub, result("3"))
    assert await h.rt.worker.process_agent("assistant", poll_waiting=False) == 1
    # The report is applied as it is recorded: the Turn resumed, its second step opened
    # (and its reply reference returned), with no inbox row and no claim; the runner
    # takes it over; the last step is written with the Turn's end.
    assert calls == [
        "apply_tool_result",
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


async def test_a_report_during_its_call_is_due_once_the_runner_lets_go(tmp_path):
    h = make_harness(tmp_path, answer_after_tool)

    async def answer_immediately(sub, to):
        # The peer answers before the call returns (the suspend was written before it).
        await h.rt.report_tool_result("assistant", sub, result("3"))

    h.tools.on_call = answer_immediately
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    assert await h.rt.worker.process_agent("assistant", poll_waiting=False) == 1
    # The report rang the doorbell; the next round claims it and ends the Turn.
    assert await h.rt.worker.process_agent("assistant", poll_waiting=False) == 1
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


async def test_a_turn_a_report_resumed_is_rerun_after_a_crash_before_its_runner(tmp_path):
    """The report's transaction resumed the Turn and handed it to this process's worker;
    the process dies before a runner takes it: the Turn is a running one, which the
    restart's recovery runs again, and it is answered once."""
    h = make_harness(tmp_path, answer_after_tool)
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    assert await h.rt.worker.process_agent("assistant", poll_waiting=False) == 1
    [(sub, _, _)] = h.tools.calls
    assert await h.rt.report_tool_result("assistant", sub, result("3")) == "applied"
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.status == "running" and head.step_count == 2  # resumed, its step opened
    await h.rt.aclose()  # "dies": nobody ran the Turn it was handed

    h2 = make_harness(tmp_path, answer_after_tool, clock=h.clock)
    await h2.rt.recover()
    await h2.pump()
    assert [e.status for e in h2.task_events()] == ["succeeded"]
    assert len(h2.replies.sent) == 1 and h2.replies.sent[0][1].endswith("3</sum>")
    assert h2.sql("SELECT count(*) FROM cards WHERE card_type = 'tool.result'") == [(1,)]


async def test_a_handed_over_turn_runs_before_the_agents_next_claim(tmp_path):
    """A Turn a report resumed is run by the agent's next runner before it claims
    anything (the task queued behind it waits its turn)."""
    h = make_harness(tmp_path, answer_after_tool)
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    assert await h.rt.worker.process_agent("assistant", poll_waiting=False) == 1
    await h.rt.enqueue("assistant", task("2+2"), "ref2")
    [(sub, _, _)] = h.tools.calls
    await h.rt.report_tool_result("assistant", sub, result("3"))
    calls = count_calls(h.rt.store)
    assert await h.rt.worker.process_agent("assistant", poll_waiting=False) >= 2
    assert calls[0] == "finish"  # the handed Turn first, then the next task's claim
    assert calls[1:].count("claim_next") >= 1
    assert [e.status for e in h.task_events()] == ["succeeded"]
