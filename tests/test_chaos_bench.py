"""The chaos bench (bench/chaos.py) runs in the suite: a short seeded run on SQLite, with
its faults, must end with no violation and its JSON line (docs/reliability.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serverproc import REPO, scratch_dir

pytestmark = pytest.mark.slow


def test_a_short_seeded_chaos_run_has_no_violation():
    out = scratch_dir()
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "chaos.py"),
            "--minutes",
            "0.3",
            "--seed",
            "25",
            "--store",
            "sqlite",
            "--drain",
            "90",
            "--budget-tokens",
            "2500",
            "--out",
            str(out),
        ],
        capture_output=True,
        timeout=240,
        cwd=out,
    )
    stderr = done.stderr.decode(errors="replace")
    lines = done.stdout.decode().strip().splitlines()
    assert lines, stderr[-3000:]
    counts = json.loads(lines[-1])
    assert done.returncode == 0 and counts["violations"] == 0, stderr[-3000:]
    assert counts["tasks"] > 0 and counts["answered_once"] == counts["taken"], counts
    # The double texts' part of the checker ran (docs/reliability.md).
    assert counts["tool_effects"] > 0 and counts["tool_effects_repeated"] == 0, counts
    assert "double_texts_by_mode" in counts and "rejected_busy" in counts, counts
    # Issue 43's parts ran: the A2A client, the HTTP double texts, the small budgets.
    assert counts["a2a_tasks"] > 0 and counts["a2a_internal_errors"] == 0, counts
    assert "http_tasks" in counts and "budget_refused_tasks" in counts, counts
    small = {"client:c1", "client:c2", "client:a2a", "client:mcp", "client:agui"}
    assert counts["budget_spend"] and set(counts["budget_spend"]) <= small, counts
    # Issue 47's doors ran: MCP calls (tasks and plain) and AG-UI runs, checked.
    assert counts["mcp_calls"] > 0 and counts["mcp_internal_errors"] == 0, counts
    assert counts["agui_runs"] > 0 and "agui_bad_end" in counts, counts
    assert "a2a_by_wire" in counts, counts
    assert "[chaos" in stderr  # progress lines
