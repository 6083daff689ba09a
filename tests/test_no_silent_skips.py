"""No silent skips (issue 43): a PostgreSQL configured but unreachable fails the tests
that need it, and where ``AGENTSERVER_TEST_NO_SKIP`` is set (CI, .ci/run) a test that
needs PostgreSQL or the browser fails rather than skips. Each case is a real pytest run
of the suite's own files in a subprocess, with the environment it names."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PG_TESTS = "tests/pg/test_pg_fixture.py"
BROWSER_TESTS = "tests/test_ui_browser.py"
#: Nothing listens on port 1 of loopback: connections are refused at once.
UNREACHABLE = "postgresql://nobody@127.0.0.1:1/agentserver"


def run_pytest(tmp_path: pathlib.Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """pytest on ``args`` from the checkout, with no PostgreSQL configured but ``env``."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PG")
        and k not in ("AGENTSERVER_TEST_PG_URL", "AGENTSERVER_TEST_NO_SKIP")
    }
    clean.update(env, COLUMNS="1000")  # the skip reasons in full
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rs",
            "--basetemp",
            str(tmp_path / "t"),
            *args,
        ],
        cwd=REPO,
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_without_postgresql_the_tests_that_need_it_skip_saying_why(tmp_path) -> None:
    done = run_pytest(tmp_path, PG_TESTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed, 2 skipped" in done.stdout
    assert "no PostgreSQL server for the tests: set AGENTSERVER_TEST_PG_URL" in done.stdout


@pytest.mark.parametrize(
    "env",
    [
        {"AGENTSERVER_TEST_PG_URL": UNREACHABLE},
        # pg_virtualenv's variables naming a cluster that is gone
        {"PGHOST": "127.0.0.1", "PGPORT": "1", "PGUSER": "nobody"},
    ],
    ids=["url", "pg-variables"],
)
def test_a_postgresql_configured_but_unreachable_fails_the_tests_that_need_it(
    tmp_path, env: dict[str, str]
) -> None:
    done = run_pytest(tmp_path, PG_TESTS, **env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "3 passed, 2 errors" in done.stdout
    assert "skipped" not in done.stdout
    assert "but not reachable" in done.stdout


def test_with_no_skip_set_a_skipped_postgresql_test_fails_with_its_reason(tmp_path) -> None:
    done = run_pytest(tmp_path, PG_TESTS, AGENTSERVER_TEST_NO_SKIP="1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "3 passed, 2 errors" in done.stdout
    assert "AGENTSERVER_TEST_NO_SKIP is set and this test needs postgresql" in done.stdout
    assert "no PostgreSQL server for the tests" in done.stdout  # the skip's own reason


def test_with_no_skip_set_a_skipped_browser_test_fails_and_without_it_skips(tmp_path) -> None:
    gone = str(tmp_path / "no-chromium")
    skipped = run_pytest(tmp_path, BROWSER_TESTS, AGENTSERVER_TEST_CHROMIUM=gone)
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert "1 skipped" in skipped.stdout and f"{gone} is missing" in skipped.stdout
    failed = run_pytest(
        tmp_path, BROWSER_TESTS, AGENTSERVER_TEST_CHROMIUM=gone, AGENTSERVER_TEST_NO_SKIP="1"
    )
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "1 error" in failed.stdout
    assert "AGENTSERVER_TEST_NO_SKIP is set and this test needs browser" in failed.stdout
    assert f"{gone} is missing" in failed.stdout


def test_a_test_of_neither_kind_may_still_skip_under_no_skip(tmp_path) -> None:
    """Only the tests that need PostgreSQL or the browser are held to run: the README's
    other skips (e.g. no second network address) stay skips."""
    (tmp_path / "test_other.py").write_text(
        "import pytest\n\ndef test_other():\n    pytest.skip('not here')\n"
    )
    done = run_pytest(
        tmp_path,
        "--rootdir",
        str(REPO),
        "-c",
        str(REPO / "pyproject.toml"),
        "--confcutdir",
        str(REPO / "tests"),
        str(tmp_path / "test_other.py"),
        AGENTSERVER_TEST_NO_SKIP="1",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout
