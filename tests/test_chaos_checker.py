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

from chaos_check import Ledger, TaskRow, check, failure_reason


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


# -- double texting (docs/runs.md): chaos_check.double_text_violations, repeated_effects

BUSY = "the conversation is busy: an earlier task of it is queued or running"
INTERRUPTED = "interrupted: a newer task of this conversation runs next"
ROLLED_BACK = "rolled back: a newer task of this conversation runs next"
SUPERSEDED = "superseded: a newer task of this conversation runs instead"


def dt_check(ledger: Ledger, ran: dict | None = None, seen=(), effects=(), times=None):
    """check() with the store's rows: in send order, ``ran`` as given, each task's answer
    written when ``times`` says (thread -> (arrived, ended)), else at once."""
    taken = set(ledger.attempts)
    rows = None
    if ran is not None or times is not None:
        rows = {}
        for i, thread in enumerate(ledger.attempts):
            arrived, ended = (times or {}).get(thread, (float(i), float(i)))
            rows[thread] = TaskRow(i, arrived, bool((ran or {}).get(thread)), ended)
    return check(
        ledger,
        taken,
        expected,
        memory_agents={"alpha"},
        rows=rows,
        model_nonces=set(seen),
        effects=effects,
    )


def test_double_text_answers_that_fit_their_modes_are_clean():
    ledger = Ledger()
    ledger.sent("c0", "a", "na", "alpha")
    ledger.sent("c0", "b", "nb", "alpha", "interrupt", racing=True)  # ends a's Turn
    ledger.sent("c0", "c", "nc", "alpha", "reject", racing=True)  # b still runs
    ledger.sent("c0", "d", "nd", "alpha", "enqueue", racing=True)  # queued behind b
    ledger.sent("c0", "e", "ne", "alpha", "rollback", racing=True)  # b rolled back, d too
    ledger.sent("c1", "f", "nf", "beta", "reject", racing=True)  # no memory: runs
    ledger.answered("c0", "a", INTERRUPTED, failed=True)
    ledger.answered("c0", "c", BUSY, failed=True)
    ledger.answered("c0", "b", ROLLED_BACK, failed=True)
    ledger.answered("c0", "d", SUPERSEDED, failed=True)
    ledger.answered("c0", "e", good("ne"), failed=False)
    ledger.answered("c1", "f", good("nf"), failed=False)
    ran = {"a": True, "b": True, "c": False, "d": False, "e": True, "f": True}
    effects = [("stamp", "na", "s1.0"), ("relay", "na", "s1.1"), ("relay", "na", "s1.1")]
    verdict = dt_check(ledger, ran, seen={"na", "nb", "ne", "nf"}, effects=effects)
    assert verdict.ok, verdict.violations
    c = verdict.counts
    assert (c["rejected_busy"], c["interrupted"], c["rolled_back"], c["superseded"]) == (1, 1, 1, 1)
    assert c["double_texts"] == 4 and c["multitask_sent"] == 5
    assert c["double_texts_by_mode"] == {"enqueue": 1, "interrupt": 1, "reject": 1, "rollback": 1}
    assert c["failed_by_reason"] == {"busy": 1, "interrupted": 1, "rolled_back": 1, "superseded": 1}
    assert (c["tool_effects"], c["idempotent_repeats"], c["effects_of_ended_turns"]) == (3, 1, 3)


def test_each_double_text_violation_is_found():
    def one(setup, ran=None, seen=(), effects=(), times=None):
        ledger = Ledger()
        setup(ledger)
        return dt_check(ledger, ran, seen, effects, times).violations

    def busy_without_reject(ledger):
        ledger.sent("c0", "a", "na", "alpha")
        ledger.sent("c0", "b", "nb", "alpha", "interrupt", racing=True)
        ledger.answered("c0", "a", good("na"), failed=False)
        ledger.answered("c0", "b", BUSY, failed=True)

    def interrupted_by_nobody(ledger):
        ledger.sent("c0", "a", "na", "alpha")
        ledger.sent("c0", "b", "nb", "alpha", "rollback", racing=True)
        ledger.answered("c0", "a", INTERRUPTED, failed=True)  # rollback asked, not interrupt
        ledger.answered("c0", "b", good("nb"), failed=False)

    def interrupted_by_an_earlier_task(ledger):
        ledger.sent("c0", "b", "nb", "alpha", "interrupt")
        ledger.sent("c0", "a", "na", "alpha", racing=True)
        ledger.answered("c0", "a", INTERRUPTED, failed=True)
        ledger.answered("c0", "b", good("nb"), failed=False)

    def rolled_back_by_another_client(ledger):
        ledger.sent("c0", "a", "na", "alpha")
        ledger.sent("c1", "b", "nb", "alpha", "rollback")
        ledger.answered("c0", "a", ROLLED_BACK, failed=True)
        ledger.answered("c1", "b", good("nb"), failed=False)

    def superseded_by_enqueue(ledger):
        ledger.sent("c0", "a", "na", "alpha")
        ledger.sent("c0", "b", "nb", "alpha", "enqueue", racing=True)
        ledger.answered("c0", "a", SUPERSEDED, failed=True)
        ledger.answered("c0", "b", good("nb"), failed=False)

    def busy_without_memory(ledger):
        ledger.sent("c0", "a", "na", "beta")
        ledger.sent("c0", "b", "nb", "beta", "reject", racing=True)
        ledger.answered("c0", "a", good("na"), failed=False)
        ledger.answered("c0", "b", BUSY, failed=True)

    def rejected(ledger):
        ledger.sent("c0", "a", "na", "alpha")
        ledger.sent("c0", "b", "nb", "alpha", "reject", racing=True)
        ledger.answered("c0", "a", good("na"), failed=False)
        ledger.answered("c0", "b", BUSY, failed=True)

    def interrupted(ledger):
        ledger.sent("c0", "a", "na", "alpha")
        ledger.sent("c0", "b", "nb", "alpha", "interrupt", racing=True)
        ledger.answered("c0", "a", INTERRUPTED, failed=True)
        ledger.answered("c0", "b", good("nb"), failed=False)

    for setup, words in [
        (busy_without_reject, "busy answer to a task sent with interrupt"),
        (interrupted_by_nobody, "no later task asked to interrupt"),
        (interrupted_by_an_earlier_task, "no later task asked to interrupt"),
        (rolled_back_by_another_client, "no later task asked to roll back"),
        (superseded_by_enqueue, "no later interrupt or rollback"),
        (busy_without_memory, "agent without memory"),
    ]:
        found = one(setup)
        assert len(found) == 1 and words in found[0], (setup.__name__, found)
    assert one(rejected) == [] and one(interrupted) == []
    assert "the store gave it a Turn" in one(rejected, ran={"b": True})[0]
    assert "the model was asked" in one(rejected, seen={"nb"})[0]
    assert "never had a Turn" in one(interrupted, ran={"a": False, "b": True})[0]

    def not_interrupted(ledger):
        ledger.sent("c0", "a", "na", "alpha")
        ledger.sent("c0", "b", "nb", "alpha", "interrupt", racing=True)
        ledger.answered("c0", "a", good("na"), failed=False)
        ledger.answered("c0", "b", good("nb"), failed=False)

    ran = {"a": True, "b": True}
    # a's answer written before b arrived (it had ended): fine; 3 s after: left open
    assert one(not_interrupted, ran, times={"a": (0.0, 4.9), "b": (5.0, 9.0)}) == []
    assert one(not_interrupted, ran, times={"a": (0.0, 5.2), "b": (5.0, 9.0)}) == []  # slack
    late = one(not_interrupted, ran, times={"a": (0.0, 8.0), "b": (5.0, 9.0)})
    assert len(late) == 1 and "left a (na) of c0 alpha open: it ended 3.00 s later" in late[0]
    repeated = one(rejected, effects=[("pay", "na", "req1"), ("pay", "na", "req1")])
    assert repeated == ["tool effect repeated: pay call req1 ran 2 times"]
    assert one(rejected, effects=[("stamp", "na", ""), ("stamp", "na", "")]) == []  # no key


@st.composite
def conversations(draw, leave_queued: bool = False):
    """Tasks of clients to the memory agent, with modes, and what a correct server does:
    per client the unanswered tasks in order (the first one's Turn running, or queued
    when ``running`` says not), answered as each mode says; step ``i`` is time ``i``.
    ``leave_queued``: the server is wrong, an interrupt or a rollback leaves the queued
    earlier tasks of the conversation queued (they run later, answered on their own)."""
    ledger = Ledger()
    truth = {"busy": 0, "interrupted": 0, "rolled_back": 0, "superseded": 0, "double": 0}
    left_ever: set[str] = set()
    ran: dict[str, bool] = {}
    times: dict[str, tuple[float, float]] = {}
    active: dict[str, list[str]] = {}

    def answer(client: str, thread: str, text: str, failed: bool, at: int) -> None:
        ledger.answered(client, thread, text, failed=failed)
        times[thread] = (times[thread][0], float(at))

    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["c0", "c1"]),
                st.sampled_from([None, "enqueue", "reject", "interrupt", "rollback", "finish"]),
                st.booleans(),
            ),
            max_size=30,
        )
    )
    i = 0
    for i, (client, mode, running) in enumerate(steps):
        mine = active.setdefault(client, [])
        if mode == "finish":
            if mine:
                thread = mine.pop(0)
                ran[thread] = True
                answer(client, thread, good(f"n{thread}"), False, i)
            continue
        thread = f"t{i}"
        ledger.sent(client, thread, f"n{thread}", "alpha", mode, racing=bool(mine))
        times[thread] = (float(i), float(i))
        if mine and mode is not None:
            truth["double"] += 1
        if not mine or mode in (None, "enqueue"):
            mine.append(thread)
            continue
        if mode == "reject":
            truth["busy"] += 1
            ran[thread] = False
            answer(client, thread, BUSY, True, i)
            continue
        left = []
        for j, earlier in enumerate(mine):
            if j == 0 and running:
                reason = "interrupted" if mode == "interrupt" else "rolled_back"
                text = INTERRUPTED if mode == "interrupt" else ROLLED_BACK
            elif leave_queued:
                left.append(earlier)
                continue
            else:
                reason, text = "superseded", SUPERSEDED
            truth[reason] += 1
            ran[earlier] = reason != "superseded"
            answer(client, earlier, text, True, i)
        left_ever.update(left)
        mine[:] = [*left, thread]
    for client, mine in active.items():
        for thread in mine:
            ran[thread] = True
            answer(client, thread, good(f"n{thread}"), False, i + 1)
    # Left once and then answered on their own (a later double text may have ended them).
    truth["left"] = sum(1 for a in ledger.answers if a.thread in left_ever and not a.failed)
    return ledger, ran, truth, times


@given(conversations())
def test_a_correct_servers_double_texts_pass_and_are_counted(drawn):
    ledger, ran, truth, times = drawn
    seen = {a.nonce for a in ledger.attempts.values() if ran.get(a.thread)}
    verdict = dt_check(ledger, ran, seen, times=times)
    assert verdict.ok, verdict.violations
    c = verdict.counts
    assert c["double_texts"] == truth["double"]
    assert (c["rejected_busy"], c["interrupted"], c["rolled_back"], c["superseded"]) == (
        truth["busy"],
        truth["interrupted"],
        truth["rolled_back"],
        truth["superseded"],
    )
    assert c["answered_once"] == len(ledger.attempts)


def test_the_clients_double_texts_stay_bounded_and_seeded():
    import random

    from chaos_multitask import MEMORY_AGENT, MODES, next_task

    agents = ("alpha", "beta", "gamma")
    draws = [next_task(random.Random(5), ["alpha"], 3, agents) for _ in range(2)]
    assert draws[0] == draws[1]  # from the seed only
    rng = random.Random(1)
    seen = [next_task(rng, [MEMORY_AGENT] * 3, 3, agents) for _ in range(200)]
    doubles = [t for t in seen if t is not None]
    assert doubles and all(t.agent == MEMORY_AGENT and t.racing for t in doubles)
    assert {t.multitask for t in doubles} == set(MODES)
    assert all(next_task(rng, [MEMORY_AGENT] * 4, 3, agents) is None for _ in range(50))
    assert all(next_task(rng, ["beta"] * 3, 3, agents) is None for _ in range(50))


@given(conversations(leave_queued=True))
def test_an_interrupt_that_leaves_a_queued_task_is_found(drawn):
    ledger, ran, truth, times = drawn
    seen = {a.nonce for a in ledger.attempts.values() if ran.get(a.thread)}
    verdict = dt_check(ledger, ran, seen, times=times)
    left = [v for v in verdict.violations if " open: it ended " in v]
    assert bool(left) == (truth["left"] > 0), (truth, verdict.violations)


def test_a_double_text_taken_after_a_later_one_counts_as_later():
    """An HTTP double text goes on a connection of its own: the server may take it after
    a task the client sent later over her socket. "Later" is the store's order then, not
    the send order (the suite's chaos run once saw such a rollback called a violation)."""
    ledger = Ledger()
    ledger.sent("c0", "a", "na", "alpha")
    ledger.sent("c0", "b", "nb", "alpha", "rollback", racing=True, via="http")  # took last
    ledger.sent("c0", "c", "nc", "alpha", "interrupt", racing=True)  # took before b
    ledger.answered("c0", "a", INTERRUPTED, failed=True)
    ledger.answered("c0", "c", ROLLED_BACK, failed=True)
    ledger.answered("c0", "b", good("nb"), failed=False)
    taken = set(ledger.attempts)
    seqs = {"a": 0, "c": 1, "b": 2}
    rows = {t: TaskRow(seqs[t], float(seqs[t]), True, float(seqs[t])) for t in taken}

    def verdict(rows):
        return check(
            ledger,
            taken,
            expected,
            memory_agents={"alpha"},
            rows=rows,
            model_nonces={"na", "nb", "nc"},
        )

    assert verdict(rows).ok, verdict(rows).violations
    # Without the store's rows, the send order is all there is: c's rollback then has no
    # later rollback, and the checker says so.
    assert any("rolled back, no later task" in v for v in verdict(None).violations)
    # The store read, but retention pruned c's row: b (over HTTP) may have come later.
    pruned = {t: row for t, row in rows.items() if t != "c"}
    assert verdict(pruned).ok, verdict(pruned).violations
