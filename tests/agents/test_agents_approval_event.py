"""``approval.requested`` (issue 36, docs/webhooks.md): sending an approval request
publishes one ``NoticeEvent`` on the agents' event bus (what webhooks deliver), keyed by
the request so a resend after a restart is the same event."""

from __future__ import annotations

from agents_fakes import make_harness, task
from test_agents_approvals import approval_profile, script

from agentserver.agents.events import NoticeEvent
from agentserver.agents.store import outbox


async def test_a_request_sent_publishes_approval_requested(tmp_path):
    h = make_harness(tmp_path, script, profiles={"assistant": approval_profile()})
    await h.rt.enqueue("assistant", task("add"), {"r": 1})
    await h.pump()
    sent = []

    async def send(pending, element) -> None:
        sent.append(pending.request_id)

    h.rt.approvals.send = send
    h.events.drain()
    assert await h.rt.approvals.deliver_requests() == 1
    notices = [e for e in h.events.drain() if isinstance(e, NoticeEvent)]
    assert [n.event_type for n in notices] == ["approval.requested"]
    [notice] = notices
    assert notice.data["request_id"] == sent[0] and notice.data["approver"] == "alice"
    assert notice.data["target"] == "calculator" and notice.agent_id == "assistant"
    assert notice.dedupe_key == f"approval.requested:{sent[0]}"
    # Sent already: nothing more is published.
    assert await h.rt.approvals.deliver_requests() == 0
    assert not [e for e in h.events.drain() if isinstance(e, NoticeEvent)]


async def test_approval_requested_is_in_the_outbox_with_the_mark(tmp_path):
    """A webhook wants ``approval.requested``: its outbox row commits with the request's
    "sent" mark (a crash after the send either finds both or sends again: no event lost,
    none doubled), and the bus's durable observer is not handed it again."""
    import json

    from agentserver.agents.edge.hooksign import new_secret
    from agentserver.agents.edge.outbox import Outbox
    from agentserver.agents.edge.webhooks import WebhookDirectory, Webhooks
    from agentserver.agents.events import EventBus
    from agentserver.agents.profile.webhooks import WebhookSpec

    h = make_harness(tmp_path, script, profiles={"assistant": approval_profile()})
    store, now = h.rt.store, h.clock.now
    hook = WebhookSpec("w", "http://127.0.0.1:9/h", ("approval.*",), new_secret())
    bus = EventBus()
    directory = WebhookDirectory(store, bus)
    hooks = Webhooks(store, directory, Outbox(store, now, directory=directory), bus, now, (hook,))
    offered: list[object] = []
    h.rt.events.observe_durably(offered.append, hooks.render_durable)
    await h.rt.enqueue("assistant", task("add"), {"r": 1})
    await h.pump()
    sent = []

    async def send(pending, element) -> None:
        sent.append(pending.request_id)

    h.rt.approvals.send = send
    h.events.drain()
    assert await h.rt.approvals.deliver_requests() == 1
    assert [e.event_type for e in h.events.drain() if isinstance(e, NoticeEvent)] == [
        "approval.requested"
    ]
    assert not [e for e in offered if isinstance(e, NoticeEvent)]  # written already
    [row] = await store.run(outbox.claim, "test", 30.0, 10)
    assert row.dedupe_key == f"w:approval.requested:{sent[0]}"
    assert json.loads(row.body)["data"]["request_id"] == sent[0]
