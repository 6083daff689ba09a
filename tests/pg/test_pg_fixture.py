"""The ``pg_url`` fixture: a reachable, empty database of its own per test."""

from __future__ import annotations

import psycopg
import pytest
from pgutil import PgServer


def test_pg_url_is_an_empty_database_of_its_own(pg_url: str, request) -> None:
    assert pg_url.startswith("postgresql://")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchone()
        assert tables == (0,)
        name = conn.execute("SELECT current_database()").fetchone()[0]
        assert name.startswith("agentserver_test_")
    assert request.node.get_closest_marker("postgresql") is not None


def test_two_tests_never_share_a_database(pg_url: str, pg_server: PgServer) -> None:
    with psycopg.connect(pg_url) as conn:
        conn.execute("CREATE TABLE mine (x int)")
    other = pg_server.url("agentserver_test_other_does_not_exist")
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(other, connect_timeout=5).close()


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("localhost", "postgresql://u:p%40ss@localhost:5433/db"),
        ("::1", "postgresql://u:p%40ss@[::1]:5433/db"),
        ("/run/pg", "postgresql://u:p%40ss@/db?host=%2Frun%2Fpg&port=5433"),
    ],
)
def test_url_forms(host: str, expected: str) -> None:
    assert PgServer("", host, 5433, "u", "p@ss").url("db") == expected
