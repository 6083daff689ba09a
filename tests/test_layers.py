"""The package's layering holds (docs/architecture.md "Layers"): read from the source.

Every module of ``agentserver/`` (and of ``listeners/`` and ``primitives/``, installed as
``agentserver.listeners`` and ``agentserver.primitives``) is parsed with :mod:`ast`, and
every import of one of our modules is collected: at module level, inside functions and
under ``TYPE_CHECKING`` alike (a deferred import is still a dependency; it only hides it
from the interpreter). The tests then check that

- no module imports a module of a higher layer;
- nothing imports ``app`` or ``cli`` except ``cli`` itself and ``__main__``;
- no two modules import each other, directly or through others (no cycle);
- no module of ours imports an old path of ``agentserver/_moved.py``;
- docs/architecture.md's layer map lists every module, and none that does not exist;
- every old path in ``_moved.MOVED`` imports as the very module of its new path.

No module is imported to find its imports, so a broken module cannot hide its own.
"""

from __future__ import annotations

import ast
import importlib
import re
import runpy
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from serverproc import REPO

from agentserver import _moved

#: Layers, low to high. A module may import its own layer and those below it.
#: ``agentserver.primitives`` sits with ``core``; ``agentserver.listeners`` with ``console``.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("agentserver.core", "agentserver.primitives")),
    ("observability", ("agentserver.observability",)),
    ("pump", ("agentserver.pump",)),
    ("net", ("agentserver.net",)),
    ("llm", ("agentserver.llm",)),
    ("steps", ("agentserver.steps",)),
    ("agents", ("agentserver.agents",)),
    ("remote", ("agentserver.remote",)),
    ("http", ("agentserver.http",)),
    ("config", ("agentserver.config",)),
    ("console", ("agentserver.console", "agentserver.listeners")),
    ("app", ("agentserver.app",)),
    ("cli", ("agentserver.cli",)),
)

#: The package root: ``agentserver/__init__.py`` and the old-path hook it installs. Every
#: layer may import them (``package_version``); they import no layer.
ROOT = ("agentserver", "agentserver._moved")
#: ``python -m agentserver``: above every layer; it imports ``cli`` only.
MAIN = "agentserver.__main__"

#: Accepted imports of a higher layer, as (importer, imported) module pairs: none. The
#: list may only shrink (a pair listed here that no longer exists fails the test too).
#: Never add to it: fix the import instead (a ``typing.Protocol`` in the lower layer
#: that the higher object satisfies).
KNOWN_VIOLATIONS: frozenset[tuple[str, str]] = frozenset()

#: Accepted import cycles, each as the set of modules on it (a strongly connected
#: component of the import graph; type-only imports count): none, and the same rule.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()


# -- reading the imports ---------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One import of one of our modules, where it is written."""

    importer: str
    imported: str
    path: Path
    line: int
    #: The dotted name as written (after resolving a relative import), for the old paths.
    written: str

    def where(self) -> str:
        return f"{self.path.relative_to(REPO).as_posix()}:{self.line}"


def module_files() -> dict[str, Path]:
    """Every module of the package by its import name, with its file."""
    found: dict[str, Path] = {}
    folders = {"agentserver": ("agentserver",), "listeners": ("agentserver", "listeners")}
    folders["primitives"] = ("agentserver", "primitives")
    for folder, prefix in folders.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [*prefix, *path.relative_to(REPO / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = module_files()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def resolve(name: str) -> str | None:
    """The module of ours that importing ``name`` runs last: the longest known prefix
    (``agentserver.core.listener.Listener`` -> ``agentserver.core.listener``), an old path
    mapped through ``_moved.MOVED``; None if ``name`` is not ours."""
    if name != "agentserver" and not name.startswith("agentserver."):
        return None
    parts = name.split(".")
    old = _moved.MOVED.get(parts[1]) if len(parts) > 1 else None
    if old is not None:
        parts = ["agentserver", *old.split("."), *parts[2:]]
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def imports_in(importer: str, path: Path) -> Iterator[Import]:
    """Every import of one of our modules in one file, wherever it is written."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = importer if importer in PACKAGES else importer.rpartition(".")[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            # ``from agentserver.x import y`` imports the submodule ``y`` when there is one.
            names = [f"{base}.{alias.name}" for alias in node.names] or [base]
        for name in names:
            target = resolve(name)
            if target is not None and target != importer:
                yield Import(importer, target, path, node.lineno, name)


ALL_IMPORTS: list[Import] = [
    found for name, path in MODULES.items() for found in imports_in(name, path)
]


def layer_of(module: str) -> int:
    """The rank of a module's layer: -1 the package root, len(LAYERS) ``__main__``."""
    if module in ROOT:
        return -1
    if module == MAIN:
        return len(LAYERS)
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def layer_name(rank: int) -> str:
    return {-1: "the package root", len(LAYERS): "__main__"}.get(
        rank, LAYERS[rank][0] if 0 <= rank < len(LAYERS) else "?"
    )


def upward_imports() -> dict[tuple[str, str], list[Import]]:
    found: dict[tuple[str, str], list[Import]] = {}
    for imp in ALL_IMPORTS:
        if layer_of(imp.imported) > layer_of(imp.importer):
            found.setdefault((imp.importer, imp.imported), []).append(imp)
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for imp in ALL_IMPORTS:
        graph[imp.importer].add(imp.imported)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def a_cycle_through(component: frozenset[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete cycle inside a strongly connected component, to show in a failure."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for succ in sorted(graph[node] & component):
            if succ == start:
                return [*paths[node], start]
            if succ not in paths:
                paths[succ] = [*paths[node], succ]
                queue.append(succ)
    return sorted(component)


def where(imports: dict[tuple[str, str], list[Import]], pair: tuple[str, str]) -> str:
    return ", ".join(sorted({imp.where() for imp in imports[pair]}))


# -- the rules ------------------------------------------------------------------------


def test_the_scan_sees_the_package():
    # A guard for the scanner itself: a mistake in it would make every rule pass.
    assert "agentserver.core.listener" in MODULES and "agentserver.listeners.echo" in MODULES
    assert "agentserver.primitives.core" in MODULES and MAIN in MODULES
    importers = {imp.importer for imp in ALL_IMPORTS}
    assert {"agentserver.pump.pump", "agentserver.app.root", MAIN} <= importers
    assert resolve("agentserver.listener.Listener") == "agentserver.core.listener"
    for module in MODULES:
        layer_of(module)  # every module is in a layer


def test_no_module_imports_a_higher_layer():
    found = upward_imports()
    new = sorted(set(found) - KNOWN_VIOLATIONS)
    gone = sorted(KNOWN_VIOLATIONS - set(found))
    lines = [
        f"{a} ({layer_name(layer_of(a))}) imports {b} ({layer_name(layer_of(b))}) at "
        f"{where(found, (a, b))}"
        for a, b in new
    ]
    assert not new, (
        "a module imports a higher layer (docs/architecture.md 'Layers'; use a "
        "typing.Protocol in the lower layer instead):\n  " + "\n  ".join(lines)
    )
    assert not gone, (
        "these imports are gone: remove them from KNOWN_VIOLATIONS in tests/test_layers.py:"
        "\n  " + "\n  ".join(f"{pair!r}," for pair in gone)
    )


def test_the_package_root_imports_no_layer():
    found = [
        imp
        for imp in ALL_IMPORTS
        if (imp.importer in ROOT and imp.imported not in ROOT)
        or (imp.importer == MAIN and not imp.imported.startswith("agentserver.cli"))
    ]
    assert not found, [f"{imp.importer} imports {imp.imported} at {imp.where()}" for imp in found]


def test_nothing_imports_app_or_cli_but_cli_and_main():
    found = [
        f"{imp.importer} imports {imp.imported} at {imp.where()}"
        for imp in ALL_IMPORTS
        if layer_name(layer_of(imp.imported)) in ("app", "cli")
        and layer_of(imp.importer) < layer_of(imp.imported)
        and (imp.importer, imp.imported) not in KNOWN_VIOLATIONS
    ]
    assert not found, "only cli (and __main__) may import app or cli:\n  " + "\n  ".join(found)


def test_net_never_imports_agents_remote_or_http():
    # Implied by the layer order for agents; net is where the temptation is (the server
    # reaches the runner hub and the agents' store): said once more, by name.
    forbidden = ("agentserver.agents", "agentserver.remote", "agentserver.http")
    found = {
        (imp.importer, imp.imported)
        for imp in ALL_IMPORTS
        if imp.importer.startswith("agentserver.net") and imp.imported.startswith(forbidden)
    }
    new = found - KNOWN_VIOLATIONS
    assert not new, sorted(new)


def test_no_import_cycle():
    graph = import_graph()
    found = set(cycles(graph))
    new = [c for c in found if c not in KNOWN_CYCLES]
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not new, "import cycles (each shown by one path through it):\n  " + "\n  ".join(
        " -> ".join(a_cycle_through(c, graph)) for c in new
    )
    assert not gone, (
        "these cycles are gone (or changed): remove them from KNOWN_CYCLES in "
        "tests/test_layers.py:\n  " + "\n  ".join(repr(sorted(c)) for c in gone)
    )


def test_no_module_of_ours_imports_an_old_path():
    old = [
        f"{imp.importer} imports {imp.written} at {imp.where()} (now agentserver."
        f"{_moved.MOVED[imp.written.split('.')[1]]})"
        for imp in ALL_IMPORTS
        if len(imp.written.split(".")) > 1 and imp.written.split(".")[1] in _moved.MOVED
    ]
    assert not old, "use the new import paths inside the package:\n  " + "\n  ".join(old)


# -- the layer map in docs/architecture.md ---------------------------------------------


def layer_map() -> dict[str, str]:
    """The layer map: each file its tables name in their first column -> the heading of
    the table (a ``###`` heading inside "## Layers")."""
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("\n## Layers")
    end = text.index("\n## ", start + 1)
    listed: dict[str, str] = {}
    heading = ""
    for line in text[start:end].splitlines():
        if line.startswith("### "):
            heading = line[4:]
        first = re.match(r"^\| *([^|]+?) *\|", line)
        if first:
            for file in re.findall(
                r"`((?:agentserver|listeners|primitives)/[\w/]+\.py)`", first[1]
            ):
                listed[file] = heading
    return listed


def expected_heading(module: str) -> str:
    """What the heading of a module's table starts with: its layer's name in backquotes."""
    rank = layer_of(module)
    if rank == -1:
        return "The package root"
    return f"`{LAYERS[min(rank, len(LAYERS) - 1)][0]}`"  # __main__ sits with cli


def agents_floors() -> list[tuple[str, tuple[str, ...]]]:
    """docs/architecture.md's map of the agents' floors, low to high: each floor's name and
    its members (``store/`` a subpackage, ``runtime`` a module directly in ``agents/``)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("<!-- agents-floors -->", 1)[1].split("```")[1]
    floors = []
    for line in block.strip().splitlines():
        rank, name, *members = line.split()
        assert int(rank) == len(floors) + 1, line
        floors.append((name, tuple(members)))
    return floors


def floor_of(module: str, floors: list[tuple[str, tuple[str, ...]]]) -> int:
    """The rank of a module of ``agentserver.agents`` in the floors' map."""
    rel = module.removeprefix("agentserver.agents").removeprefix(".")
    for rank, (_, members) in enumerate(floors):
        for member in members:
            if member.endswith("/"):
                sub = member[:-1]
                if rel == sub or rel.startswith(sub + "."):
                    return rank
            elif rel == member or (member == "__init__" and rel == ""):
                return rank
    raise AssertionError(f"{module} is on no floor of docs/architecture.md's agents map")


def test_no_module_of_agents_imports_a_higher_floor():
    floors = agents_floors()
    assert len(floors) > 5, "docs/architecture.md's agents floors were not found"
    agents = [
        m for m in MODULES if m == "agentserver.agents" or m.startswith("agentserver.agents.")
    ]
    for module in agents:
        floor_of(module, floors)  # every module sits on a floor
    upward = sorted(
        f"{imp.importer} ({floors[floor_of(imp.importer, floors)][0]}) imports "
        f"{imp.imported} ({floors[floor_of(imp.imported, floors)][0]}) at {imp.where()}"
        for imp in ALL_IMPORTS
        if imp.importer in agents
        and imp.imported in agents
        and floor_of(imp.imported, floors) > floor_of(imp.importer, floors)
    )
    assert not upward, "a module of agents imports a higher floor:\n  " + "\n  ".join(upward)


def test_remote_never_imports_agents():
    # The step machinery remote runners need lives in agentserver.steps, below the agents.
    found = sorted(
        f"{imp.importer} imports {imp.imported} at {imp.where()}"
        for imp in ALL_IMPORTS
        if imp.importer.startswith("agentserver.remote")
        and imp.imported.startswith("agentserver.agents")
    )
    assert not found, found


def test_the_layer_map_lists_every_module_and_no_other():
    files = {path.relative_to(REPO).as_posix(): name for name, path in MODULES.items()}
    listed = layer_map()
    missing = sorted(set(files) - set(listed))
    extra = sorted(set(listed) - set(files))
    misplaced = sorted(
        f for f in set(files) & set(listed) if not listed[f].startswith(expected_heading(files[f]))
    )
    assert not missing and not extra and not misplaced, (
        "docs/architecture.md's layer map ('## Layers': one table per layer under a '### "
        "`layer`' heading, one row per module, the file in backquotes in the first column) "
        "is out of date:\n"
        + "".join(
            f"  add a row for `{m}` under the heading {expected_heading(files[m])}\n"
            for m in missing
        )
        + "".join(f"  remove the row of `{m}` (no such file)\n" for m in extra)
        + "".join(
            f"  move the row of `{m}` from '### {listed[m]}' to the table under "
            f"{expected_heading(files[m])}\n"
            for m in misplaced
        )
    )


# -- the old import paths --------------------------------------------------------------


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_import_path_is_the_new_module(old):
    new = importlib.import_module(f"agentserver.{_moved.MOVED[old]}")
    assert importlib.import_module(f"agentserver.{old}") is new
    assert sys.modules[f"agentserver.{old}"] is new
    # The shared module keeps its own name: a reload or pickle looks for the new path.
    assert new.__spec__.name == new.__name__ == f"agentserver.{_moved.MOVED[old]}"


def test_from_an_old_path_import_a_name():
    from agentserver.core import listener
    from agentserver.listener import HandlerResponse, Listener

    assert (Listener, HandlerResponse) == (listener.Listener, listener.HandlerResponse)
    # ``from agentserver.client import open_client`` (docs/wire.md), read by name here:
    # naming the client in this test would mark it as one that opens a socket.
    old, new = (
        importlib.import_module(m) for m in ("agentserver.client", "agentserver.net.client")
    )
    assert getattr(old, "open_client") is getattr(new, "open_client")  # noqa: B009


def test_python_m_an_old_path_runs_the_new_module(tmp_path, monkeypatch, capsys):
    # ``python -m agentserver.schemas_export`` (docs/architecture.md), in process.
    from agentserver.core.schemas_export import core_xsd_bytes

    # As in a fresh ``python -m``: runpy finds an alias already imported by its module's
    # own spec, whose loader will not load it under the old name.
    monkeypatch.delitem(sys.modules, "agentserver.schemas_export", raising=False)
    monkeypatch.setattr(sys, "argv", ["schemas_export", str(tmp_path)])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module("agentserver.schemas_export", run_name="__main__", alter_sys=True)
    assert stopped.value.code == 0
    assert (tmp_path / "core.xsd").read_bytes() == core_xsd_bytes()
    assert capsys.readouterr().out == f"wrote {tmp_path / 'core.xsd'}\n"


# -- the public API in docs/api.md -----------------------------------------------------


def api_rows() -> list[tuple[str, list[str]]]:
    """docs/api.md's tables: each module in the first column, with the names in the
    second (the old-path table has no names: its second column is a module)."""
    text = (REPO / "docs" / "api.md").read_text()
    rows = []
    for first, second in re.findall(r"^\| `([\w.]+)` \| (.+?) \|", text, re.M):
        rows.append((first, re.findall(r"`([\w.]+)`", second)))
    return rows


def test_every_name_docs_api_lists_imports():
    rows = api_rows()
    assert len(rows) > 30, "docs/api.md's tables were not found"
    missing = []
    for module_name, names in rows:
        module = importlib.import_module(module_name)
        old = module_name.removeprefix("agentserver.")
        if old in _moved.MOVED:  # an old path: the second column is where it is now
            assert names == [f"agentserver.{_moved.MOVED[old]}"], module_name
            continue
        missing += [f"{module_name}.{n}" for n in names if not hasattr(module, n)]
    assert not missing, f"docs/api.md lists names that do not exist: {missing}"
    listed_old = {m.removeprefix("agentserver.") for m, _ in rows} & set(_moved.MOVED)
    assert listed_old == set(_moved.MOVED), "docs/api.md must list every old path"


def test_the_scan_finds_imports_wherever_they_are_written(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from . import routing\n"
        "from .threads import ThreadRegistry\n"
        "from agentserver import listener\n"  # an old path, as a submodule
        "if TYPE_CHECKING:\n"
        "    from agentserver.pump.pump import Pump\n"
        "def later():\n"
        "    import agentserver.net.client\n"
        "    from agentserver.app import builtins\n"
    )
    found = {(i.imported, i.line) for i in imports_in("agentserver.core.sample", source)}
    assert found == {
        ("agentserver.core.routing", 3),
        ("agentserver.core.threads", 4),
        ("agentserver.core.listener", 5),
        ("agentserver.pump.pump", 7),
        ("agentserver.net.client", 9),
        ("agentserver.app.builtins", 10),
    }


def test_the_cycle_search_finds_every_cycle_and_shows_one_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d", "a"}, "e": {"f"}, "f": set()}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]  # (a module importing itself is no cycle)
    assert a_cycle_through(frozenset({"a", "b", "c"}), graph) == ["a", "b", "c", "a"]
