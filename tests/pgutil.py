"""PostgreSQL for the tests (fixtures, imported by ``conftest.py``; helpers, not tests).

A server is used when one is configured: ``AGENTSERVER_TEST_PG_URL``, or the ``PG*``
variables ``pg_virtualenv`` exports (``PGHOST``/``PGPORT``/...). Without one, every test
that needs it is skipped with the reason. A server configured but not reachable fails
every such test instead (a broken cluster must not pass for "no PostgreSQL here": the
tests it would have run are unchecked). Each test gets a database of its own, created
for it and dropped after it, so tests cannot see each other's rows.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote, urlencode

import pytest

URL_ENV = "AGENTSERVER_TEST_PG_URL"
_LIBPQ_ENV = ("PGHOST", "PGPORT", "PGHOSTADDR", "PGSERVICE", "PGDATABASE")
HOW = (
    f"no PostgreSQL server for the tests: set {URL_ENV}=postgresql://... or run under "
    "pg_virtualenv (e.g. `pg_virtualenv -- .venv/bin/pytest -m postgresql`)"
)


@dataclass(frozen=True, slots=True)
class PgServer:
    """Where the test server is: a maintenance connection string (``base``) and the parts
    needed to write a URL for another database on it."""

    base: str
    host: str
    port: int
    user: str
    password: str | None

    def url(self, dbname: str) -> str:
        """A ``postgresql://`` URL for ``dbname`` on this server (a socket directory as
        host goes in the query, as libpq expects)."""
        auth = quote(self.user, safe="")
        if self.password:
            auth += ":" + quote(self.password, safe="")
        if self.host.startswith("/"):
            query = urlencode({"host": self.host, "port": self.port})
            return f"postgresql://{auth}@/{quote(dbname)}?{query}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"postgresql://{auth}@{host}:{self.port}/{quote(dbname)}"


@dataclass(frozen=True, slots=True)
class NoServer:
    """Why there is no test server: none configured (the tests skip) or one configured
    that cannot be used (they fail)."""

    reason: str
    configured: bool


def find_server() -> PgServer | NoServer:
    """The configured server, or why there is none."""
    base = os.environ.get(URL_ENV, "")
    if not base and not any(os.environ.get(v) for v in _LIBPQ_ENV):
        return NoServer(HOW, configured=False)
    where = f"{URL_ENV}={base}" if base else "the PG* variables"
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover - psycopg is a core dependency
        return NoServer(f"PostgreSQL configured ({where}) but psycopg is missing: {exc}", True)
    try:
        with psycopg.connect(base, connect_timeout=5, autocommit=True) as conn:
            info = conn.info
            return PgServer(base, info.host, info.port, info.user, info.password or None)
    except psycopg.Error as exc:
        fix = f"start it, or unset {URL_ENV} and the PG* variables to skip these tests"
        return NoServer(f"PostgreSQL configured ({where}) but not reachable ({fix}): {exc}", True)


@pytest.fixture(scope="session")
def pg_server() -> PgServer:
    """The test server: skips the test when none is configured, fails it when the one
    configured is not reachable."""
    found = find_server()
    if isinstance(found, NoServer):
        if found.configured:
            pytest.fail(found.reason.strip(), pytrace=False)
        pytest.skip(found.reason)
    return found


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """A URL to a new, empty database of its own on the test server; dropped after."""
    import psycopg
    from psycopg import sql

    name = f"agentserver_test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_server.base, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield pg_server.url(name)
    finally:
        with psycopg.connect(pg_server.base, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
