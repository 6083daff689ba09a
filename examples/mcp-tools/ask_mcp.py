"""An MCP client (the official SDK's, as Claude Desktop or an agent framework would use
it) that starts ``agentserver mcp`` over stdio and asks the assistant a question.

    python ask_mcp.py "QUESTION"   (the server must be running: agentserver run)
"""

from __future__ import annotations

import os
import sys

import trio
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client


async def main(question: str) -> None:
    port = os.environ.get("AGENTSERVER_PORT", "7340")
    server = StdioServerParameters(
        command="agentserver",
        args=["mcp", "boot.xml", "--connect", f"127.0.0.1:{port}"],
    )
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = (await session.list_tools()).tools
        print("tools:", ", ".join(t.name for t in tools))
        result = await session.call_tool("assistant", {"text": question})
        print("error:" if result.is_error else "answer:", result.content[0].text)


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "What is in my notes?")
