"""Memory across tasks (issue 12): ``memory="client"`` gives each caller one durable
conversation; ``none`` (the default) starts every task from empty boxes."""

from __future__ import annotations

from agents_fakes import make_harness, profile, task

from agentserver.agents.store.sql import conversations
from agentserver.agents.turn.compaction import SUMMARY_SYSTEM
from agentserver.agents.turn.memory import conversation_key

ALICE = {"hop": "h1", "caller_thread": "t1", "chain": ["conn-1", "assistant"], "client": "alice"}
ALICE_2 = {"hop": "h2", "caller_thread": "t2", "chain": ["conn-7", "assistant"], "client": "alice"}
BOB = {"hop": "h3", "caller_thread": "t3", "chain": ["conn-2", "assistant"], "client": "bob"}
ANON = {"hop": "h4", "caller_thread": "t4", "chain": ["conn-9", "assistant"]}


def reply(req) -> str:
    said = " | ".join(m.content for m in req.messages[1:])
    return "You are Ada." if "my name is Ada" in said else "I do not know your name."


def texts(req) -> str:
    return "\n".join(m.content for m in req.messages)


async def test_a_client_remembers_and_another_does_not_even_after_a_restart(tmp_path):
    prof = profile(memory="client")
    h = make_harness(tmp_path, reply, profiles={"assistant": prof})
    await h.rt.enqueue("assistant", task("my name is Ada"), ALICE)
    await h.pump()
    await h.rt.enqueue("assistant", task("what is my name?"), ALICE_2)  # another connection
    await h.pump()
    await h.rt.enqueue("assistant", task("what is my name?"), BOB)
    await h.pump()
    _first, second, bobs = h.llm.requests
    assert "my name is Ada" in texts(second) and "You are Ada." in texts(second)
    assert "my name is Ada" not in texts(bobs)
    assert [r[1] for r in h.replies.sent] == [
        "You are Ada.",
        "You are Ada.",
        "I do not know your name.",
    ]

    await h.rt.aclose()
    h2 = make_harness(tmp_path, reply, profiles={"assistant": prof}, clock=h.clock)
    await h2.rt.recover()
    await h2.rt.enqueue("assistant", task("and now?"), ALICE)
    await h2.pump()
    await h2.rt.enqueue("assistant", task("and now?"), BOB)
    await h2.pump()
    alice_after, bob_after = h2.llm.requests
    assert "my name is Ada" in texts(alice_after) and "what is my name?" in texts(alice_after)
    assert "my name is Ada" not in texts(bob_after) and "what is my name?" in texts(bob_after)


async def test_memory_none_starts_every_task_empty(tmp_path):
    h = make_harness(tmp_path, reply)
    await h.rt.enqueue("assistant", task("my name is Ada"), ALICE)
    await h.pump()
    await h.rt.enqueue("assistant", task("what is my name?"), ALICE)
    await h.pump()
    assert "my name is Ada" not in texts(h.llm.requests[1])
    assert h.sql("SELECT count(*) FROM conversations") == [(0,)]


async def test_an_idle_conversation_can_be_compacted_by_hand(tmp_path):
    def script(req):
        if req.messages[0].content == SUMMARY_SYSTEM:
            return "SUMMARY: the user is Ada and asked many things."
        return "ok " * 400

    prof = profile(memory="client", context_window=20_000, keep_recent=600)
    h = make_harness(tmp_path, script, profiles={"assistant": prof})
    for i in range(4):
        await h.rt.enqueue("assistant", task(f"my name is Ada, question {i}"), ALICE)
        await h.pump()
    before = await h.rt.store.read(conversations.conversation_cards, "assistant", "client:alice")
    assert await h.rt.compact_conversation("assistant", "client:alice")
    after = await h.rt.store.read(conversations.conversation_cards, "assistant", "client:alice")
    assert after[0].card_type == "sys.summary" and after[0].content.startswith("SUMMARY:")
    assert len(after) < len(before)
    assert after[-1].content == before[-1].content  # the latest exchange stays verbatim
    await h.rt.enqueue("assistant", task("who am I?"), ALICE)
    await h.pump()
    assert "SUMMARY: the user is Ada" in texts(h.llm.requests[-1])


def test_conversation_keys():
    assert conversation_key(ALICE) == conversation_key(ALICE_2) == "client:alice"
    assert conversation_key(BOB) == "client:bob"
    assert conversation_key(ANON) == "origin:conn-9"
    assert conversation_key("ref") is None
