"""The Turn's parts are held together by typed dependencies, not by the worker: they share
one ``TurnHold`` (fence, finish), and a step's tool calls are screened through one entry
point (``ToolDispatch.screen``)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from agents_fakes import make_harness
from test_agents_protocol import answer_after_tool

import agentserver
from agentserver.agents.turn.tool_dispatch import ToolDispatch

PACKAGE = Path(agentserver.__file__).parent


def test_the_worker_and_its_parts_share_the_runtimes_hold_and_get_no_worker_method(tmp_path):
    h = make_harness(tmp_path, answer_after_tool)
    worker = h.rt.worker
    assert worker.hold is h.rt.hold
    assert worker.model.hold is h.rt.hold and worker.tool_calls.hold is h.rt.hold
    for part in (worker.model, worker.tool_calls):
        for value in vars(part).values():
            assert getattr(value, "__self__", None) is not worker, value


def _screen_calls() -> set[tuple[str, str]]:
    """(module, enclosing function) of every ``<...>governor.screen(...)`` call."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "screen"
                    and "governor" in ast.unparse(node.func.value)
                ):
                    found.add((path.relative_to(PACKAGE).as_posix(), func.name))
    return found


def test_one_entry_point_screens_a_tool_call():
    assert _screen_calls() == {("agents/turn/tool_dispatch.py", "screen")}
    assert "governor.screen" in inspect.getsource(ToolDispatch.screen)


def test_the_worker_applies_every_effect_of_the_machine_and_decides_no_end():
    """The worker is the Turn machine's shell: it applies each kind of effect, and no
    Turn's status or answer is chosen in it (only the machine's Finish carries one)."""
    from typing import get_args

    from agentserver.agents.turn import worker
    from agentserver.agents.turn.machine import Effect

    source = inspect.getsource(worker)
    for effect in get_args(Effect):
        assert f"case {effect.__name__}(" in source, effect
    for part in ("worker.py", "model_step.py", "tool_dispatch.py"):
        text = (PACKAGE / "agents" / "turn" / part).read_text()
        assert "TaskStatus." not in text and "hold.finish(" not in text.replace(
            "await self.hold.finish(token, profile, status, text, meta, written)", ""
        ), part
