"""The chaos bench's checkers of issue 47's doors, sans-IO: MCP tasks
(bench/support/chaos_mcp.py ``check_mcp``) and AG-UI runs (bench/support/chaos_agui.py
``check_agui``): a clean record passes, and each promise broken is found."""

from __future__ import annotations

import os
import sys

# The chaos bench's modules (bench/support/).
sys.path.append(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "support")
)

from chaos_agui import AguiRun, Stream, check_agui, run_thread
from chaos_mcp import LEGACY, MODERN, McpCall, check_mcp, nonce_threads


def expected(nonce: str, text: str) -> list[list[str]]:
    return [[f"PROOF[stamp:{nonce}]"]]


def good(nonce: str) -> str:
    return f"RESULT nonce={nonce} stamp=PROOF[stamp:{nonce}]"


def task_call(nonce: str, task: str, **kw: object) -> McpCall:
    call = McpCall(nonce, "beta", MODERN, sends=1, task_ids=[task])
    call.ends.append(("tasks/get", "completed", good(nonce), False))
    call.ends.append(("reread", "completed", good(nonce), False))
    for key, value in kw.items():
        setattr(call, key, value)
    return call


def mcp(calls: list[McpCall], stored: dict, answers: dict | None = None, pruned=()):
    return check_mcp(calls, expected, stored, answers or {}, lambda t: t in pruned)


def test_mcp_clean_calls_pass():
    plain = McpCall("n2", "gamma", LEGACY, sends=1)
    plain.ends.append(("tools/call", "completed", "the task was cancelled", True))
    counts, violations = mcp([task_call("n1", "t1"), plain], {"n1": ["t1"], "n2": ["t2"]})
    assert violations == []
    assert counts["mcp_by_state"] == {"completed": 2}
    assert counts["mcp_failed_by_reason"] == {"cancelled": 1}


def test_mcp_a_second_task_is_unknown_only_after_a_lost_answer():
    lost = task_call("n1", "t1b", sends=2, lost=1)
    counts, violations = mcp([lost], {"n1": ["t1a", "t1b"]})
    assert violations == [] and counts["mcp_second_task_after_loss"] == 1
    counts, violations = mcp([task_call("n1", "t1")], {"n1": ["t1", "t9"]})
    assert counts["mcp_twice"] == 1 and "became 2 tasks" in violations[0]


def test_mcp_each_broken_promise_is_found():
    differently = task_call("n1", "t1")
    differently.ends.append(("settle", "cancelled", "stopped", True))
    wrong = task_call("n2", "t2")
    wrong.ends[:] = [("tasks/get", "completed", "RESULT nonce=n2", False)]
    unended = McpCall("n3", "beta", MODERN, sends=1, task_ids=["t3"])
    not_stored = task_call("n4", "t4")
    missing = task_call("n5", "t5", not_found=[("t5", "no task")])
    counts, violations = mcp(
        [differently, wrong, unended, not_stored, missing],
        {"n1": ["t1"], "n2": ["t2"], "n3": ["t3"], "n5": ["t5"]},
        answers={"t1": [False, False], "t2": [True]},
    )
    assert counts["mcp_ended_differently"] == 1
    assert counts["mcp_wrong_content"] == 1
    assert counts["mcp_unended"] == 1
    assert counts["mcp_handle_not_stored"] == 1
    assert counts["mcp_get_not_found"] == 1
    assert counts["mcp_answered_twice"] == 1
    assert counts["mcp_state_not_the_stores"] == 1  # t2: completed here, failed there
    assert len(violations) == 7


def test_mcp_a_pruned_task_is_not_held_against_the_server():
    pruned = task_call("n1", "t1", not_found=[("t1", "no task")])
    counts, violations = mcp([pruned], {"n1": []}, pruned={"t1"})
    assert violations == [] and counts["mcp_get_not_found"] == 0


def test_nonce_threads_reads_the_callers_thread():
    ref = '{"hop": "h", "caller_thread": "t1", "chain": ["mcp", "beta"]}'
    rows = [(ref, "<task><text>NONCE[00000000000000aa]</text></task>\n"), ("x", "")]
    assert nonce_threads(rows, ["00000000000000aa", "00000000000000bb"]) == {
        "00000000000000aa": ["t1"],
        "00000000000000bb": [],
    }


def agui_run(nonce: str, ends: list[tuple[str, str]]) -> AguiRun:
    run = AguiRun(nonce, "beta", f"t-{nonce}", f"r-{nonce}")
    stream = Stream(started=True, ends=list(ends), last_terminal=True, whole=True)
    stream.thread = run_thread("agui", "beta", run.thread_id, run.run_id)
    run.streams.append(stream)
    run.ends.extend(e for e in ends if e[0] != "interrupt")
    return run


def test_agui_clean_runs_pass():
    ok = agui_run("n1", [("finished", good("n1"))])
    failed = agui_run("n2", [("error:failed", "the model did not answer within 4 s")])
    thread = ok.streams[0].thread
    answers = {thread: [False]}
    counts, violations = check_agui([ok, failed], expected, {"n1": [thread]}, answers)
    assert violations == []
    assert counts["agui_by_end"] == {"error": 1, "finished": 1}


def test_agui_each_broken_promise_is_found():
    twice_ended = agui_run("n1", [("finished", good("n1")), ("finished", good("n1"))])
    wrong = agui_run("n2", [("finished", "RESULT nonce=n2")])
    differently = agui_run("n3", [("finished", good("n3"))])
    differently.ends.append(("cancelled", ""))
    unended = AguiRun("n4", "beta", "t", "r")
    duplicate = agui_run("n5", [("finished", good("n5"))])
    thread = duplicate.streams[0].thread
    counts, violations = check_agui(
        [twice_ended, wrong, differently, unended, duplicate],
        expected,
        {"n5": [thread, thread]},
        {thread: [False, False], wrong.streams[0].thread: [True]},
    )
    assert counts["agui_bad_end"] == 1
    assert counts["agui_wrong_content"] == 1
    assert counts["agui_ended_differently"] == 1
    assert counts["agui_unended"] == 1
    assert counts["agui_twice"] == 1
    assert counts["agui_answered_twice"] == 1
    assert counts["agui_end_not_the_stores"] == 1  # n2: finished here, failed there
    assert len(violations) == 7


def test_agui_a_stream_we_dropped_is_not_judged():
    run = agui_run("n1", [("finished", good("n1"))])
    run.streams.append(Stream(started=True, whole=False))
    counts, violations = check_agui([run], expected, {}, {})
    assert violations == [] and counts["agui_streams"] == 2


def test_a2a_03_shapes_are_read_as_10s():
    """The A2A client's 0.3 share: a 0.3 task (``kind``, lower-case states) and its
    stream's ``status-update`` end a task as 1.0's shapes do, and are checked alike."""
    from chaos_a2a import A2aClient, A2aTask, check_a2a

    client = A2aClient(1, servers=None, switches=None, token="t")
    sent = A2aTask("m1", "n1", "beta", "send", wire="0.3")
    client.saw(
        sent,
        {
            "kind": "task",
            "id": "task-1",
            "status": {"state": "completed"},
            "artifacts": [{"parts": [{"kind": "text", "text": good("n1")}]}],
        },
    )
    streamed = A2aTask("m2", "n2", "gamma", "stream", wire="0.3-no-header")
    update = {"kind": "status-update", "taskId": "task-2", "status": {"state": "canceled"}}
    client.saw_update(streamed, update, "")
    assert client.wire_of("GetTask", "0.3") == (
        "tasks/get",
        {"Authorization": "Bearer t", "A2A-Version": "0.3"},
    )
    assert client.wire_of("SendMessage", "0.3-no-header")[0] == "message/send"
    assert "A2A-Version" not in client.wire_of("SendMessage", "0.3-no-header")[1]
    counts, violations = check_a2a([sent, streamed], expected)
    assert violations == [], violations
    assert counts["a2a_by_wire"] == {"0.3": {"completed": 1}, "0.3-no-header": {"canceled": 1}}
