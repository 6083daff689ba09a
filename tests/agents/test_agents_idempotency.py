"""Idempotency keys of an agent's tool calls (issue 26), with the real store and fake
ports: two identical calls of one message get two keys; a process that dies while
forwarding a step's calls (the step and its waiting set written first) has them sent
again after the restart with the same keys, without asking the model again."""

from __future__ import annotations

import trio
from agents_fakes import make_harness, task

from agentserver.agents.store.sql import head as sql_head

CALL = '<add xmlns="urn:calc"><a>1</a><b>2</b></add>'


def two_identical_calls(request) -> str:
    return f"Twice. {CALL} {CALL}"


async def test_two_identical_calls_of_one_message_get_two_keys(tmp_path):
    h = make_harness(tmp_path, two_identical_calls)
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    [(step_id,)] = h.sql("SELECT step_id FROM agent_steps")
    assert h.tools.keys == [f"{step_id}.0", f"{step_id}.1"]
    cards = h.sql("SELECT metadata FROM cards WHERE card_type = 'tool.call' ORDER BY seq")
    assert [f'"idempotency_key": "{step_id}.{i}"' in m for i, (m,) in enumerate(cards)] == [
        True,
        True,
    ]


async def test_calls_cut_off_by_a_crash_are_sent_again_with_their_keys(tmp_path):
    h = make_harness(tmp_path, two_identical_calls)

    async def forever() -> None:
        await trio.sleep_forever()

    def hang(sub: str, to: str):
        return forever()  # the process "dies" while forwarding the first call

    h.tools.on_call = hang
    await h.rt.enqueue("assistant", task("x"), "ref")
    with trio.move_on_after(0.5):
        await h.pump()
    assert len(h.tools.keys) == 1 and len(h.llm.requests) == 1
    # The step and its waiting set were written before the first call went out.
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.status == "suspended" and head.waiting_tool_count == 2
    await h.rt.aclose()

    # The restart's recovery sends the waiting calls again, to a listener whose steps
    # may be retried, with the same keys.
    h2 = make_harness(tmp_path, two_identical_calls, clock=h.clock, retryable_tools=("calculator",))
    named: list[bool] = []

    def at_send(sub: str, to: str) -> None:
        # The waiting row names the new sub-thread before the call goes out.
        rows = h2.sql("SELECT tool_call_id FROM turn_waiting_tools WHERE status = 'waiting'")
        named.append((sub,) in rows)

    h2.tools.on_call = at_send
    await h2.rt.recover()
    await h2.pump()
    assert h2.llm.requests == []  # the recorded step's calls, not a new step
    assert h2.tools.keys[0] == h.tools.keys[0] and len(set(h2.tools.keys)) == 2
    assert named == [True, True]
    head = await h2.rt.store.read(sql_head.read, "assistant")
    assert head.status == "suspended" and head.step_count == 1
