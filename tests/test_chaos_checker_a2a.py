"""The chaos bench's checks added by issue 43, sans-IO: the A2A tasks'
(bench/support/chaos_a2a.py ``check_a2a``), the budget refusals'
(bench/support/chaos_budget.py ``refusal_violations``) and the HTTP double texts' counts
(bench/support/chaos_check.py): each violation found, a clean run clean."""

from __future__ import annotations

import os
import sys

sys.path.append(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "support")
)

from chaos_a2a import A2aTask, check_a2a
from chaos_budget import refusal_violations, unspent_steps
from chaos_check import Ledger, check


def expected(nonce: str, text: str) -> list[list[str]]:
    return [[f"PROOF[stamp:{nonce}]"]]


def good(nonce: str) -> str:
    return f"RESULT nonce={nonce} stamp=PROOF[stamp:{nonce}]"


def a2a_task(nonce: str, *ends: tuple[str, str, str], ids: tuple[str, ...] = ("T",)) -> A2aTask:
    task = A2aTask(f"m-{nonce}", nonce, "beta", "stream")
    task.task_ids.update(ids)
    task.ends.extend(ends)
    return task


def test_a2a_tasks_each_ended_once_are_clean():
    tasks = [
        a2a_task("n1", ("T", "completed", good("n1")), ("T", "completed", good("n1"))),
        a2a_task("n2", ("U", "canceled", ""), ids=("U",)),
        a2a_task("n3", ("V", "failed", "budget exhausted: client:a2a (total)"), ids=("V",)),
    ]
    counts, violations = check_a2a(tasks, expected)
    assert violations == []
    assert counts["a2a_by_state"] == {"canceled": 1, "completed": 1, "failed": 1}


def test_a2a_violations_are_found():
    tasks = [
        a2a_task("n1", ("T", "completed", good("n1")), ids=("T", "T2")),  # a message twice
        a2a_task("n2"),  # never ended
        a2a_task("n3", ("T", "completed", good("n3")), ("T", "failed", "boom")),  # twice
        a2a_task("n4", ("T", "completed", "RESULT nonce=n4")),  # without its proof
    ]
    counts, violations = check_a2a(tasks, expected)
    assert counts["a2a_twice"] == 1
    assert counts["a2a_unended"] == 1
    assert counts["a2a_ended_differently"] == 1
    assert counts["a2a_wrong_content"] == 1
    assert len(violations) == 4, violations


def test_a_budget_refusal_must_name_its_own_clients_budget():
    refused = [
        ("c1", "t1", "budget exhausted: client:c1 (total) is spent; it never resets"),
        ("c0", "t2", "budget exhausted: client:c0 (total) is spent"),  # c0 has no budget
        ("c2", "t3", "budget exhausted: client:c1 (total) is spent"),  # not hers
    ]
    counts, violations = refusal_violations(refused, 2500)
    assert counts["budget_refused_tasks"] == 3
    assert [v.split(" on ")[0] for v in violations] == [
        "budget refusal to c0",
        "budget refusal to c2",
    ]
    # Without --budget-tokens no refusal is right at all.
    assert len(refusal_violations(refused[:1], None)[1]) == 1


def test_an_http_double_text_is_answered_once_like_any_task():
    ledger = Ledger()
    ledger.sent("c0", "t1", "n1", "alpha")
    ledger.sent("c0", "t2", "n2", "alpha", "interrupt", True, via="http")
    ledger.answered("c0", "t1", "interrupted: a newer task of the conversation", failed=True)
    ledger.answered("c0", "t2", good("n2"), failed=False)
    verdict = check(ledger, {"t1", "t2"}, expected, memory_agents={"alpha"})
    assert verdict.ok, verdict.violations
    assert verdict.counts["http_tasks"] == 1
    assert verdict.counts["http_tasks_answered_once"] == 1
    # Its answer twice (the wire's and the store's): a duplicate.
    ledger.answered("c0", "t2", good("n2"), failed=False)
    verdict = check(ledger, {"t1", "t2"}, expected, memory_agents={"alpha"})
    assert verdict.counts["duplicates"] == 1
    assert verdict.counts["http_tasks_answered_once"] == 0


def test_an_internal_error_is_a_violation():
    tasks = [a2a_task("n1", ("T", "completed", good("n1")))]
    counts, violations = check_a2a(tasks, expected, internal_errors=[("GetTask", "boom")])
    assert counts["a2a_internal_errors"] == 1
    assert violations == ["A2A GetTask got an internal error: boom"]


def test_an_a2a_task_pruned_after_its_end_unread_is_counted_apart():
    """The server said the task had ended (SubscribeToTask) and retention pruned it before
    GetTask read it: not a violation, counted apart; a task neither ended nor pruned is."""
    pruned = a2a_task("n1")
    pruned.pruned_unread = True
    counts, violations = check_a2a([pruned, a2a_task("n2")], expected)
    assert counts["a2a_ended_pruned_unread"] == 1
    assert counts["a2a_unended"] == 1
    assert len(violations) == 1 and "n2" in violations[0]


def test_a_step_written_without_its_spend_is_a_violation():
    """Issue 48: a call's spend commits with its step, so the organism's spend (every call
    pays into it) is at least what the completed steps report."""
    rows = [("organism", None, 150, 0, 0), ("client:c1", 100, 90, 0, 1)]
    assert unspent_steps(rows, 150) == []
    assert unspent_steps(rows, 120) == []  # compaction calls and failed steps spend too
    [violation] = unspent_steps(rows, 165)
    assert "organism spent 150 < 165" in violation
    assert unspent_steps([], 0) == []
