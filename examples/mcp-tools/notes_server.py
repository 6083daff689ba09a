"""A filesystem-like MCP server over stdio, written with the official SDK's MCPServer
(FastMCP in the 1.x SDK): two tools over the text files of the ``notes/`` folder next to
this file. boot.xml's ``<mcp name="notes" command="python" args="notes_server.py"/>``
starts it; agentserver makes each tool a listener (``notes-list_notes``,
``notes-read_note``).

    python notes_server.py   (speaks MCP on standard input and output)
"""

from __future__ import annotations

import pathlib

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

NOTES = pathlib.Path(__file__).resolve().parent / "notes"

server = MCPServer("notes")


@server.tool(description="List the notes (file names), one per line.")
def list_notes() -> str:
    return "\n".join(sorted(p.name for p in NOTES.glob("*.txt")))


@server.tool(description="Read one note by its file name and return its text.")
def read_note(name: str) -> str:
    path = NOTES / name
    # Only the files of notes/: no other path is readable through this tool.
    if path.parent != NOTES or not path.is_file():
        raise ToolError(f"no note named {name!r}")
    return path.read_text()


if __name__ == "__main__":
    server.run()
