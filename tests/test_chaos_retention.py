"""The chaos bench with ``--retention`` (issue 38): a short seeded run under every fault
while the store prunes with short windows; the checker finds no reply lost, none twice,
no approval's outcome missing, and tasks were pruned meanwhile. (The 30-minute soak of
docs/reliability.md is run by hand.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serverproc import REPO, scratch_dir

pytestmark = pytest.mark.slow

sys.path.insert(0, str(REPO / "bench" / "support"))


def test_the_store_element_gets_the_retention():
    from chaos_retention import RETENTION, with_retention

    assert with_retention('<store path="s.sqlite3" worker-concurrency="4"/>') == (
        f'<store path="s.sqlite3" worker-concurrency="4">{RETENTION}</store>'
    )


def test_the_models_summary_is_bounded_and_keeps_the_latest_tasks_proofs():
    from chaos_model import SUMMARY_START, ChaosModel
    from chaos_tools import NONCE

    from agentserver.agents.turn.compaction import SUMMARY_SYSTEM

    assert SUMMARY_SYSTEM.startswith(SUMMARY_START)
    old, new = "a" * 16, "b" * 16
    chunk = (
        f"NONCE[{old}] PROOF[stamp:{old}:{'1' * 12}] RESULT done\n"
        f"NONCE[{new}] PROOF[stamp:{new}:{'2' * 12}] PROOF[relay:{new}:{'3' * 12}]"
    )
    model = ChaosModel(7, 4.0)
    request = {
        "messages": [
            {"role": "system", "content": SUMMARY_SYSTEM},
            {"role": "user", "content": "Summary so far: none.\n" + chunk},
        ]
    }
    status, _, text = model.decide(request)
    assert status == 200 and isinstance(text, str)
    assert f"PROOF[stamp:{new}:{'2' * 12}]" in text and f"PROOF[relay:{new}:{'3' * 12}]" in text
    assert old not in text and not NONCE.findall(text)  # no task of its own, none twice
    assert model.stats.summaries == 1 and not model.nonces_seen
    # Folding the summary again does not grow it.
    request["messages"][1]["content"] = "Summary so far: " + text + "\n" + chunk
    assert len(model.decide(request)[2]) == len(text)


def test_a_run_pruned_with_its_tombstone_is_accounted_for(tmp_path):
    import sqlite3

    from chaos_schedules import check_schedules

    path = tmp_path / "s.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE schedules (name, cron, created_at, next_tick, skipped);"
        "CREATE TABLE schedule_runs (schedule, tick, outcome, inbox_id);"
        "CREATE TABLE agent_inbox (inbox_id, status);"
        "CREATE TABLE pruned_turns (inbox_id);"
        "CREATE TABLE agent_state_head (turn_inbox_id, status);"
        "INSERT INTO schedules VALUES ('s', '* * * * *', 0, 90, 0);"
        "INSERT INTO schedule_runs VALUES ('s', 60, 'fired', 'gone');"
    )
    db.commit()
    db.close()
    _, violations = check_schedules(path, None, 1000.0)
    assert violations == ["schedule s tick 60: fired, no task"]
    # Its tombstone was pruned too, after the run's SizeWatch saw it.
    assert check_schedules(path, None, 1000.0, {"gone"})[1] == []
    # And then the run record itself: seen before, it still counts.
    db = sqlite3.connect(path)
    db.execute("DELETE FROM schedule_runs")
    db.commit()
    db.close()
    assert check_schedules(path, None, 1000.0, {"gone"})[1] == [
        "schedule s: 1 ticks due, 0 runs + 0 missed accounted for"
    ]
    seen = {("s", 60.0): ("fired", "gone")}
    assert check_schedules(path, None, 1000.0, {"gone"}, seen)[1] == []


def test_a_short_chaos_run_with_retention_has_no_violation():
    out = scratch_dir()
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "chaos.py"),
            "--minutes",
            "1",
            "--seed",
            "7",
            "--store",
            "sqlite",
            "--drain",
            "90",
            "--retention",
            "--out",
            str(out),
        ],
        capture_output=True,
        timeout=300,
        cwd=out,
    )
    stderr = done.stderr.decode(errors="replace")
    lines = done.stdout.decode().strip().splitlines()
    assert lines, stderr[-3000:]
    counts = json.loads(lines[-1])
    assert done.returncode == 0 and counts["violations"] == 0, stderr[-3000:]
    assert counts["retention"] and counts["pruned_tasks"] > 0, counts
    assert counts["answered_once"] == counts["taken"] > 0, counts


def test_the_trend_compares_the_quarters_means_not_two_samples():
    from chaos_retention import trend

    swinging = [100, 150, 100, 150, 100, 150, 100, 150]  # flat, swinging by half
    assert trend(swinging)["file_trend_after_window"] == 0.0
    growing = [100, 100, 110, 120, 130, 140, 150, 160]
    got = trend(growing)
    assert got["file_bytes_mean_first_quarter"] == 100
    assert got["file_bytes_mean_last_quarter"] == 155
    assert got["file_trend_after_window"] == 0.55
