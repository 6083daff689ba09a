"""The AgentTurn protocol end to end on a real SQLite file, with a manual clock."""

from __future__ import annotations

import trio
from agents_fakes import CALC, SEARCH, last_user, make_harness, profile, result, task

from agentserver.agents.store.base import TaskStatus
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.sql import memory

ADD = '<add xmlns="urn:calc"><a>1</a><b>2</b></add>'
QUERY = '<query xmlns="urn:search"><q>x</q></query>'


def answer_after_tool(req):
    """Step 1: call the calculator. Step 2 (after its result): answer."""
    text = last_user(req)
    if text.startswith("Result from") or "failed" in text:
        return f"The answer is based on: {text.splitlines()[-1]}"
    return f"Let me compute. {ADD}"


def echo(req):
    return "echo: " + last_user(req).split("<text>")[1].split("</text>")[0]


async def test_two_enqueues_to_idle_agent_one_lease_fifo_one_event_each(tmp_path):
    h = make_harness(tmp_path, echo)
    await h.rt.enqueue("assistant", task("first"), {"thread": "t1"})
    await h.rt.enqueue("assistant", task("second"), {"thread": "t2"})
    leases = h.sql("SELECT count(*) FROM execution_edges WHERE primitive = 'lease'")
    assert leases == [(1,)]  # the second Turn waits, queued
    assert h.sql("SELECT status FROM agent_inbox ORDER BY seq") == [("pending",), ("queued",)]
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.status == "dispatched" and head.turn_epoch == 1

    await h.pump()

    events = h.task_events()
    assert [e.status for e in events] == ["succeeded", "succeeded"]
    assert len({e.agent_turn_id for e in events}) == 2
    assert [(r[0]["thread"], r[1]) for r in h.replies.sent] == [
        ("t1", "echo: first"),
        ("t2", "echo: second"),
    ]
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.status == "idle" and head.agent_turn_id is None and head.turn_epoch == 2
    assert h.sql("SELECT count(*) FROM execution_edges WHERE primitive = 'lease'") == [(2,)]


async def test_tool_result_delivered_twice_is_applied_once(tmp_path):
    h = make_harness(tmp_path, answer_after_tool)
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    await h.pump()
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.status == "suspended" and head.waiting_tool_count == 1
    [(sub, to, _)] = h.tools.calls
    assert to == "calculator"
    await h.rt.report_tool_result("assistant", sub, result("3"))
    await h.rt.report_tool_result("assistant", sub, result("3"))
    await h.pump()
    assert [e.status for e in h.task_events()] == ["succeeded"]
    assert h.replies.sent[0][1].endswith("3</sum>")
    # The first was applied as it was recorded (no inbox row); the second, which its
    # Turn no longer waits for, was kept and acknowledged as a duplicate.
    statuses = h.sql("SELECT status FROM agent_inbox WHERE message_type = 'tool_result'")
    assert [s for (s,) in statuses] == ["skipped"]
    assert h.sql("SELECT count(*) FROM cards WHERE card_type = 'tool.result'") == [(1,)]
    assert len(h.llm.requests) == 2


async def test_a_result_arriving_during_its_call_finds_the_suspend_written(tmp_path):
    h = make_harness(tmp_path, answer_after_tool)

    async def answer_immediately(sub, to):
        # The peer answers before the worker's call returns: the waiting set was written
        # before the call went out, so the report is never deferred.
        head = await h.rt.store.read(sql_head.read, "assistant")
        assert head.status == "suspended" and head.waiting_tool_count == 1
        await h.rt.report_tool_result("assistant", sub, result("3"))

    h.tools.on_call = answer_immediately
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    await h.pump()
    # Applied as it was recorded: never deferred, no inbox row at all.
    assert h.sql("SELECT count(*) FROM agent_inbox WHERE message_type = 'tool_result'") == [(0,)]
    assert [e.status for e in h.task_events()] == ["succeeded"]
    assert h.sql("SELECT count(*) FROM cards WHERE card_type = 'tool.result'") == [(1,)]


async def test_two_parallel_tool_calls_answered_by_two_peers(tmp_path):
    def script(req):
        if len(req.messages) == 2:
            return f"Both at once: {ADD} and {QUERY}"
        return "done with " + " | ".join(m.content for m in req.messages[-2:])

    h = make_harness(tmp_path, script)
    await h.rt.enqueue("assistant", task("go"), "ref")
    await h.pump()
    assert [to for _, to, _ in h.tools.calls] == ["calculator", "search"]
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.status == "suspended" and head.waiting_tool_count == 2
    (s1, _, _), (s2, _, _) = h.tools.calls
    await h.rt.report_tool_result("assistant", s2, b"<hits xmlns='urn:search'>7</hits>")
    await h.pump()
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.status == "suspended" and head.waiting_tool_count == 1
    await h.rt.report_tool_result("assistant", s1, result("3"))
    await h.pump()
    [event] = h.task_events()
    assert event.status == "succeeded"
    assert "search" in h.replies.sent[0][1] and "calculator" in h.replies.sent[0][1]
    assert (await h.rt.store.read(sql_head.read, "assistant")).turn_epoch == 2  # lease + one resume


async def test_tool_that_never_answers_times_out_resumes_and_ignores_late_result(tmp_path):
    h = make_harness(tmp_path, answer_after_tool)
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    await h.pump()
    [(sub, _, _)] = h.tools.calls
    h.clock.advance(10)
    assert (await h.rt.watchdog.tick())["timeouts"] == 0
    h.clock.advance(25)  # past the 30 s resume deadline
    assert (await h.rt.watchdog.tick())["timeouts"] == 1
    assert (await h.rt.watchdog.tick())["timeouts"] == 0  # injected once
    await h.pump()
    [event] = h.task_events()
    assert event.status == "succeeded"
    assert "timed out" in h.llm.requests[-1].messages[-1].content
    await h.rt.report_tool_result("assistant", sub, result("3"))
    await h.pump()
    assert h.task_events() == []
    assert h.sql("SELECT status FROM agent_inbox WHERE message_type = 'tool_result'") == [
        ("skipped",)
    ]
    assert h.sql("SELECT status FROM turn_waiting_tools") == [("timeout",)]


async def test_stop_while_suspended(tmp_path):
    h = make_harness(tmp_path, answer_after_tool)
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    await h.pump()
    epoch = (await h.rt.store.read(sql_head.read, "assistant")).turn_epoch
    assert await h.rt.stop("assistant")
    assert not await h.rt.stop("assistant")  # nothing left to stop
    [event] = h.task_events()
    assert event.status == TaskStatus.STOPPED
    card = await h.rt.store.read(memory.card, event.deliverable_card_id)
    assert card is not None and card.card_type == "task.deliverable"
    assert h.replies.sent[0][2] is True  # failed
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.status == "idle" and head.turn_epoch == epoch + 1
    [(sub, _, _)] = h.tools.calls
    await h.rt.report_tool_result("assistant", sub, result("3"))
    await h.pump()
    assert h.task_events() == [] and len(h.llm.requests) == 1


async def test_worker_dies_mid_turn_watchdog_reaps_and_stale_writes_do_nothing(tmp_path):
    h = make_harness(tmp_path, lambda req: f"calling {ADD}", max_running_s=100)
    h.llm.gate = trio.Event()
    await h.rt.enqueue("assistant", task("x"), "ref")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(h.pump)
        await h.llm.entered.wait()  # the model call is in flight
        h.clock.advance(101)
        assert (await h.rt.watchdog.tick())["ended"] == 1
        head = await h.rt.store.read(sql_head.read, "assistant")
        assert head.status == "idle" and head.turn_epoch == 2
        cards_before = h.sql("SELECT count(*) FROM cards")
        h.llm.gate.set()  # the stale worker wakes up and tries to go on
    assert h.tools.calls == []  # fenced before any side effect
    assert h.sql("SELECT count(*) FROM cards") == cards_before
    [event] = h.task_events()
    assert event.status == TaskStatus.TIMED_OUT
    assert len(h.replies.sent) == 1 and h.replies.sent[0][2]
    assert h.sql("SELECT status FROM agent_steps") == [("started",)]


async def test_dispatched_but_never_started_is_ended_and_next_turn_runs(tmp_path):
    h = make_harness(tmp_path, echo, dispatch_timeout_s=60)
    await h.rt.enqueue("assistant", task("lost"), "r1")
    h.clock.advance(30)
    await h.rt.enqueue("assistant", task("next"), "r2")
    h.clock.advance(31)  # 61 s after dispatch, 31 s after the second enqueue
    done = await h.rt.watchdog.tick()
    assert done["ended"] == 1
    [event] = h.task_events()
    assert event.status == TaskStatus.TIMED_OUT
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.status == "dispatched"  # the next queued Turn got leased
    await h.pump()
    assert [e.status for e in h.task_events()] == ["succeeded"]
    assert [(r[0], r[2]) for r in h.replies.sent] == [("r1", True), ("r2", False)]
    assert h.sql("SELECT status FROM agent_inbox ORDER BY seq") == [("skipped",), ("consumed",)]


async def test_malformed_queued_turn_is_marked_error_and_next_one_runs(tmp_path):
    h = make_harness(tmp_path, echo)
    await h.rt.enqueue("assistant", b"<task xmlns='urn:agentserver:assistant'><text>oops", "r1")
    await h.rt.enqueue("assistant", task("fine"), "r2")
    await h.pump()
    assert h.sql("SELECT status FROM agent_inbox ORDER BY seq") == [("error",), ("consumed",)]
    assert [e.status for e in h.task_events()] == ["failed", "succeeded"]
    assert [(r[0], r[2]) for r in h.replies.sent] == [("r1", True), ("r2", False)]
    assert "not well-formed" in h.replies.sent[0][1]


async def test_deferred_row_exhausts_its_retries(tmp_path):
    h = make_harness(tmp_path, echo, max_retries=3, retry_base_s=1.0)
    await h.rt.report_tool_result("assistant", "no-such-call", result("3"))
    for _ in range(10):
        h.clock.advance(10)
        await h.rt.watchdog.tick()
        await h.pump()
    [(status, retries, reason)] = h.sql("SELECT status, retry_count, defer_reason FROM agent_inbox")
    assert status == "error" and retries == 3 and "exhausted" in reason


async def test_no_llm_backend_ends_with_one_clear_failed_answer(tmp_path):
    h = make_harness(tmp_path, echo)
    h.llm.fail = "connection refused"
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    [event] = h.task_events()
    assert event.status == "failed"
    [(_, text, failed, _)] = h.replies.sent
    assert failed and "could not be reached" in text
    assert (await h.rt.store.read(sql_head.read, "assistant")).status == "idle"


async def test_failed_turns_answer_status_failed_and_successes_carry_no_status(tmp_path):
    h = make_harness(
        tmp_path,
        lambda req: (
            "<task><text>again</text></task>"
            if any("loop" in m.content for m in req.messages)
            else echo(req)
        ),
        profiles={"assistant": profile(failure_status=True)},
    )
    await h.rt.enqueue("assistant", b"<task xmlns='urn:agentserver:assistant'><text>oops", "r1")
    await h.rt.enqueue("assistant", task("fine"), "r2")
    await h.rt.enqueue("assistant", task("loop"), "r3")
    await h.pump()
    h.llm.fail = "connection refused"
    await h.rt.enqueue("assistant", task("x"), "r4")
    await h.pump()
    h.llm.fail, h.llm.gate = None, trio.Event()
    await h.rt.enqueue("assistant", task("stop me"), "r5")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(h.pump)
        await h.llm.entered.wait()
        assert await h.rt.stop("assistant")
        h.llm.gate.set()
    assert [e.status for e in h.task_events()] == [
        "failed",  # malformed task
        "succeeded",
        "failed",  # step limit
        "failed",  # no model
        "stopped",
    ]
    assert [r[0] for r in h.replies.sent] == ["r1", "r2", "r3", "r4", "r5"]
    assert h.replies.statuses == ["failed", None, "failed", "failed", "failed"]
    assert [r[2] for r in h.replies.sent] == [True, False, True, True, True]


async def test_llm_that_hangs_is_bounded_by_llm_timeout(tmp_path, autojump_clock):
    h = make_harness(tmp_path, echo, profiles={"assistant": profile(llm_timeout_s=5)})
    h.llm.gate = trio.Event()  # never set
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    [(_, text, failed, _)] = h.replies.sent
    assert failed and "did not answer" in text
    assert h.replies.statuses == [None]  # the profile's reply type takes no status


async def test_step_limit_ends_a_turn(tmp_path):
    h = make_harness(tmp_path, lambda req: "<task><text>again</text></task>")
    await h.rt.enqueue("assistant", task("loop"), "ref")
    await h.pump()
    assert len(h.tools.self_calls) == 6 and len(h.llm.requests) == 6
    [event] = h.task_events()
    assert event.status == "failed"
    assert "step limit" in h.replies.sent[0][1]
    assert h.sql("SELECT count(*), sum(total_tokens), sum(cost) FROM agent_steps") == [
        (6, 90, 0.006)
    ]


async def test_self_iteration_continues_the_same_turn(tmp_path):
    def script(req):
        if "self-iteration accepted" in last_user(req):
            return "final"
        return "<task><text>think more</text></task>"  # namespace resolved: own root tag

    h = make_harness(tmp_path, script)
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    assert len(h.tools.self_calls) == 1
    assert 'xmlns="urn:agentserver:assistant"' in h.tools.self_calls[0]
    [event] = h.task_events()
    assert event.status == "succeeded" and h.replies.sent[0][1] == "final"
    assert h.sql("SELECT count(*) FROM execution_edges WHERE primitive = 'lease'") == [(1,)]


async def test_refused_and_ambiguous_payloads_earn_a_huh_and_the_model_retries(tmp_path):
    p = profile(peers={CALC: "calculator", "{urn:other}add": "adder", SEARCH: "search"})

    def script(req):
        n = len(h.llm.requests)
        if n == 1:
            return "<add><a>1</a></add>"  # ambiguous: two peers have <add>
        if n == 2:
            return QUERY  # refused by the pump
        return "giving up: " + last_user(req).splitlines()[0]

    h = make_harness(tmp_path, script, profiles={"assistant": p})
    h.tools.refuse = {SEARCH}
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    assert h.tools.calls == []
    assert "refused" in h.llm.requests[1].messages[-1].content
    assert "ambiguous" in h.llm.requests[1].messages[-1].content
    assert h.replies.sent[0][1] == "giving up: Your payload was refused:"
    assert h.sql("SELECT count(*) FROM cards WHERE card_type = 'sys.huh'") == [(2,)]


async def test_an_unknown_element_gets_one_huh_and_is_never_the_answer(tmp_path):
    def script(req):
        if len(h.llm.requests) == 1:
            return "<teleport><to>mars</to></teleport> and <fly/>"
        return "I cannot teleport; use the <b> tag only in prose."

    h = make_harness(tmp_path, script)
    await h.rt.enqueue("assistant", task("go to mars"), "ref")
    await h.pump()
    assert h.sql("SELECT count(*) FROM cards WHERE card_type = 'sys.huh'") == [(1,)]
    seen = h.llm.requests[1].messages[-1].content
    assert seen.startswith("Your payload was refused:") and "<teleport>, <fly>" in seen
    assert '<add xmlns="urn:calc"> (a tool call to calculator)' in seen
    assert [(r[1], r[2]) for r in h.replies.sent] == [
        ("I cannot teleport; use the <b> tag only in prose.", False)
    ]


async def test_submit_result_degraded_not_rejected(tmp_path):
    from agentserver.agents.profile.agent import ResultField

    p = profile(result_fields=(ResultField("total"), ResultField("unit")))
    h = make_harness(
        tmp_path,
        lambda req: '<submit_result><field name="total">3</field></submit_result>',
        profiles={"assistant": p},
    )
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    [event] = h.task_events()
    card = await h.rt.store.read(memory.card, event.deliverable_card_id)
    assert card is not None and card.content == "total: 3"
    assert card.metadata["degraded"] is True and card.metadata["fields"] == {"total": "3"}


async def test_must_end_with_asks_for_the_tool(tmp_path):
    p = profile(must_end_with=("submit_result",))

    def script(req):
        if "must end with" in last_user(req):
            return "<submit_result>42</submit_result>"
        return "plain answer"

    h = make_harness(tmp_path, script, profiles={"assistant": p})
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    assert h.replies.sent[0][1] == "result: 42" and len(h.llm.requests) == 2


async def test_terminate_tool_result_ends_the_turn(tmp_path):
    h = make_harness(
        tmp_path,
        answer_after_tool,
        profiles={"assistant": profile(terminate_tools=("calculator",))},
    )
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    [(sub, _, _)] = h.tools.calls
    await h.rt.report_tool_result("assistant", sub, result("3"))
    await h.pump()
    assert len(h.llm.requests) == 1
    assert h.replies.sent[0][1].endswith("3</sum>")


async def test_reply_retried_by_watchdog_until_sent(tmp_path):
    h = make_harness(tmp_path, echo, processing_timeout_s=5)
    h.replies.broken = True
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    assert h.replies.sent == []
    h.replies.broken = False
    h.clock.advance(6)
    assert (await h.rt.watchdog.tick())["replies"] == 1
    assert (await h.rt.watchdog.tick())["replies"] == 0
    assert len(h.replies.sent) == 1 and len(h.task_events()) == 1


async def test_restart_recovers_a_running_turn_exactly_once(tmp_path):
    h = make_harness(tmp_path, lambda req: "recovered answer")
    h.llm.gate = trio.Event()
    await h.rt.enqueue("assistant", task("x"), "ref")
    with trio.move_on_after(0.5):  # "crash" while the model call is in flight
        await h.pump()
    await h.rt.aclose()
    h2 = make_harness(tmp_path, lambda req: "recovered answer", clock=h.clock)
    await h2.rt.recover()
    head = await h2.rt.store.read(sql_head.read, "assistant")
    assert head.status == "running" and head.turn_epoch == 2
    await h2.pump()
    [event] = h2.task_events()
    assert event.status == "succeeded"
    assert [r[1] for r in h2.replies.sent] == ["recovered answer"]
    assert h2.sql("SELECT count(*) FROM cards WHERE card_type = 'task.deliverable'") == [(1,)]


async def test_run_loop_with_asynchronous_peers(tmp_path, autojump_clock):
    h = make_harness(tmp_path, answer_after_tool, worker_concurrency=2)
    h.rt.profiles["helper"] = profile(name="helper")
    h.rt.worker.profiles["helper"] = h.rt.profiles["helper"]

    async with trio.open_nursery() as nursery:

        def answer_later(sub, to):
            agent = "helper" if sub in helper_subs else "assistant"

            async def later():
                await trio.sleep(1)
                await h.rt.report_tool_result(agent, sub, result("3"))

            nursery.start_soon(later)

        helper_subs: set[str] = set()
        h.tools.on_call = answer_later
        await nursery.start(h.rt.run)
        for i in range(3):
            await h.rt.enqueue("assistant", task(f"a{i}"), f"a{i}")
        events = []
        while len(events) < 3:
            events.append(await h.events.receive())
            events = [e for e in events if type(e).__name__ == "TaskEvent"]
        nursery.cancel_scope.cancel()
    assert sorted(r[0] for r in h.replies.sent) == ["a0", "a1", "a2"]
    assert [r[0] for r in h.replies.sent] == ["a0", "a1", "a2"]  # FIFO per agent


async def test_restart_while_suspended_fails_lost_tool_calls_at_once(tmp_path):
    h = make_harness(tmp_path, answer_after_tool)
    await h.rt.enqueue("assistant", task("1+2"), "ref")
    await h.pump()
    assert (await h.rt.store.read(sql_head.read, "assistant")).status == "suspended"
    await h.rt.aclose()  # the server dies: its in-memory sub-threads are gone
    h2 = make_harness(tmp_path, answer_after_tool, clock=h.clock)
    await h2.rt.recover()  # no clock advance: the resume deadline is far away
    await h2.pump()
    [event] = h2.task_events()
    assert event.status == "succeeded"
    assert "interrupted by a restart" in h2.llm.requests[-1].messages[-1].content
    assert len(h2.replies.sent) == 1


async def test_streaming_port_publishes_each_chunk_as_it_arrives(tmp_path):
    import contextlib

    from agentserver.agents.events import ChunkEvent
    from agentserver.agents.ports import LLMCompletion

    class StreamingLLM:
        @contextlib.asynccontextmanager
        async def stream(self, request):
            async def items():
                for piece in ("The ", "answer ", "is 3."):
                    yield piece
                yield LLMCompletion("The answer is 3.")

            yield items()

        async def complete(self, request):  # pragma: no cover - stream is preferred
            raise AssertionError("complete() used although stream() exists")

    h = make_harness(tmp_path, lambda req: "unused")
    h.rt.worker.llm = StreamingLLM()
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    events = h.events.drain()
    chunks = [e.text for e in events if isinstance(e, ChunkEvent)]
    assert chunks == ["The ", "answer ", "is 3."]
    assert [r[1] for r in h.replies.sent] == ["The answer is 3."]


async def test_each_model_step_carries_the_agents_reply_grammar(tmp_path):
    # A local backend constrains decoding by it (docs/llm-router.md); the step passes it.
    h = make_harness(tmp_path, echo, profiles={"assistant": profile(reply_grammar="root ::= [a]")})
    await h.rt.enqueue("assistant", task("first"), {"thread": "t1"})
    await h.pump()
    assert h.llm.requests and all(r.grammar == "root ::= [a]" for r in h.llm.requests)


async def test_a_broken_task_is_answered_failed_only_where_its_reference_says(tmp_path):
    """A task that cannot start (its payload not XML) ends failed, answered to its
    caller; one whose reply reference is unreadable too ends failed unanswered (there is
    nowhere to send it), and the agent goes on with its next task."""
    h = make_harness(tmp_path, lambda req: "done")
    await h.rt.enqueue("assistant", task("first"), {"thread": "t1"})
    await h.rt.enqueue("assistant", task("second"), {"thread": "t2"})
    await h.rt.enqueue("assistant", task("third"), {"thread": "t3"})
    h.rt.store._db.execute(  # type: ignore[attr-defined]
        "UPDATE agent_inbox SET payload = ? WHERE seq = 1", (b"<not-xml",)
    )
    h.rt.store._db.execute(  # type: ignore[attr-defined]
        "UPDATE agent_inbox SET payload = ?, reply_ref = 'not json' WHERE seq = 2", (b"<x",)
    )
    for _ in range(3):
        await h.pump()
    answered = [(ref, failed) for ref, _, failed, _ in h.replies.sent]
    assert answered == [({"thread": "t1"}, True), ({"thread": "t3"}, False)], h.replies.sent
    assert h.sql("SELECT status FROM agent_inbox ORDER BY seq") == [("error",)] * 2 + [
        ("consumed",)
    ]
    # No answer is kept for the unreadable one (it could never be sent): one per task
    # answered.
    assert h.sql("SELECT count(*) FROM agent_replies") == [(2,)]
    await h.rt.store.aclose()
