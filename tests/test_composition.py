"""The composition root's rule (docs/architecture.md, "The composition root"): objects
get their collaborators when they are made; no module sets a callback on another object
after construction, and the agents' service is built once, by the composition.

Checked on the source (AST), so a new late callback fails here whatever its name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import agentserver

PACKAGE = Path(agentserver.__file__).parent


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text(), str(path))


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


#: The late callbacks this rule removed (whatever their value's shape).
KNOWN = frozenset({"resolve", "report", "lost_calls"})


class _LateCallbacks(ast.NodeVisitor):
    """Assignments ``other.attr = <a callable>`` where ``other`` is not the object being
    built or run (``self``/``cls``): a bound method of ``self``, a lambda, a function of
    the enclosing scopes, a ``partial``; and any ``other.on_... =`` or of a
    :data:`KNOWN` name."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.found: list[str] = []
        self._methods: list[set[str]] = []  # of the enclosing classes
        self._functions: list[set[str]] = [set()]  # defined in the enclosing scopes

    def visit_Module(self, node: ast.Module) -> None:
        self._functions[0] = _defs(node.body)
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._methods.append(
            {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        )
        self.generic_visit(node)
        self._methods.pop()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._functions.append(_defs(node.body))
        self.generic_visit(node)
        self._functions.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def _check(self, target: ast.expr, value: ast.expr | None, line: int) -> None:
        if not isinstance(target, ast.Attribute) or _is_self(target.value) or value is None:
            return
        if isinstance(value, ast.Constant) and value.value is None:
            return
        if target.attr.startswith("on_") or target.attr in KNOWN or self._callable(value):
            self.found.append(f"{self.where}:{line}: {ast.unparse(target)} = {ast.unparse(value)}")

    def _callable(self, value: ast.expr) -> bool:
        if isinstance(value, ast.Lambda):
            return True
        if isinstance(value, ast.Attribute) and _is_self(value.value):
            return any(value.attr in methods for methods in self._methods)
        if isinstance(value, ast.Name):
            return any(value.id in names for names in self._functions)
        if isinstance(value, ast.Call):
            func = ast.unparse(value.func)
            return func in ("partial", "functools.partial")
        return False

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                self._check(t, node.value, node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check(node.target, node.value, node.lineno)
        self.generic_visit(node)


def _defs(body: list[ast.stmt]) -> set[str]:
    """The functions defined in ``body``'s scope, also inside its ``with``, ``try``,
    ``if``... (not those of the classes and functions it defines)."""
    names: set[str] = set()
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(stmt.name)
        elif not isinstance(stmt, ast.ClassDef):
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                inner = getattr(stmt, field, [])
                names |= _defs([b for i in inner for b in _block(i)])
    return names


def _block(node: ast.AST) -> list[ast.stmt]:
    """A statement of a block, or the body of a handler / match case."""
    if isinstance(node, ast.ExceptHandler | ast.match_case):
        return node.body
    return [node] if isinstance(node, ast.stmt) else []


def late_callbacks(where: str, tree: ast.Module) -> list[str]:
    visitor = _LateCallbacks(where)
    visitor.visit(tree)
    return visitor.found


def test_the_checker_finds_each_shape_of_late_callback() -> None:
    source = """
import functools

def handler(x): ...

class Webhooks:
    def __init__(self, outbox, store):
        outbox.resolve = self._resolve
        outbox.on_disabled = self.disabled
        store.inner.sink = self.sink
        self.own = self.sink  # its own attribute: fine
        outbox.limit = self.limit  # data, not a method: fine
        outbox.on_x = None  # cleared: fine
        outbox.resolve = store.lookup

    def _resolve(self): ...
    def disabled(self): ...
    def sink(self): ...

def build(tools, runtime):
    with open("x"):
        async def report(a): ...
    tools.report = report
    tools.hook = lambda a: a
    tools.part = functools.partial(handler, 1)
    tools.fn = handler
    tools.value = runtime.value
"""
    found = late_callbacks("x.py", ast.parse(source))
    assert [f.split(": ", 1)[1] for f in found] == [
        "outbox.resolve = self._resolve",
        "outbox.on_disabled = self.disabled",
        "store.inner.sink = self.sink",
        "outbox.resolve = store.lookup",
        "tools.report = report",
        "tools.hook = lambda a: a",
        "tools.part = functools.partial(handler, 1)",
        "tools.fn = handler",
    ]


def test_no_module_sets_a_callback_on_another_object_after_construction() -> None:
    found = [hit for where, tree in _modules() for hit in late_callbacks(where, tree)]
    assert found == [], (
        "pass the collaborator to the constructor instead (the composition root builds "
        "in dependency order; docs/architecture.md, 'The composition root'):\n" + "\n".join(found)
    )


def _calls_of(name: str) -> list[str]:
    out = []
    for where, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == name:
                out.append(f"{where}:{node.lineno}")
    return out


def test_the_agent_service_is_built_once_by_the_composition() -> None:
    built = _calls_of("AgentService")
    assert len(built) == 1, built
    assert built[0].startswith("agentserver/app/agents.py:"), built


#: The parts of an agent runtime (agents/runtime.py ``RuntimeParts``).
RUNTIME_PARTS = (
    "SentMarks",
    "TurnEnder",
    "Approvals",
    "TurnHold",
    "Worker",
    "Watchdog",
    "Scheduler",
)


def test_the_agent_runtimes_parts_are_built_by_the_composition_only() -> None:
    """Each part of an agent runtime is made in one place, app/runtime_parts.py (the
    runtime is given them whole), and the runtime's constructor makes nothing."""
    for part in RUNTIME_PARTS:
        built = _calls_of(part)
        assert built and all(b.startswith("agentserver/app/runtime_parts.py:") for b in built), (
            part,
            built,
        )
    ((_, tree),) = [m for m in _modules() if m[0] == "agentserver/agents/runtime.py"]
    (runtime,) = [
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "AgentRuntime"
    ]
    (init,) = [n for n in runtime.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    assert not [ast.unparse(c) for c in ast.walk(init) if isinstance(c, ast.Call)]
