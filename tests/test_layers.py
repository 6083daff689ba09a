"""The package's layering holds (docs/architecture.md "Layers"): read from the source.

Every module of ``agentserver/`` (and of ``listeners/`` and ``primitives/``, installed as
``agentserver.listeners`` and ``agentserver.primitives``) is parsed with :mod:`ast`, and
every import of one of our modules is collected: at module level, inside functions and
under ``TYPE_CHECKING`` alike (a deferred import is still a dependency; it only hides it
from the interpreter). The tests then check that

- no module imports a module of a higher layer;
- nothing imports ``app`` or ``cli`` except ``cli`` itself and ``__main__``;
- no two modules import each other, directly or through others (no cycle);
- the face (``agentserver.listener``, ``.client``, ``.testing``: what users import) sits
  above the layers: no layer imports it, it imports no ``cli``;
- no module of ours, no test, bench or example imports an old path of
  ``agentserver/_moved.py``;
- docs/architecture.md's layer map lists every module, and none that does not exist; a
  module that reads the process environment says "environment" in its I/O cell;
- every old path in ``_moved.MOVED`` imports as the very module of its new path, with a
  ``DeprecationWarning`` naming the release that removes it;
- docs/api.md lists the face modules' ``__all__`` exactly, and every old path.

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
from lxml import etree
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
#: The face: the modules users import (docs/api.md), each re-exporting curated names of
#: the layers. Above every layer (``testing`` needs ``app``), so no layer depends on it;
#: it imports no ``cli``.
FACE = ("agentserver.client", "agentserver.listener", "agentserver.testing")
#: ``python -m agentserver``: above every layer and the face; it imports ``cli`` only.
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


def old_path_in(name: str) -> str | None:
    """The old path of ``_moved.MOVED`` that dotted ``name`` starts with (under
    ``agentserver.``), if any: ``agentserver.agents.bridge.PumpPorts`` -> ``agents.bridge``."""
    rest = name.removeprefix("agentserver.")
    for old in _moved.MOVED:
        if rest == old or rest.startswith(old + "."):
            return old
    return None


def resolve(name: str) -> str | None:
    """The module of ours that importing ``name`` runs last: the longest known prefix
    (``agentserver.core.listener.Listener`` -> ``agentserver.core.listener``), an old path
    mapped through ``_moved.MOVED``; None if ``name`` is not ours."""
    if name != "agentserver" and not name.startswith("agentserver."):
        return None
    parts = name.split(".")
    old = old_path_in(name)
    if old is not None:
        parts = ["agentserver", *_moved.MOVED[old].split("."), *parts[len(old.split(".")) + 1 :]]
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
    """The rank of a module's layer: -1 the package root, len(LAYERS) the face,
    len(LAYERS) + 1 ``__main__``."""
    if module in ROOT:
        return -1
    if module in FACE:
        return len(LAYERS)
    if module == MAIN:
        return len(LAYERS) + 1
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def layer_name(rank: int) -> str:
    return {-1: "the package root", len(LAYERS): "the face", len(LAYERS) + 1: "__main__"}.get(
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
    assert resolve("agentserver.core.listener.Listener") == "agentserver.core.listener"
    assert resolve("agentserver.agents.bridge.PumpPorts") == "agentserver.agents.edge.bridge"
    assert FACE[0] in MODULES and layer_of(FACE[0]) > layer_of("agentserver.cli.main")
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


def test_the_face_imports_no_cli_and_nothing_imports_the_face():
    # The face re-exports the layers for users; the layers never depend on it (the upward
    # rule says so too, since it sits above them), and it never reaches the command line.
    found = [
        f"{imp.importer} imports {imp.imported} at {imp.where()}"
        for imp in ALL_IMPORTS
        if (imp.importer in FACE and imp.imported.startswith(("agentserver.cli", MAIN)))
        or (imp.imported in FACE and imp.importer not in FACE)
    ]
    assert not found, found


def test_every_face_module_says_what_is_public():
    for face in FACE:
        tree = ast.parse(MODULES[face].read_text())
        declared = [
            node
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        ]
        assert declared, f"{face} has no explicit __all__"


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


def io_cells() -> dict[str, str]:
    """The layer map's "I/O" column: each file -> its cell (the last column of its row)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    return {
        row[1]: row[2].strip()
        for row in re.finditer(
            r"^\| `((?:agentserver|listeners|primitives)/[\w/]+\.py)` \|.*\|([^|]*)\|$",
            text,
            re.M,
        )
    }


def reads_the_environment(path: Path) -> bool:
    """Whether a module's code reads the process environment: ``os.environ``,
    ``os.getenv`` or either imported from ``os`` (docstrings and comments do not count)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "environb")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if {a.name for a in node.names} & {"environ", "getenv", "environb"}:
                return True
    return False


def expected_heading(module: str) -> str:
    """What the heading of a module's table starts with: its layer's name in backquotes."""
    rank = layer_of(module)
    if rank == -1:
        return "The package root"
    if module in FACE:
        return "The face"
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


def test_a_module_that_reads_the_environment_says_so():
    # The I/O column is what a reader trusts to find where configuration comes from.
    cells = io_cells()
    assert len(cells) > 100, "docs/architecture.md's I/O column was not found"
    silent = sorted(
        f"{file}: {cells[file]!r}"
        for file in (path.relative_to(REPO).as_posix() for path in MODULES.values())
        if file in cells and reads_the_environment(REPO / file) and "environment" not in cells[file]
    )
    assert not silent, (
        "these modules read os.environ: say 'environment' in their I/O cell in "
        "docs/architecture.md:\n  " + "\n  ".join(silent)
    )
    assert reads_the_environment(REPO / "agentserver/agents/profile/config.py")


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


def deprecation(old: str, new: str) -> str:
    """The warning an old path gives, as a regular expression."""
    return re.escape(
        f"agentserver.{old} is deprecated and will be removed in agentserver "
        f"{_moved.REMOVAL}: import agentserver.{new} "
    )


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_import_path_is_the_new_module_with_a_warning(old, monkeypatch):
    new = importlib.import_module(f"agentserver.{_moved.MOVED[old]}")
    # As on a user's first import: the alias is not imported yet.
    monkeypatch.delitem(sys.modules, f"agentserver.{old}", raising=False)
    with pytest.warns(DeprecationWarning, match=deprecation(old, _moved.MOVED[old])):
        assert importlib.import_module(f"agentserver.{old}") is new
    assert sys.modules[f"agentserver.{old}"] is new
    # The shared module keeps its own name: a reload or pickle looks for the new path.
    assert new.__spec__.name == new.__name__ == f"agentserver.{_moved.MOVED[old]}"


def test_the_warning_points_at_the_users_import(monkeypatch):
    # Python shows a DeprecationWarning by default when it is attributed to __main__'s
    # code: the warning must name the line that imports, not the import machinery.
    monkeypatch.delitem(sys.modules, "agentserver.framing", raising=False)
    with pytest.warns(DeprecationWarning) as caught:
        from agentserver.framing import FrameDecoder  # an old path, on purpose
    from agentserver.core.framing import FrameDecoder as new

    assert FrameDecoder is new
    assert [w.filename for w in caught] == [__file__]


def test_an_old_module_that_is_now_a_package_gives_its_names():
    from agentserver.agents.policy.evaluate import CallInfo, Decision, evaluate, parse_policy
    from agentserver.agents.profile.agent import AgentProfile

    old, new = "agents.policy.parse_policy", "agents.policy.evaluate.parse_policy"
    with pytest.warns(DeprecationWarning, match=deprecation(old, new)) as caught:
        from agentserver.agents.policy import parse_policy as old_parse_policy
    assert old_parse_policy is parse_policy and caught[0].filename == __file__
    old, new = "agents.profile.AgentProfile", "agents.profile.agent.AgentProfile"
    with pytest.warns(DeprecationWarning, match=deprecation(old, new)):
        from agentserver.agents.profile import AgentProfile as old_profile
    assert old_profile is AgentProfile
    with pytest.raises(ImportError):
        from agentserver.agents.policy import no_such_name  # noqa: F401
    # ``evaluate`` was the old module's function and is now the package's submodule: the
    # submodule evaluates when called.
    from agentserver.agents import policy

    policy_el = etree.fromstring(
        '<policy xmlns="https://xml-pipeline.org/ns/boot/v1" default="allow"/>'
    )
    call = CallInfo("assistant", "calculator", etree.fromstring("<add/>"), 0)
    old, new = "agents.policy.evaluate", "agents.policy.evaluate.evaluate"
    with pytest.warns(DeprecationWarning, match=deprecation(old, new)):
        verdict = policy.evaluate(parse_policy(policy_el), call, [], 0.0)
    assert verdict == evaluate(parse_policy(policy_el), call, [], 0.0)
    assert verdict.decision == Decision.ALLOW


def test_python_m_an_old_path_runs_the_new_module(tmp_path, monkeypatch, capsys):
    # ``python -m agentserver.schemas_export`` (docs/protocol.md), in process.
    from agentserver.core.schemas_export import core_xsd_bytes

    # As in a fresh ``python -m``: runpy finds an alias already imported by its module's
    # own spec, whose loader will not load it under the old name.
    monkeypatch.delitem(sys.modules, "agentserver.schemas_export", raising=False)
    monkeypatch.setattr(sys, "argv", ["schemas_export", str(tmp_path)])
    old, new = "schemas_export", "core.schemas_export"
    with (
        pytest.warns(DeprecationWarning, match=deprecation(old, new)),
        pytest.raises(SystemExit) as stopped,
    ):
        runpy.run_module("agentserver.schemas_export", run_name="__main__", alter_sys=True)
    assert stopped.value.code == 0
    assert (tmp_path / "core.xsd").read_bytes() == core_xsd_bytes()
    assert capsys.readouterr().out == f"wrote {tmp_path / 'core.xsd'}\n"


def old_name_written(written: str) -> bool:
    """Whether an import as written uses an old path (a module of ``_moved.MOVED``, or a
    name an old module's package forwards)."""
    if old_path_in(written) is not None:
        return True
    package, _, name = written.removeprefix("agentserver.").rpartition(".")
    return name in _moved.MOVED_NAMES.get(package, ("", frozenset()))[1]


def test_no_module_of_ours_imports_an_old_path():
    old = [
        f"{imp.importer} imports {imp.written} at {imp.where()}"
        for imp in ALL_IMPORTS
        if old_name_written(imp.written)
    ]
    assert not old, "use the new import paths inside the package:\n  " + "\n  ".join(old)


def test_no_test_bench_or_example_imports_an_old_path():
    # Old paths are for users' code that predates the moves; ours shows the current ones.
    # This file imports a few on purpose, to test them.
    found = []
    for folder in ("tests", "bench", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == Path(__file__):
                continue
            found += [
                f"{imp.written} at {imp.where()}"
                for imp in imports_in("tests.sample", path)
                if old_name_written(imp.written)
            ]
    assert not found, "use the new import paths:\n  " + "\n  ".join(found)


# -- the public API in docs/api.md -----------------------------------------------------


def api_sections() -> tuple[str, str]:
    """docs/api.md split in two: the public API, and its "Old import paths" section."""
    text = (REPO / "docs" / "api.md").read_text()
    public, _, old = text.partition("\n## Old import paths")
    assert old, "docs/api.md has no 'Old import paths' section"
    return public, old


def api_rows() -> list[tuple[str, list[str]]]:
    """docs/api.md's public tables: each module in the first column, with the names in
    the second."""
    public, _ = api_sections()
    return [
        (first, re.findall(r"`([\w.]+)`", second))
        for first, second in re.findall(r"^\| `([\w.]+)` \| (.+?) \|", public, re.M)
    ]


def test_every_name_docs_api_lists_imports():
    rows = api_rows()
    assert len(rows) >= len(FACE), "docs/api.md's tables were not found"
    missing = []
    for module_name, names in rows:
        assert old_name_written(module_name) is False, f"{module_name} is an old path"
        module = importlib.import_module(module_name)
        missing += [f"{module_name}.{n}" for n in names if not hasattr(module, n)]
    assert not missing, f"docs/api.md lists names that do not exist: {missing}"


@pytest.mark.parametrize("face", FACE)
def test_docs_api_lists_each_face_module_as_its_all(face):
    # The face's __all__ is the promise; docs/api.md says it in full, and no more.
    listed = [names for module, names in api_rows() if module == face]
    assert len(listed) == 1, f"docs/api.md must have one row for {face}"
    module = importlib.import_module(face)
    assert sorted(listed[0]) == sorted(module.__all__)
    assert all(hasattr(module, name) for name in module.__all__)


def test_docs_api_lists_every_old_path_with_its_removal():
    _, old = api_sections()
    rows = {
        first: rest
        for first, rest in re.findall(r"^\| `agentserver\.([\w.]+)` \| (.+) \|$", old, re.M)
    }
    expected = set(_moved.MOVED) | set(_moved.MOVED_NAMES)
    assert set(rows) == expected, "docs/api.md must list every old path of _moved.py"
    for path, target in _moved.MOVED.items():
        assert f"`agentserver.{target}`" in rows[path], path
    for path, (target, _) in _moved.MOVED_NAMES.items():
        assert f"`agentserver.{target}`" in rows[path], path
    assert f"removed in {_moved.REMOVAL}" in old
    changelog = (REPO / "CHANGELOG.md").read_text().partition("\n## [")[2]
    assert f"removed in {_moved.REMOVAL}" in changelog.partition("\n## [")[0], (
        "CHANGELOG.md's Unreleased section must announce the removal"
    )


def test_the_scan_finds_imports_wherever_they_are_written(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from . import routing\n"
        "from .threads import ThreadRegistry\n"
        "from agentserver import framing\n"  # an old path, as a submodule
        "from agentserver.agents import bridge\n"  # a dotted old path
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
        ("agentserver.core.framing", 5),
        ("agentserver.agents.edge.bridge", 6),
        ("agentserver.pump.pump", 8),
        ("agentserver.net.client", 10),
        ("agentserver.app.builtins", 11),
    }


def test_the_cycle_search_finds_every_cycle_and_shows_one_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d", "a"}, "e": {"f"}, "f": set()}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]  # (a module importing itself is no cycle)
    assert a_cycle_through(frozenset({"a", "b", "c"}), graph) == ["a", "b", "c", "a"]
