"""The MCP vocabulary on the wire: what a listener made of an MCP server's tool answers.

One type for every tool of every MCP server (docs/mcp.md): the tool's text content, one
``<text>`` each, and its structured content as JSON text in ``<structured>``. A result the
server marked ``isError`` says ``status="failed"``, which an agent reads as a failed tool
result (the model sees it; nothing crashes).
"""

from __future__ import annotations

from typing import Literal

from pydantic_xml import BaseXmlModel, attr, element

#: The namespace of the tool results (each MCP server's tool payloads have their own,
#: :func:`tool_namespace`).
MCP_NS = "urn:agentserver:mcp"
RESULT_TAG = f"{{{MCP_NS}}}result"


def tool_namespace(server: str) -> str:
    """The namespace of the payloads of MCP server ``server``'s tools."""
    return f"{MCP_NS}:{server}"


class McpResult(BaseXmlModel, tag="result", nsmap={"": MCP_NS}):
    """A tool's answer: ``status`` is ``failed`` when the MCP server said ``isError``."""

    status: Literal["ok", "failed"] = attr(default="ok")
    #: The listener that called the tool (``fs-read_file``).
    tool: str = attr()
    text: list[str] = element(tag="text", default_factory=list)
    #: The structured content, as JSON text.
    structured: str | None = element(tag="structured", default=None)
