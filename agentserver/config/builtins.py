"""The built-in handler and payload names boot.xml may use, as declarations.

A listener's ``handler`` is ``module:function`` or a name in :data:`BUILTIN_HANDLERS`; a
payload ``type`` is ``module:Class`` or a name in :data:`BUILTIN_PAYLOADS`. This table says
what each name stands for (its payload types as import references, its default tuning);
the loader resolves the references as it resolves the file's own, and
:mod:`agentserver.app.builtins` makes the handlers. The payload types are references, not
imports: they live in layers above this one (the bundled listeners).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypedDict


class Tuning(TypedDict, total=False):
    """The listener settings a built-in handler defaults to: keywords of both
    :class:`~agentserver.config.topology.ListenerSpec` and the pump's ``Listener``."""

    raw: bool
    concurrency: int
    timeout: float
    queue_size: int


@dataclass(frozen=True, slots=True)
class BuiltinHandler:
    """What a built-in handler name declares: its payload types (``module:Class``) and the
    listener settings it defaults to (boot.xml may override each)."""

    accepts: tuple[str, ...]
    responds: tuple[str, ...] = ()
    defaults: Tuning = field(default_factory=Tuning)
    summary: str = ""


_ECHO = "agentserver.listeners.echo"
_CALC = "agentserver.listeners.calculator"
_ASSISTANT = "agentserver.listeners.assistant"
_CONSOLE = "agentserver.listeners.console"
_BOOT = "agentserver.primitives.core:Boot"

BUILTIN_PAYLOADS: Mapping[str, str] = MappingProxyType(
    {
        "echo.ping": f"{_ECHO}:Ping",
        "echo.pong": f"{_ECHO}:Pong",
        "calculator.add": f"{_CALC}:Add",
        "calculator.subtract": f"{_CALC}:Subtract",
        "calculator.multiply": f"{_CALC}:Multiply",
        "calculator.divide": f"{_CALC}:Divide",
        "calculator.sum": f"{_CALC}:Sum",
        "calculator.difference": f"{_CALC}:Difference",
        "calculator.product": f"{_CALC}:Product",
        "calculator.quotient": f"{_CALC}:Quotient",
        "calculator.error": f"{_CALC}:CalculatorError",
        "assistant.task": f"{_ASSISTANT}:Task",
        "assistant.answer": f"{_ASSISTANT}:Answer",
        "console.prompt": f"{_CONSOLE}:Prompt",
        "console.input": f"{_CONSOLE}:Input",
        "console.pending": f"{_CONSOLE}:Pending",
        "core.boot": _BOOT,
    }
)

BUILTIN_HANDLERS: Mapping[str, BuiltinHandler] = MappingProxyType(
    {
        "echo": BuiltinHandler(
            (BUILTIN_PAYLOADS["echo.ping"],),
            (BUILTIN_PAYLOADS["echo.pong"],),
            # Raw: the handler builds the reply with lxml, skipping two model conversions.
            {"raw": True},
            summary="ping → pong",
        ),
        "calculator": BuiltinHandler(
            tuple(
                BUILTIN_PAYLOADS[f"calculator.{op}"]
                for op in ("add", "subtract", "multiply", "divide")
            ),
            tuple(
                BUILTIN_PAYLOADS[f"calculator.{r}"]
                for r in ("sum", "difference", "product", "quotient", "error")
            ),
            summary="add/subtract/multiply/divide → sum/difference/product/quotient",
        ),
        "assistant": BuiltinHandler(
            (BUILTIN_PAYLOADS["assistant.task"],),
            (BUILTIN_PAYLOADS["assistant.answer"],),
            summary="task → answer (placeholder until the agent runtime is configured)",
        ),
        "console": BuiltinHandler(
            (
                BUILTIN_PAYLOADS["console.prompt"],
                "agentserver.agents.governance.approvals:ApprovalRequest",
            ),
            (BUILTIN_PAYLOADS["console.input"],),
            # A human may take long to type a line. Prompts are read one at a time by the
            # handler itself, so an approval request is shown while a prompt waits.
            {"concurrency": 4, "timeout": 86400.0},
            summary="prompt → reads a line → input; approval-request → shown",
        ),
        "console-router": BuiltinHandler(
            (BUILTIN_PAYLOADS["console.input"], BUILTIN_PAYLOADS["console.pending"]),
            (BUILTIN_PAYLOADS["console.prompt"],),
            # Raw: it relays whatever payload its peers answer with. Each waiting console
            # holds one slot (the pending reminder), hence the generous concurrency.
            {"raw": True, "concurrency": 64, "timeout": 60.0, "queue_size": 256},
            summary="input → the addressed listener → prompt",
        ),
        "system-boot": BuiltinHandler(
            (_BOOT,),
            (),
            {"concurrency": 1},
            summary="boot primitive → starts an attached console",
        ),
    }
)
