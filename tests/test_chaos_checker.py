"""The chaos bench's checker (bench/support/chaos_check.py), sans-IO: every violation it must
find, and its counts against a ledger built with known truth (hypothesis)."""

from __future__ import annotations

import os
import sys

from hypothesis import given
from hypothesis import strategies as st

# The chaos bench's modules (bench/support/).
sys.path.append(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "support")
)

from chaos_check import Ledger, check, failure_reason


def expected(nonce: str, text: str) -> list[list[str]]:
    return [[f"PROOF[stamp:{nonce}]"]]


def good(nonce: str) -> str:
    return f"RESULT nonce={nonce} stamp=PROOF[stamp:{nonce}]"


def test_one_answer_each_is_clean():
    ledger = Ledger()
    ledger.sent("c0", "t1", "n1", "alpha")
    ledger.sent("c1", "t2", "n2", "beta")
    ledger.answered("c0", "t1", good("n1"), failed=False)
    ledger.answered("c1", "t2", "the task was cancelled", failed=True)
    verdict = check(ledger, {"t1", "t2"}, expected)
    assert verdict.ok, verdict.violations
    assert verdict.counts["answered_once"] == 2
    assert verdict.counts["failed_by_reason"] == {"cancelled": 1}


def test_each_violation_is_found():
    ledger = Ledger()
    for i in range(6):
        ledger.sent("c0", f"t{i}", f"n{i}", "alpha")
    ledger.answered("c0", "t0", good("n0"), failed=False)
    ledger.answered("c0", "t0", good("n0"), failed=False)  # duplicate
    ledger.answered("c1", "t1", good("n1"), failed=False)  # wrong client (and t1 lost)
    ledger.answered("c0", "t2", good("n9"), failed=False)  # wrong content
    ledger.answered("c0", "t4", good("n4"), failed=False)  # t4 was never taken
    ledger.answered("c0", "zz", good("n5"), failed=False)  # nobody sent zz
    verdict = check(ledger, {"t0", "t1", "t2", "t3"}, expected)
    c = verdict.counts
    assert (c["duplicates"], c["wrong_client"], c["lost"], c["wrong_content"]) == (1, 1, 2, 1)
    assert (c["answered_untaken"], c["unknown_answers"]) == (1, 1)
    assert not verdict.ok and c["violations"] == 7


def test_open_attempts_leave_out_answered_refused_and_resent():
    ledger = Ledger()
    for i in range(4):
        ledger.sent("c0", f"t{i}", f"n{i}", "alpha")
    ledger.answered("c0", "t0", good("n0"), failed=False)
    ledger.refused("c0", "t1", "busy")
    ledger.resend("t2")
    assert [a.thread for a in ledger.open_attempts("c0")] == ["t3"]


def test_failure_reasons():
    assert failure_reason("the task was cancelled") == "cancelled"
    assert failure_reason("stopped by an operator") == "stopped"
    assert failure_reason("gave up after 3 step retries") == "model_gave_up"
    assert failure_reason("something else") == "other"


fates = st.sampled_from(["once", "twice", "none", "failed", "untaken", "bad"])


@given(st.lists(st.tuples(st.sampled_from(["c0", "c1", "c2"]), fates), max_size=40))
def test_counts_match_the_truth(plan):
    ledger = Ledger()
    taken = set()
    for i, (client, fate) in enumerate(plan):
        thread, nonce = f"t{i}", f"n{i}"
        ledger.sent(client, thread, nonce, "alpha")
        if fate != "untaken":
            taken.add(thread)
        if fate in ("once", "twice"):
            for _ in range(1 if fate == "once" else 2):
                ledger.answered(client, thread, good(nonce), failed=False)
        elif fate == "failed":
            ledger.answered(client, thread, "stopped", failed=True)
        elif fate == "bad":
            ledger.answered(client, thread, "RESULT nothing", failed=False)
    verdict = check(ledger, taken, expected)
    fates_seen = [f for _, f in plan]
    c = verdict.counts
    assert c["duplicates"] == fates_seen.count("twice")
    assert c["lost"] == fates_seen.count("none")
    assert c["wrong_content"] == fates_seen.count("bad")
    assert c["failed_answers"] == fates_seen.count("failed")
    assert c["not_taken"] == fates_seen.count("untaken")
    assert c["answered_once"] == len(plan) - c["duplicates"] - c["lost"] - c["not_taken"]
    assert verdict.ok == (c["duplicates"] + c["lost"] + c["wrong_content"] == 0)


def test_the_schedules_checker_finds_each_violation():
    from chaos_schedules import Run, Sched, check_runs

    # every 5 s, made at 1000.5: ticks 1005..1025 due before next_tick 1030 (five); two
    # skipped: one by overlap (a run record), one missed while down (counted only)
    s = Sched("s", "*/5 * * * * *", 1000.5, 1030.0, 2)
    ok = [Run("s", t, "fired", "consumed", False) for t in (1005, 1010, 1015)]
    ok.append(Run("s", 1020, "skipped: the previous run has not ended", None, False))
    counts, violations = check_runs([s], ok, now=1040)
    assert not violations and counts["schedule_runs_fired"] == 3
    assert counts["schedule_ticks_missed"] == 1
    _, twice = check_runs([s], [*ok[:3], ok[2]], now=1040)
    assert any("twice" in v for v in twice)
    _, lost = check_runs([s], [ok[0], ok[1], ok[3]], now=1040)  # a fired tick gone
    assert any("accounted" in v for v in lost)
    _, no_task = check_runs([s], [Run("s", 1005, "fired", "", False), *ok[1:]], now=1040)
    assert any("no task" in v for v in no_task)
    stuck = [Run("s", 1005, "fired", "consumed", True), *ok[1:]]
    assert check_runs([s], stuck, now=1040)[1] == []  # young: may still run
    assert any("never ended" in v for v in check_runs([s], stuck, now=2000)[1])
