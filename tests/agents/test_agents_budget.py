"""The context budget (issue 12): token estimates, the running count on the head, the
tool-result cap, the model's declared window, and the v1 → v2 store migration."""

from __future__ import annotations

import sqlite3

from agents_fakes import make_harness, profile, task
from hypothesis import given
from hypothesis import strategies as st
from lxml import etree

from agentserver.agents.profile.budget import CARD_OVERHEAD, Budget, card_tokens, shown_text
from agentserver.agents.store.sql import head as sql_head
from agentserver.agents.store.sqlite_store import _MIGRATIONS, SCHEMA_VERSION, SqliteAgentStore
from agentserver.llm import parse_llm_section
from agentserver.llm.config import BOOT_NS, model_context_window
from agentserver.llm.tokens import estimate_text_tokens

ADD = '<add xmlns="urn:calc"><a>1</a><b>2</b></add>'


def call_then_answer(req):
    if "Result from" in req.messages[-1].content:
        return "The sum is in."
    return f"Let me compute. {ADD}"


def recount(h) -> int:
    """The head's running count recomputed from scratch, card by card."""
    head_boxes = h.sql("SELECT context_box_id, output_box_id FROM agent_state_head")[0]
    cap = h.rt.profiles["assistant"].budget.tool_result_cap
    total = 0
    for box in head_boxes:
        for ctype, content in h.sql(
            "SELECT card_type, content FROM cards WHERE box_id = ? ORDER BY seq", box
        ):
            if ctype not in ("task.deliverable", "tool.call"):
                total += card_tokens(content, cap if ctype == "tool.result" else None)
    return total


async def test_running_count_equals_a_fresh_count_after_every_kind_of_card(tmp_path):
    h = make_harness(tmp_path, call_then_answer)
    await h.rt.enqueue("assistant", task("add 1 and 2"), "ref")
    await h.pump()  # step 1: the call; suspended
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.status == "suspended"
    assert head.context_tokens == recount(h) > CARD_OVERHEAD
    [(sub, _to, _)] = h.tools.calls
    await h.rt.report_tool_result("assistant", sub, b'<sum xmlns="urn:calc">3</sum>')
    before = head.context_tokens
    await h.pump()
    assert h.replies.sent and not h.replies.sent[0][2]
    # The Turn ended (no active boxes any more): check the sum over its last boxes.
    rows = h.sql("SELECT sum(tokens) FROM cards WHERE card_type NOT IN ('task.deliverable')")
    assert rows[0][0] > before


async def test_a_huge_tool_result_is_shown_capped_and_kept_whole(tmp_path):
    prof = profile(context_window=32_000)
    h = make_harness(tmp_path, call_then_answer, profiles={"assistant": prof})
    await h.rt.enqueue("assistant", task("add"), "ref")
    await h.pump()
    [(sub, _, _)] = h.tools.calls
    big = "<sum xmlns='urn:calc'>" + "7" * 400_000 + "</sum>"
    await h.rt.report_tool_result("assistant", sub, big.encode())
    head = await h.rt.store.read(sql_head.read, "assistant")
    assert head.context_tokens == recount(h)
    await h.pump()
    shown = h.llm.requests[-1].messages[-1].content
    assert "characters cut to fit the context window" in shown
    assert estimate_text_tokens(shown) <= prof.budget.tool_result_cap + CARD_OVERHEAD
    assert len(h.sql("SELECT content FROM cards WHERE card_type = 'tool.result'")[0][0]) > 400_000


@given(text=st.text(max_size=3000), cap=st.integers(50, 2000))
def test_shown_text_respects_its_cap_and_says_what_it_cut(text, cap):
    out = shown_text(text, cap)
    if estimate_text_tokens(text) <= cap:
        assert out == text
    else:
        assert estimate_text_tokens(out) <= cap
        assert f"of {len(text)} characters cut" in out
        assert text.startswith(out[: out.index("\n[... ")])


def test_budget_limits():
    b = Budget(window=32_000, reserve=8192, max_output=1024)
    assert b.prompt_limit == 32_000 - 8192 - 1024
    assert b.tool_result_cap == 8000
    assert not b.over(100, b.prompt_limit - 200) and b.over(100, b.prompt_limit)


def test_model_context_window_from_the_llm_section():
    el = etree.fromstring(
        f"""<llm xmlns="{BOOT_NS}">
  <backend name="a" provider="openai" base-url="http://127.0.0.1:1/v1" context-window="64000">
    <model name="small" context-window="8000"/><model name="big"/>
    <alias name="fast" model="small"/>
  </backend>
  <backend name="b" provider="openai" base-url="http://127.0.0.1:2/v1">
    <model name="other"/>
  </backend>
</llm>""".encode()
    )
    config = parse_llm_section(el, environ={})
    assert model_context_window(config, "small") == 8000
    assert model_context_window(config, "fast") == 8000
    assert model_context_window(config, "big") == 64000
    assert model_context_window(config, "other") is None
    assert profile(context_window=None).budget.window == 128_000


def test_a_version_1_store_file_is_migrated(tmp_path):
    path = tmp_path / "v1.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(_MIGRATIONS[1])
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    conn.execute("INSERT INTO schema_version VALUES (1)")
    conn.execute(
        "INSERT INTO agent_state_head (agent_id, status, updated_at) VALUES ('a', 'idle', 0)"
    )
    conn.commit()
    conn.close()
    store = SqliteAgentStore.open(path)
    try:
        assert store._db.execute("SELECT max(version) FROM schema_version").fetchone() == (
            SCHEMA_VERSION,
        )
        assert store._db.execute("SELECT context_tokens FROM agent_state_head").fetchall() == [(0,)]
    finally:
        store.close()
