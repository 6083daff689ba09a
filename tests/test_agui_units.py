"""The AG-UI door's pure parts (docs/ag-ui.md): interrupt ids read back, the run's
thread derived per caller, a run's input made into the agent's task, a resume entry into
an approval decision."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentserver.core.threads import is_uuid4
from agentserver.http.agui.agents import RunRefused, last_user_text, run_thread
from agentserver.http.agui.runs import AguiRuns, RunProblem
from agentserver.http.agui.stream import interrupt_id, read_interrupt_id

ids = st.text(st.characters(blacklist_characters="/"), min_size=1, max_size=60)


@given(ids, ids)
def test_an_interrupt_id_reads_back_as_its_thread_and_request(thread, request):
    assert read_interrupt_id(interrupt_id(thread, request)) == (thread, request)


@given(st.text(max_size=80))
def test_any_text_reads_as_an_interrupt_id_or_none_never_raises(text):
    found = read_interrupt_id(text)
    if found is not None:
        assert interrupt_id(*found) == text and all(found)


@given(st.text(max_size=40), st.text(max_size=40), ids, ids)
def test_a_runs_thread_is_a_uuid4_its_own_per_caller_and_stable(owner, other, thread, run):
    mine = run_thread(owner, "assistant", thread, run)
    assert is_uuid4(mine)
    assert mine == run_thread(owner, "assistant", thread, run)
    if other != owner:
        assert run_thread(other, "assistant", thread, run) != mine
    assert run_thread(owner, "planner", thread, run) != mine


def test_the_task_is_the_last_user_messages_text():
    messages = [
        {"id": "1", "role": "user", "content": "first"},
        {"id": "2", "role": "assistant", "content": "ok"},
        {
            "id": "3",
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
    ]
    assert last_user_text(messages) == "a\n\nb"
    with pytest.raises(RunRefused, match="user message"):
        last_user_text([*messages[:2], {"id": "4", "role": "user", "content": "  "}])
    with pytest.raises(RunRefused, match="user message"):
        last_user_text([])
    image = {"type": "image", "source": {"type": "url", "value": "http://x"}}
    with pytest.raises(RunRefused, match="parts must be text"):
        last_user_text([{"id": "5", "role": "user", "content": [image]}])


def test_a_resume_entry_is_an_approval_decision_or_a_clear_refusal():
    decide = AguiRuns._decision
    granted = decide("r1", {"status": "resolved", "payload": {"grant": True, "reason": "ok"}})
    assert (granted.request, granted.grant, granted.reason) == ("r1", True, "ok")
    assert decide("r1", {"status": "resolved", "payload": False}).grant is False
    cancelled = decide("r1", {"status": "cancelled"})
    assert cancelled.grant is False and cancelled.reason == "cancelled"
    for entry in (
        {"status": "resolved", "payload": {"approve": True}},
        {"status": "resolved"},
        {"status": "resolved", "payload": {"grant": "yes"}},
        {"status": "other", "payload": {"grant": True}},
    ):
        with pytest.raises(RunProblem) as refused:
            decide("r1", entry)
        assert refused.value.status == 422 and '"grant"' in refused.value.text
