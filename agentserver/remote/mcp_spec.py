"""MCP servers as tools: what boot.xml's ``<mcp>`` declares and what a server offers, as
plain frozen data (read by :mod:`agentserver.config.mcp`, used by
:mod:`agentserver.remote.mcp_client`), and the tool → listener name mapping."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentserver.core.jsonschema_xsd import ToolShape

#: A listener name is at most this long (agentserver.core.listener.NAME_RE).
MAX_NAME = 64


@dataclass(frozen=True, slots=True)
class McpServerSpec:
    """One ``<mcp>``: an MCP server reached over stdio (``command``) or streamable HTTP
    (``url``). ``env`` and ``headers`` hold values already read from the environment."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    #: The tools offered (by the server's names); None: every tool it lists.
    allow: tuple[str, ...] | None = None
    #: Seconds one call may take (then it is cancelled on the MCP side too).
    timeout: float = 30.0
    #: Seconds connecting (a stdio server's start included) and listing the tools may take.
    connect_timeout: float = 30.0
    #: Calls in flight at once, per tool listener.
    concurrency: int = 8
    #: A failed (server down, transport lost) or timed-out attempt may be retried, up to
    #: ``retries`` more times (agentserver.steps.retry.backoff apart).
    idempotent: bool = False
    retries: int = 3
    line: int = 0
    #: The tools it listed when boot.xml was loaded (after the allow-list).
    tools: tuple[ToolInfo, ...] = ()

    @property
    def where(self) -> str:
        """How logs and ``check`` name it."""
        if self.url is not None:
            return self.url
        return " ".join((self.command or "", *self.args))


@dataclass(frozen=True, slots=True)
class ToolInfo:
    """One tool as the server lists it."""

    name: str
    description: str
    input_schema: Mapping[str, Any]

    @classmethod
    def from_mcp(cls, tool: Any) -> ToolInfo:
        """From the SDK's ``Tool``."""
        return cls(tool.name, tool.description or "", dict(tool.input_schema or {}))


def tool_listener_name(server: str, tool: str) -> str:
    """The listener of ``server``'s tool ``tool``: ``server-tool``, the tool's name mapped
    to the listener-name alphabet (``[a-z0-9_-]``; camelCase becomes snake_case, any other
    character ``_``; dots stay reserved for call chains), cut to 64 characters."""
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", tool).lower()
    mapped = re.sub(r"[^a-z0-9_-]", "_", snake) or "_"
    return f"{server}-{mapped}"[:MAX_NAME]


@dataclass(frozen=True, slots=True)
class McpToolRef:
    """What makes a listener an MCP tool: its server, the tool's name there, and the
    mapping between its XML payload and the tool's JSON arguments."""

    server: str
    tool: str
    shape: ToolShape = field(compare=False)

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The argument paths carried as JSON text (what the schema mapping could not do)."""
        return tuple(self.shape.fallbacks)
