"""Which outside resources a test uses, read from its code: the ``subprocess``, ``socket``
and ``database`` markers, applied by tests/conftest.py, and the guard that keeps them
honest.

A test's resources are found from what its code references: the test function, the
fixtures it asks for (defined in its module, its class or a conftest.py), and, followed
transitively, every function and class of the test helpers (modules in tests/) they
reference. Each name a code object uses (globals and attribute names alike, nested
functions and lambdas included) is looked up in that code's globals; a module so found
is looked into for the other names the code uses (``trio.serve_tcp``, ``subprocess.run``).
What is found is compared against :data:`RESOURCES`, a table of the APIs that open a
process, a socket or a database. Library code (agentserver, trio, ...) is not followed:
its I/O entry points are listed in the table instead, so an entry point that opens one
of them but is not listed is caught by the guard, not guessed.

The guard (:func:`guard`) fails a test that has none of the markers yet starts a process,
binds or connects a socket or opens a SQLite or PostgreSQL connection: a test in the fast
loop (``pytest -m fast``) can never silently need more than memory. Bounded: each code
object is read once per session (a cache), and the walk never leaves tests/.
"""

from __future__ import annotations

import dis
import functools
import importlib
import inspect
import os
import pathlib
import pty
import socket
import sqlite3
import subprocess
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

TESTS = pathlib.Path(__file__).resolve().parent

#: The markers for outside resources (registered, with what each means, in pyproject.toml);
#: a test with none of them is ``fast``.
IO_MARKERS = ("subprocess", "socket", "database", "postgresql")


def _resolve(dotted: str) -> Any | None:
    """The object at a dotted path, or None if its module does not import (optional
    packages); LookupError if the module has no such name."""
    module_name, _, attr = dotted.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    for part in filter(None, attr.split(".")):
        # A name that moved must not leave a stale entry that silently marks nothing.
        if not hasattr(obj, part):
            raise LookupError(f"tests/iomarks.py RESOURCES names {dotted}, which does not exist")
        obj = getattr(obj, part)
    return obj


#: What opens an outside resource, by marker: modules (any use of them counts) and the
#: library entry points that open one (an entry point's module path, then ``:`` and its
#: name). Only these are known: anything else a test uses is memory, until the guard
#: says otherwise (then the entry point belongs here).
RESOURCES: dict[str, tuple[str, ...]] = {
    "subprocess": (
        "subprocess",
        "pexpect",
        "multiprocessing",
        "trio:run_process",
        "trio.lowlevel:open_process",
        # (MCP servers over stdio: started by the SDK through anyio, in a worker thread)
        "agentserver.remote.mcp_client:open_session",
        "agentserver.remote.mcp_client:discover",
        "agentserver.remote.mcp_client:discover_blocking",
        "agentserver.remote.mcp_client:McpHub",
    ),
    "socket": (
        "socket",
        "http.server",
        "socketserver",
        "trio.socket",
        "trio:open_tcp_stream",
        "trio:open_tcp_listeners",
        "trio:serve_tcp",
        "trio:open_ssl_over_tcp_stream",
        "trio:open_ssl_over_tcp_listeners",
        "trio:serve_ssl_over_tcp",
        "trio:open_unix_socket",
        "agentserver.net.client:open_client",
        # (a client's connection on its own; in net/connect.py once net/client.py is split)
        "agentserver.net.client:connect_stream",
        "agentserver.net.connect:connect_stream",
        "agentserver.net.server:Server",
        "agentserver.app.root:run_server",
        "agentserver.remote.runner:run_runner",
        "agentserver.http.serve:serve_http",
    ),
    "database": (
        "sqlite3",
        "psycopg",
        "psycopg_pool",
        "agentserver.agents.store.sqlite_store",
        "agentserver.agents.store.pg.executor",
        "agentserver.agents.store.pg.store",
        # (an agent runtime always has its store; so has the service that runs one, and
        # the app's composition that builds and starts it from a topology)
        "agentserver.agents.runtime:AgentRuntime",
        "agentserver.app.runtime_parts:open_runtime",
        "agentserver.app.runtime_parts:runtime_parts",
        "agentserver.agents.service:AgentService",
        "agentserver.app.agents:start_agents",
        "agentserver.app.agents:build_agents",
    ),
}


@functools.cache
def _known() -> dict[int, tuple[str, object]]:
    """id(object) -> (marker, object) for the objects of :data:`RESOURCES` (the object is
    kept so its id stays its own)."""
    table: dict[int, tuple[str, object]] = {}
    for marker, paths in RESOURCES.items():
        for dotted in paths:
            obj = _resolve(dotted)
            if obj is not None:
                table[id(obj)] = (marker, obj)
    return table


def _marker_of(obj: object) -> str | None:
    found = _known().get(id(obj))
    if found is not None and found[1] is obj:
        return found[0]
    # A class or function of a listed module (``SqliteAgentStore``, ``subprocess.run``).
    owner = getattr(obj, "__module__", None)
    if isinstance(obj, type | types.FunctionType) and isinstance(owner, str):
        module = sys.modules.get(owner)
        if module is not None and not isinstance(module, type):
            found = _known().get(id(module))
            if found is not None and found[1] is module:
                return found[0]
    return None


def _is_test_helper(obj: object) -> bool:
    """A function or class written in tests/ (followed), not in a library (listed)."""
    code = getattr(obj, "__code__", None)
    if isinstance(code, types.CodeType):
        return _in_tests(code.co_filename)
    if isinstance(obj, type):
        module = sys.modules.get(obj.__module__)
        filename = getattr(module, "__file__", None)
        return isinstance(filename, str) and _in_tests(filename)
    return False


@functools.cache
def _in_tests(filename: str) -> bool:
    path = pathlib.Path(filename).resolve()
    # (this module's guard names every resource: it is the one helper not followed)
    return path.is_relative_to(TESTS) and path != pathlib.Path(__file__).resolve()


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions_of(obj: object) -> Iterator[Callable[..., Any]]:
    """The functions whose code ``obj`` runs: itself, or a class's methods."""
    obj = inspect.unwrap(obj) if callable(obj) else obj  # type: ignore[arg-type]
    if isinstance(obj, types.FunctionType):
        yield obj
    elif isinstance(obj, type):
        for klass in obj.__mro__:
            if not _is_test_helper(klass):
                continue
            for value in vars(klass).values():
                for candidate in (value, getattr(value, "__func__", None)):
                    if isinstance(candidate, types.FunctionType):
                        yield candidate
                if isinstance(value, property) and value.fget is not None:
                    yield value.fget  # type: ignore[misc]


_IMPORT_NAME = dis.opmap["IMPORT_NAME"]


@functools.cache
def _imported_modules(code: types.CodeType) -> tuple[str, ...]:
    """The modules a code object imports while it runs (``import`` inside a function)."""
    if _IMPORT_NAME not in code.co_code[::2]:  # (opcodes sit at even offsets: a quick no)
        return ()
    return tuple(
        i.argval
        for i in dis.get_instructions(code)
        if i.opname == "IMPORT_NAME" and isinstance(i.argval, str)
    )


@functools.cache
def _import(name: str) -> types.ModuleType | None:
    """A module a test imports inside a function, imported now to read it (None if it
    does not import here: then it cannot be followed, and the guard has the last word)."""
    # Reading a test is not using what it imports: an old import path's DeprecationWarning
    # belongs to the test that runs the import (tests/test_layers.py checks it), not here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return importlib.import_module(name)
        except Exception:
            return None


@functools.cache
def _direct(func: Callable[..., Any]) -> tuple[frozenset[str], tuple[Callable[..., Any], ...]]:
    """What one function's own code uses: the markers it earns, and the test helpers it
    calls (followed by :func:`markers_of_function`)."""
    found: set[str] = set()
    helpers: list[Callable[..., Any]] = []
    namespace = getattr(func, "__globals__", {})
    for code in _codes(func.__code__):
        names = set(code.co_names)
        # ``import a.b`` and ``from a.b import c`` inside a function put "a.b" among
        # the names: the module, imported here, stands for it.
        imported = {m: _import(m) for m in _imported_modules(code)}
        for name in names:
            obj = imported[name] if name in imported else namespace.get(name)
            if obj is None:
                continue
            candidates = [obj]
            if isinstance(obj, types.ModuleType):
                with warnings.catch_warnings():  # (a package's old names: as above)
                    warnings.simplefilter("ignore", DeprecationWarning)
                    candidates += [getattr(obj, n) for n in names if hasattr(obj, n)]
            for candidate in candidates:
                marker = _marker_of(candidate)
                if marker is not None:
                    found.add(marker)
                elif _is_test_helper(candidate):
                    helpers.extend(_functions_of(candidate))
    return frozenset(found), tuple(helpers)


@functools.cache
def markers_of_function(func: Callable[..., Any]) -> frozenset[str]:
    """The resources a test-side function uses, followed through the test helpers."""
    found: set[str] = set()
    seen: set[Callable[..., Any]] = set()
    todo: list[Callable[..., Any]] = [func]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        markers, helpers = _direct(current)
        found |= markers
        todo.extend(helpers)
    return frozenset(found)


def _fixture_functions(item: pytest.Function) -> Iterator[Callable[..., Any]]:
    """The functions of the fixtures ``item`` asks for, by name: from its class, its
    module, then the conftest.py files above it (the nearest one first), as pytest
    looks them up."""
    namespaces: list[dict[str, Any]] = []
    if item.cls is not None:
        namespaces.append(dict(vars(item.cls)))
    namespaces.append(vars(item.module))
    conftests = [
        plugin
        for plugin in item.config.pluginmanager.get_plugins()
        if isinstance(plugin, types.ModuleType)
        and plugin.__file__ is not None
        and pathlib.Path(plugin.__file__).name == "conftest.py"
        and item.path.is_relative_to(pathlib.Path(plugin.__file__).parent)
    ]
    conftests.sort(key=lambda m: len(pathlib.Path(m.__file__).parts), reverse=True)
    namespaces += [vars(m) for m in conftests]
    by_name: dict[str, Callable[..., Any]] = {}
    for namespace in reversed(namespaces):  # the nearest definition wins
        for value in namespace.values():
            name = getattr(value, "name", None)
            wrapped = getattr(value, "__wrapped__", None)
            if type(value).__name__ == "FixtureFunctionDefinition" and wrapped is not None:
                by_name[name] = inspect.unwrap(wrapped)
    for name in item.fixturenames:
        if name in by_name:
            yield by_name[name]


def markers_of(item: pytest.Item) -> set[str]:
    """The resource markers ``item`` earns by what it and its fixtures use."""
    if not isinstance(item, pytest.Function):
        return set()
    test = inspect.unwrap(item.function)
    # (hypothesis's @given wraps the test without __wrapped__; it keeps it here)
    test = getattr(getattr(test, "hypothesis", None), "inner_test", test)
    found = set(markers_of_function(test))
    for fixture in _fixture_functions(item):
        found |= markers_of_function(fixture)
    if "pg_server" in item.fixturenames or "pg_url" in item.fixturenames:
        found.add("database")
    return found


# -- the guard ----------------------------------------------------------------------


class UnmarkedResource(AssertionError):
    """A test that has no resource marker used one (see tests/iomarks.py)."""


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnmarkedResource(
            f"this test {what} but is not marked for it: the markers are derived from "
            "what the test references (tests/iomarks.py); list the entry point that does "
            "it in RESOURCES there"
        )

    return refuse


def guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every way out of memory fail the test: sockets bound or connected, processes
    started, SQLite or PostgreSQL connections opened. Undone with ``monkeypatch``."""
    for method in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, method, _refuse(f"calls socket.{method}"))
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("starts a process"))
    monkeypatch.setattr(os, "fork", _refuse("forks"))
    monkeypatch.setattr(os, "posix_spawn", _refuse("spawns a process"))
    monkeypatch.setattr(pty, "fork", _refuse("forks a pty"))
    # (trio's own wake-up socket pair is made without bind or connect: a run still works)
    monkeypatch.setattr(sqlite3, "connect", _refuse("opens a SQLite database"))
    psycopg = _resolve("psycopg")
    if psycopg is not None:
        monkeypatch.setattr(psycopg.Connection, "connect", _refuse("connects to PostgreSQL"))
    monkeypatch.setattr(os, "forkpty", _refuse("forks a pty"))
