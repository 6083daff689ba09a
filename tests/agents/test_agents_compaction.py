"""Compaction (issue 12): the Turn's context stays under the window; one rolling summary.

A real SQLite store and a scripted model that answers the summariser's requests (its
system text is ``SUMMARY_SYSTEM``) with a numbered summary, and the agent's own requests
from the script. "Under the window" is counted as the issue's fake server counts it:
characters / 4 over every message, plus the requested output tokens.
"""

from __future__ import annotations

import json

from agents_fakes import ASSISTANT_NS, make_harness, profile, task

from agentserver.agents.errors import LLMUnavailable
from agentserver.agents.ports import LLMCompletion, LLMUsage
from agentserver.agents.profile.budget import card_tokens
from agentserver.agents.store.base import Card, CardType
from agentserver.agents.turn.compaction import SUMMARY_SYSTEM, plan

ADD = '<add xmlns="urn:calc"><a>1</a><b>2</b></add>'


def fake_tokens(request) -> int:
    chars = sum(len(m.content) for m in request.messages)
    return chars // 4 + (request.max_tokens or 1024)


def is_summary(request) -> bool:
    return request.messages[0].content == SUMMARY_SYSTEM


class Model:
    """Summaries are numbered; agent requests go to ``script``; can overflow on demand."""

    def __init__(self, script, overflows: int = 0) -> None:
        self.script = script
        self.overflows = overflows
        self.requests = []
        self.summaries = 0

    async def complete(self, request):
        self.requests.append(request)
        if is_summary(request):
            self.summaries += 1
            return LLMCompletion(f"SUMMARY-{self.summaries}: the user wants a sum.")
        if self.overflows:
            self.overflows -= 1
            raise LLMUnavailable("context_length_exceeded", kind="CONTEXT_OVERFLOW")
        return LLMCompletion(self.script(request), LLMUsage(10, 5, 15))


def harness(tmp_path, model, **kw):
    h = make_harness(tmp_path, lambda r: "unused", profiles={"assistant": profile(**kw)})
    h.rt.worker.llm = model
    return h


async def test_large_tool_results_on_a_32k_window_stay_under_it(tmp_path):
    def script(req):
        results = sum(m.content.startswith("Result from") for m in req.messages)
        summarised = any(m.content.startswith("Summary of") for m in req.messages)
        return "All three sums are in." if summarised or results >= 3 else f"Next. {ADD}"

    model = Model(script)
    h = harness(tmp_path, model, context_window=32_000, max_steps=10)
    await h.rt.enqueue("assistant", task("add three times"), "ref")
    await h.pump()
    for _ in range(3):
        [(sub, _, _)] = h.tools.calls[-1:]
        big = "<sum xmlns='urn:calc'>" + "7" * 400_000 + "</sum>"
        await h.rt.report_tool_result("assistant", sub, big.encode())
        await h.pump()
        if h.replies.sent:
            break
    assert [(r[1], r[2]) for r in h.replies.sent] == [("All three sums are in.", False)]
    assert all(fake_tokens(r) <= 32_000 for r in model.requests)
    assert model.summaries >= 1
    assert h.sql("SELECT count(*) FROM cards WHERE card_type = 'sys.summary'")[0][0] >= 1
    assert h.sql("SELECT count(*) FROM execution_edges WHERE primitive = 'compact'")[0][0] >= 1


async def test_forty_steps_on_an_8k_window_one_rolling_summary(tmp_path):
    def script(req):
        n = sum(m.content.startswith("(self-iteration") for m in req.messages)
        step = int(req.messages[-1].content.split("step ")[-1].split("<")[0]) if n else 0
        if step >= 40:
            return "Finished all forty steps."
        filler = "notes " * 250  # about 1500 characters a step
        return f"{filler}<task xmlns='{ASSISTANT_NS}'><text>step {step + 1}</text></task>"

    model = Model(script)
    h = harness(
        tmp_path, model, context_window=8000, context_reserve=1024, max_tokens=512, max_steps=45
    )
    await h.rt.enqueue("assistant", task("step 0"), "ref")
    await h.pump()
    assert [(r[1], r[2]) for r in h.replies.sent] == [("Finished all forty steps.", False)]
    assert all(fake_tokens(r) <= 8000 for r in model.requests), max(
        map(fake_tokens, model.requests)
    )
    summaries = [r for r in model.requests if is_summary(r)]
    assert len(summaries) >= 2
    # The second summary's prompt carries the first summary (rolling, not stacked).
    assert "SUMMARY-1:" in summaries[1].messages[1].content
    # ... and every agent request shows exactly one summary, the latest.
    last = [r for r in model.requests if not is_summary(r)][-1]
    shown = [m.content for m in last.messages if m.content.startswith("Summary of")]
    assert len(shown) == 1 and f"SUMMARY-{model.summaries}:" in shown[0]


async def test_one_context_overflow_compacts_and_succeeds(tmp_path):
    model = Model(lambda r: "fine now", overflows=1)
    h = harness(tmp_path, model)
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    assert [(r[1], r[2]) for r in h.replies.sent] == [("fine now", False)]
    assert sum(not is_summary(r) for r in model.requests) == 2


async def test_two_context_overflows_give_one_failed_answer(tmp_path):
    model = Model(lambda r: "never", overflows=2)
    h = harness(tmp_path, model)
    await h.rt.enqueue("assistant", task("x"), "ref")
    await h.pump()
    [(_, text, failed, _)] = h.replies.sent
    assert failed and "context window" in text
    assert [e.status for e in h.task_events()] == ["failed"]


def card(i: int, ctype: str, text: str = "x" * 300) -> Card:
    return Card(f"c{i}", "b", ctype, text, {}, 0.0)


def test_a_tool_call_and_its_result_are_never_split():
    from agentserver.agents.profile.budget import Budget

    cards = [card(0, CardType.TASK_INPUT)]
    for i in range(1, 60, 3):
        cards += [
            card(i, CardType.LLM_MESSAGE),
            card(i + 1, CardType.TOOL_CALL),
            card(i + 2, CardType.TOOL_RESULT),
        ]
    for keep in range(0, 3000, 37):
        p = plan(cards, Budget(window=100_000, keep_recent=keep))
        if p.recent:
            assert p.recent[0].card_type in (CardType.LLM_MESSAGE, CardType.TASK_INPUT)
        ids = [c.card_id for c in (*p.older, *([p.pinned] if p.pinned else []), *p.recent)]
        assert sorted(ids) == sorted(c.card_id for c in cards)  # nothing lost or doubled


async def test_the_box_swap_is_committed_with_its_step_or_not_at_all(tmp_path):
    """The summary is made before the model call, but the boxes change only with the
    step's results: a Turn stopped during that call keeps its boxes (no summary card,
    no compact edge), and its deliverable lands in the box holding its cards."""
    filler = "notes " * 1500  # about 3000 tokens a step: a later step is over budget

    class StopDuringTheCall(Model):
        async def complete(self, request):
            if self.summaries and not is_summary(request):
                await h.rt.stop("assistant")  # from outside, while the step waits
            return await super().complete(request)

    model = StopDuringTheCall(
        lambda r: f"{filler}<task xmlns='{ASSISTANT_NS}'><text>more</text></task>"
    )
    h = harness(tmp_path, model, context_window=8000, context_reserve=1024, max_tokens=512)
    await h.rt.enqueue("assistant", task("go"), "ref")
    await h.pump()
    assert model.summaries >= 1  # the compaction ran ...
    assert [e.status for e in h.task_events()] == ["stopped"]
    # ... but nothing of it was written: the step it belonged to was fenced out.
    assert h.sql("SELECT count(*) FROM cards WHERE card_type = 'sys.summary'") == [(0,)]
    assert h.sql("SELECT count(*) FROM execution_edges WHERE primitive = 'compact'") == [(0,)]
    [(box,)] = h.sql("SELECT box_id FROM cards WHERE card_type = 'task.deliverable'")
    types = [t for (t,) in h.sql("SELECT card_type FROM cards WHERE box_id = ? ORDER BY seq", box)]
    [(replies,)] = h.sql("SELECT count(*) FROM cards WHERE card_type = 'llm.message'")
    assert types.count("llm.message") == replies >= 3 and types[-1] == "task.deliverable"


async def test_a_step_commits_its_compaction_with_its_card(tmp_path):
    filler = "notes " * 1500

    def script(request):
        if any(m.content.startswith("Summary of") for m in request.messages):
            return "Done."
        return f"{filler}<task xmlns='{ASSISTANT_NS}'><text>more</text></task>"

    model = Model(script)
    h = harness(tmp_path, model, context_window=8000, context_reserve=1024, max_tokens=512)
    await h.rt.enqueue("assistant", task("go"), "ref")
    await h.pump()
    assert [(r[1], r[2]) for r in h.replies.sent] == [("Done.", False)]
    [(box,)] = h.sql("SELECT box_id FROM cards WHERE card_type = 'task.deliverable'")
    types = [t for (t,) in h.sql("SELECT card_type FROM cards WHERE box_id = ? ORDER BY seq", box)]
    # The new output box: the kept cards, then the compacting step's own reply.
    assert types[-2:] == ["llm.message", "task.deliverable"]
    [(edge_turn,)] = h.sql("SELECT agent_turn_id FROM execution_edges WHERE primitive = 'compact'")
    [(meta,)] = h.sql("SELECT metadata FROM execution_edges WHERE primitive = 'compact'")
    assert edge_turn and json.loads(meta)["folded_cards"] >= 1


async def test_the_last_step_note_comes_on_the_last_step_after_a_compaction_too(tmp_path):
    model = Model(lambda req: f"Next. {ADD}")  # never answers: runs into the step limit
    h = harness(tmp_path, model, context_window=32_000, max_steps=5)
    await h.rt.enqueue("assistant", task("add"), "ref")
    await h.pump()
    for _ in range(4):
        [(sub, _, _)] = h.tools.calls[-1:]
        big = "<sum xmlns='urn:calc'>" + "7" * 400_000 + "</sum>"
        await h.rt.report_tool_result("assistant", sub, big.encode())
        await h.pump()
    steps = [r for r in model.requests if not is_summary(r)]
    # Step 4 compacts first (S: a summary call; A: a step's own call).
    assert "".join("S" if is_summary(r) else "A" for r in model.requests) == "AAASSAA"
    last = [r.messages[-1].content.startswith("This is your last step") for r in steps]
    assert last == [False, False, False, False, True]


def test_the_current_task_stays_verbatim_when_it_fits_keep_recent_by_itself():
    """Its own tools' exchange filling keep-recent does not fold the task the Turn is for:
    the oldest kept exchanges are folded instead (a chaos soak caught a Turn whose second
    step no longer saw its task)."""
    from agentserver.agents.profile.budget import Budget

    cards = [card(0, CardType.TASK_INPUT, "t" * 200)]
    for i in range(1, 30, 3):
        cards += [
            card(i, CardType.LLM_MESSAGE),
            card(i + 1, CardType.TOOL_CALL),
            card(i + 2, CardType.TOOL_RESULT),
        ]
    budget = Budget(window=100_000, keep_recent=1000)
    p = plan(cards, budget)
    assert p.pinned is not None and p.pinned.card_id == "c0"
    kept = sum(card_tokens(c.content) for c in (p.pinned, *p.recent))
    assert kept <= 1000 and p.recent and p.recent[0].card_type == CardType.LLM_MESSAGE
    ids = [c.card_id for c in (*p.older, p.pinned, *p.recent)]
    assert sorted(ids) == sorted(c.card_id for c in cards)
