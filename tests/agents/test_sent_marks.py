"""Replies marked sent in batches (agents/turn/delivery.py ``SentMarks``), on a real
SQLite store: without its flusher each reply is marked as it is sent; with it, the marks
of the replies sent meanwhile go in one statement; cancelled, it writes what waits."""

from __future__ import annotations

import trio
import trio.testing
from agents_fakes import make_harness, task

from agentserver.agents.store.sql import replies
from agentserver.agents.turn.delivery import SentMarks


def answer(req) -> str:
    return "All done."


def counted(h, calls: list[str]) -> None:
    """Record the store functions the harness's store runs."""
    store = h.rt.store

    def wrap(method):
        async def run(fn, *args, **kwargs):
            calls.append(fn.__name__)
            return await method(fn, *args, **kwargs)

        return run

    store.run1 = wrap(store.run1)


async def test_without_its_flusher_each_reply_is_marked_at_once(tmp_path):
    h = make_harness(tmp_path, answer)
    calls: list[str] = []
    counted(h, calls)
    for n in range(3):
        await h.rt.enqueue("assistant", task(f"t{n}"), f"ref-{n}")
    await h.pump()
    assert calls.count("mark_reply_sent") == 3
    assert h.sql("SELECT status FROM agent_replies") == [("sent",)] * 3


async def test_with_its_flusher_the_marks_ride_on_the_next_turns_end(tmp_path, mock_clock):
    """Time stands still (trio's clock, not moved) until the three Turns are answered:
    each Turn's end takes the mark waiting of the one before into its own transaction;
    the last mark waits in the flusher's gathering window, then goes in one statement."""
    h = make_harness(tmp_path, answer)
    calls: list[str] = []
    counted(h, calls)
    for n in range(3):
        await h.rt.enqueue("assistant", task(f"t{n}"), f"ref-{n}")
    marks: SentMarks = h.rt.sent_marks
    async with trio.open_nursery() as nursery:
        await nursery.start(marks.run)
        await h.pump()
        assert [r[0] for r in h.replies.sent] == ["ref-0", "ref-1", "ref-2"]
        await trio.testing.wait_all_tasks_blocked()
        assert h.sql("SELECT status FROM agent_replies ORDER BY rowid") == [
            ("sent",),
            ("sent",),
            ("pending",),
        ]
        mock_clock.jump(1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert h.sql("SELECT status, attempts FROM agent_replies") == [("sent", 1)] * 3
        nursery.cancel_scope.cancel()
    assert calls.count("mark_replies_sent") == 1 and "mark_reply_sent" not in calls


async def test_marks_a_turns_end_took_are_given_back_when_it_does_not_commit(tmp_path):
    h = make_harness(tmp_path, answer)
    marks: SentMarks = h.rt.sent_marks
    marks._running = True  # as if its flusher ran: marks wait instead of being written
    await marks.mark("turn-a")
    assert marks.take() == ["turn-a"] and marks.take() == []
    marks.give_back(["turn-a"])
    assert marks.take() == ["turn-a"]


async def test_cancelled_the_flusher_writes_the_marks_waiting(tmp_path, mock_clock):
    h = make_harness(tmp_path, answer)
    await h.rt.enqueue("assistant", task("t"), "ref")
    marks: SentMarks = h.rt.sent_marks
    async with trio.open_nursery() as nursery:
        await nursery.start(marks.run)
        await h.pump()
        assert h.sql("SELECT status FROM agent_replies") == [("pending",)]
        nursery.cancel_scope.cancel()  # before the flusher's gathering wait ends
    assert h.sql("SELECT status FROM agent_replies") == [("sent",)]


class _Marked:
    """A store that records the marks it writes."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    async def run1(self, fn, ids: list[str]) -> None:
        assert fn is replies.mark_replies_sent
        self.batches.append(list(ids))


async def test_a_turns_end_within_the_window_puts_the_flush_off(mock_clock):
    from agentserver.agents.turn.delivery import MARK_GATHER_S

    store = _Marked()
    marks = SentMarks(store)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(marks.run)
        await marks.mark("a")
        await trio.testing.wait_all_tasks_blocked()  # the flusher's window began
        assert marks.take() == ["a"]  # a Turn's end took it
        await marks.mark("b")
        mock_clock.jump(MARK_GATHER_S)
        await trio.testing.wait_all_tasks_blocked()
        assert store.batches == []  # "b" came after the take: the next end may take it
        mock_clock.jump(MARK_GATHER_S)
        await trio.testing.wait_all_tasks_blocked()
        assert store.batches == [["b"]]  # no end took it within a window: flushed
        nursery.cancel_scope.cancel()
