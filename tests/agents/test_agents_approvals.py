"""Approvals in the worker and the store, on a manual clock (no sockets): the first
decision wins, a grant is forwarded once, a crash while forwarding never sends twice, and
the rule's timeout becomes a refusal."""

from __future__ import annotations

import dataclasses

from agents_fakes import make_harness, profile, task
from lxml import etree

from agentserver.agents.policy.evaluate import parse_policy
from agentserver.agents.store.sql import governance, inbox
from agentserver.agents.store.states import MessageType
from agentserver.core.namespaces import BOOT_NS

ADD = '<add xmlns="urn:calc"><a>1</a><b>2</b></add>'


def approval_profile():
    el = etree.fromstring(
        f'<policy xmlns="{BOOT_NS}" default="allow">'
        '<rule priority="1" id="ask" decision="require-approval" target="calculator" '
        'approver="alice" timeout="5m"/></policy>'
    )
    return dataclasses.replace(profile(), policy=parse_policy(el))


def script(request) -> str:
    seen = "\n".join(m.content for m in request.messages)
    return (
        "done: " + seen.rsplit("\n", 1)[-1] if "Tool call to" in seen or "Result" in seen else ADD
    )


async def start(tmp_path):
    h = make_harness(tmp_path, script, profiles={"assistant": approval_profile()})
    await h.rt.enqueue("assistant", task("add"), {"r": 1})
    await h.pump()
    (request_id,) = h.sql("SELECT request_id FROM approvals WHERE status = 'pending'")[0]
    assert h.tools.calls == []
    assert h.sql("SELECT status FROM agent_state_head") == [("suspended",)]
    return h, request_id


async def test_the_first_decision_wins_and_a_grant_is_forwarded_once(tmp_path):
    h, rid = await start(tmp_path)
    assert await h.rt.approvals.decide(rid, True, "", "mallory") == "not-yours"
    assert await h.rt.approvals.decide("nope", True, "", "alice") == "unknown"
    assert await h.rt.approvals.decide(rid, True, "fine", "alice") == "applied"
    assert await h.rt.approvals.decide(rid, False, "no", "alice") == "duplicate"
    await h.pump()
    await h.pump()  # the forward is exactly one pump call, however often rows are handled
    assert [to for _, to, _ in h.tools.calls] == ["calculator"]
    sub = h.tools.calls[0][0]
    assert h.sql("SELECT status, tool_call_id FROM approvals") == [("forwarded", sub)]
    cards = h.sql(
        "SELECT json_extract(metadata, '$.tool_call_id') FROM cards WHERE card_type = 'tool.call'"
    )
    assert cards == [(sub,)]
    await h.rt.report_tool_result("assistant", sub, b'<sum xmlns="urn:calc">3</sum>')
    await h.pump()
    assert h.replies.sent[0][1].startswith("done")
    await h.rt.approvals.expire()  # nothing left to time out
    assert h.sql("SELECT status FROM approvals") == [("forwarded",)]


async def test_a_granted_call_goes_out_once_its_waiting_row_names_it(tmp_path):
    """The forward is written before the call goes out: when the call reaches the pump,
    the waiting row already names its sub-thread, so a result that comes back at once is
    applied, never deferred."""
    h, rid = await start(tmp_path)
    seen: list[list[tuple]] = []

    def at_send(sub: str, to: str) -> None:
        seen.append(h.sql("SELECT tool_call_id, status FROM turn_waiting_tools"))

    h.tools.on_call = at_send
    assert await h.rt.approvals.decide(rid, True, "", "alice") == "applied"
    await h.pump()
    [(sub, _, _)] = h.tools.calls
    assert seen == [[(sub, "waiting")]]


async def test_a_granted_call_the_pump_has_no_room_for_is_its_failed_result(tmp_path):
    h, rid = await start(tmp_path)
    h.tools.full.add("calculator")
    assert await h.rt.approvals.decide(rid, True, "", "alice") == "applied"
    await h.pump()
    await h.pump()
    assert h.tools.calls == []
    assert h.sql("SELECT status FROM turn_waiting_tools") == [("received",)]
    [(meta,)] = h.sql("SELECT metadata FROM cards WHERE card_type = 'tool.result'")
    assert '"failed": true' in meta
    assert h.replies.sent and h.replies.sent[0][1].startswith("done")


async def test_a_crash_while_forwarding_reports_the_call_lost_and_never_sends_it(tmp_path):
    h, rid = await start(tmp_path)
    assert await h.rt.approvals.decide(rid, True, "", "alice") == "applied"
    (row,) = await h.rt.store.run1(inbox.claim_due, "assistant", 1)
    assert row.message_type == MessageType.APPROVAL
    assert await h.rt.store.run(governance.begin_forward, row) is not None  # then the process dies
    h.clock.advance(60)
    assert await h.rt.store.run1(inbox.requeue_stuck, 30) == 1  # the restarted worker's watchdog
    await h.pump()
    assert h.tools.calls == []  # never sent: it may have left before the crash
    assert h.sql("SELECT status FROM approvals") == [("lost",)]
    assert "interrupted by a restart" in h.replies.sent[0][1]


async def test_no_decision_before_the_timeout_becomes_a_refusal(tmp_path):
    h, rid = await start(tmp_path)
    h.clock.advance(299)
    assert await h.rt.approvals.expire() == 0
    h.clock.advance(2)
    assert await h.rt.approvals.expire() == 1
    assert await h.rt.approvals.decide(rid, True, "", "alice") == "duplicate"
    await h.pump()
    assert h.tools.calls == []
    (answer,) = h.replies.sent
    assert "got no decision from alice within 300 s" in answer[1]
    assert h.sql("SELECT status FROM approvals") == [("timed_out",)]


async def test_a_grant_after_its_turn_ended_is_withdrawn_never_sent(tmp_path):
    """The Turn stopped while its call waited for the approver; her grant comes later:
    nothing waits for the call, so it is never sent, and the request is ``withdrawn``
    (not left ``granted``, which would look open for ever and keep its Turn from
    retention)."""
    h, rid = await start(tmp_path)
    assert await h.rt.stop("assistant")
    await h.pump()
    assert await h.rt.approvals.decide(rid, True, "", "alice") == "applied"
    await h.pump()
    await h.pump()
    assert h.tools.calls == []
    assert h.sql("SELECT status FROM approvals") == [("withdrawn",)]
