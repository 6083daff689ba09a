"""The resource markers are derived from what a test uses, and the guard holds a ``fast``
test to memory (tests/iomarks.py; the fast loop in README.md)."""

from __future__ import annotations

import socket
import sqlite3
import subprocess
import sys
import tomllib

import iomarks
import pytest
from serverproc import REPO, ServerProcess

from agentserver.agents.store.sqlite_store import SqliteAgentStore


def uses_a_server():
    return ServerProcess.start


def uses_the_store(tmp_path):
    return SqliteAgentStore.open(tmp_path)


def imports_sqlite_inside():
    import sqlite3 as db

    return db.connect(":memory:")


def calls_a_helper():
    return uses_a_server()


def pure():
    return sorted([3, 1, 2])


@pytest.mark.parametrize(
    ("function", "expected"),
    [
        (uses_a_server, {"subprocess"}),
        (uses_the_store, {"database"}),
        (imports_sqlite_inside, {"database"}),
        (calls_a_helper, {"subprocess"}),
        (pure, set()),
    ],
)
def test_markers_follow_what_the_code_uses(function, expected):
    assert iomarks.markers_of_function(function) == expected


def test_the_guard_refuses_every_way_out_of_memory(monkeypatch, tmp_path):
    iomarks.guard(monkeypatch)
    with socket.socket() as sock, pytest.raises(iomarks.UnmarkedResource):
        sock.bind(("127.0.0.1", 0))
    with pytest.raises(iomarks.UnmarkedResource):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    with pytest.raises(iomarks.UnmarkedResource):
        sqlite3.connect(tmp_path / "x.sqlite3")


def test_the_markers_are_registered_and_the_fast_loop_documented():
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]
    names = {m.split(":")[0] for m in markers["ini_options"]["markers"]}
    assert {"subprocess", "socket", "database", "postgresql", "fast"} <= names
    assert "pytest -m fast" in (REPO / "README.md").read_text()
    assert "pytest -m fast" in (REPO / "docs" / "architecture.md").read_text()
    # No -q by default (issue 45): `pytest -m fast -q` would be -qq, which prints no
    # summary line.
    assert "-q" not in markers["ini_options"].get("addopts", "")
    assert {"browser"} <= names  # tests/conftest.py's no-skip rule selects by it
