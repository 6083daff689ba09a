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
