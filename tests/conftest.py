"""Shared payload models and helpers for the pump tests."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import pytest
import trio
import trio.testing
from iomarks import IO_MARKERS, guard, markers_of
from lxml import etree
from pgutil import pg_server, pg_url  # noqa: F401 - fixtures for the PostgreSQL tests
from pydantic_xml import BaseXmlModel, element
from serverproc import DATA, ScratchRoot, ServerProcess

from agentserver.core.envelope import build_envelope
from agentserver.core.errors import EndpointClosed
from agentserver.core.namespaces import CORE_NS, ENVELOPE_NS

NS = "urn:test:pump"
NSMAP = {"": NS}


class Ping(BaseXmlModel, tag="ping", nsmap=NSMAP):
    text: str = element()


class Pong(BaseXmlModel, tag="pong", nsmap=NSMAP):
    text: str = element()


class Add(BaseXmlModel, tag="add", nsmap=NSMAP):
    a: int = element()
    b: int = element()


class Sum(BaseXmlModel, tag="sum", nsmap=NSMAP):
    value: int = element()


class Note(BaseXmlModel, tag="note", nsmap=NSMAP):
    text: str = element()


def envelope_bytes(
    payload: BaseXmlModel | etree._Element,
    *,
    to: str | None = None,
    thread: str = "not-a-uuid",
    sender: str = "someone",
) -> bytes:
    el = payload.to_xml_tree() if isinstance(payload, BaseXmlModel) else payload
    return etree.tostring(build_envelope(sender, to, thread, el))


def parse_reply(data: bytes) -> tuple[dict[str, str | None], etree._Element]:
    root = etree.fromstring(data)
    assert root.tag == f"{{{ENVELOPE_NS}}}message"
    meta = {child.tag.split("}")[1]: child.text for child in root[0]}
    return meta, root[1]


def local(el: etree._Element) -> str:
    return etree.QName(el).localname


def is_huh(el: etree._Element) -> bool:
    return el.tag == f"{{{CORE_NS}}}huh"


def is_system_error(el: etree._Element, code: str | None = None) -> bool:
    if el.tag != f"{{{CORE_NS}}}SystemError":
        return False
    return code is None or el.findtext(f"{{{CORE_NS}}}code") == code


def huh_text(el: etree._Element) -> str:
    return el.findtext(f"{{{CORE_NS}}}error")


def buffered(endpoint) -> list[bytes]:
    """What waits in the endpoint's buffer now (also after the endpoint closed)."""
    out = []
    while True:
        try:
            out.append(endpoint.receive_nowait())
        except (trio.WouldBlock, EndpointClosed):
            return out


async def drain(endpoint) -> list[bytes]:
    """Everything the endpoint has received once the whole system is quiescent."""
    await trio.testing.wait_all_tasks_blocked()
    return buffered(endpoint)


async def receive(endpoint, seconds: float = 5) -> tuple[dict[str, str | None], etree._Element]:
    with trio.fail_after(seconds):
        return parse_reply(await endpoint.receive())


#: Set (to anything but empty or ``0``) where no test that needs PostgreSQL or the browser
#: may skip: CI (.ci/run). Such a skip is then a failure, its reason kept.
NO_SKIP_ENV = "AGENTSERVER_TEST_NO_SKIP"
#: The markers of the tests that must run where ``NO_SKIP_ENV`` is set.
MUST_RUN = ("postgresql", "browser")


def _no_skip() -> bool:
    return os.environ.get(NO_SKIP_ENV, "") not in ("", "0")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``NO_SKIP_ENV``, a skipped test that needs PostgreSQL or the browser fails:
    a cluster or a chromium missing in CI must not leave their promises unchecked while
    the run stays green."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and _no_skip()) or hasattr(report, "wasxfail"):
        return
    needs = [m for m in MUST_RUN if item.get_closest_marker(m) is not None]
    if needs:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"skipped, but {NO_SKIP_ENV} is set and this test needs {' and '.join(needs)}: {reason}"
        )


def pytest_collection_modifyitems(items):
    """Every test that needs the PostgreSQL server is marked ``postgresql`` (so
    ``pytest -m postgresql`` selects them), whether it says so itself or not; every test
    is marked ``subprocess``, ``socket`` or ``database`` by what its code and fixtures use
    (tests/iomarks.py), and ``fast`` when it uses none of them: ``pytest -m fast`` is the
    fast loop (README.md)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        # (a fixture parametrised over backends asks for pg_url only when it runs)
        on_pg = callspec is not None and "postgresql" in callspec.params.values()
        if on_pg or "pg_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgresql)
        for name in sorted(markers_of(item)):
            item.add_marker(getattr(pytest.mark, name))
        if not any(item.get_closest_marker(name) for name in IO_MARKERS):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(autouse=True)
def _fast_means_memory_only(request, monkeypatch):
    """A ``fast`` test that starts a process, opens a socket or a database fails: its
    markers were derived wrongly (tests/iomarks.py), and the fast loop must not need them."""
    if request.node.get_closest_marker("fast") is not None:
        guard(monkeypatch)


@pytest.fixture(scope="session", autouse=True)
def _scratch_root(tmp_path_factory):
    """Subprocess working directories go to this session's pytest temporary directory."""
    ScratchRoot.path = tmp_path_factory.mktemp("scratch")
    yield
    ScratchRoot.path = None


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path, monkeypatch):
    """Every test runs in its own temporary directory, so a relative path (the agent
    store's default ``state/agents.sqlite3``) never reaches the checkout nor another test."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def server():
    """A real server (a subprocess) on tests/data/e2e-boot.xml, one per test module that
    asks for it (a module may define its own ``server`` instead)."""
    proc = ServerProcess.start(DATA / "e2e-boot.xml")
    yield proc
    assert proc.stop() == 0


def store_in(topology, directory: pathlib.Path):
    """``topology`` with its agents' store in ``directory`` instead of next to its boot.xml
    (for a boot.xml of the checkout, run in process: nothing may land in the checkout)."""
    store = dataclasses.replace(topology.store, path=directory / "state" / "agents.sqlite3")
    return dataclasses.replace(topology, store=store)
