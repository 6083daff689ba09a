"""A restart sends the replies that were committed but never sent, and no other.

The crash test (tests/test_agents_crash.py) cannot see a resend of an already-sent reply at
restart: its client is away then, and the store's ``record_client_reply`` refuses to keep a
reply whose Turn was already handed over, so the duplicate vanishes before it reaches the
client. Here the reply port is a plain recorder with no duplicate check, so a resend shows.
"""

from __future__ import annotations

from agents_fakes import make_harness, task


def answer(req) -> str:
    return "All done."


async def test_restart_resends_only_the_replies_never_sent(tmp_path):
    h = make_harness(tmp_path, answer)
    await h.rt.enqueue("assistant", task("sent"), "ref-sent")
    await h.pump()
    assert [r[0] for r in h.replies.sent] == ["ref-sent"]
    h.replies.broken = True  # the caller is away: this reply stays pending
    await h.rt.enqueue("assistant", task("pending"), "ref-pending")
    await h.pump()
    assert h.sql("SELECT status FROM agent_replies ORDER BY rowid") == [
        ("sent",),
        ("pending",),
    ]
    await h.rt.aclose()  # the server dies

    h2 = make_harness(tmp_path, answer, clock=h.clock)
    await h2.rt.recover()
    # Only the reply never sent goes out, once; the one already sent is not sent again.
    assert [(r[0], r[1]) for r in h2.replies.sent] == [("ref-pending", "All done.")]
    assert h2.sql("SELECT status, attempts FROM agent_replies ORDER BY rowid") == [
        ("sent", 1),
        ("sent", 2),
    ]
    # Nor later, by the watchdog.
    h2.clock.advance(3600)
    await h2.rt.watchdog.tick()
    assert len(h2.replies.sent) == 1
