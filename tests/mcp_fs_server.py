"""A real MCP server for the tests, written with the SDK's MCPServer (the 1.x FastMCP):
a tiny in-memory "filesystem" and a few tools that misbehave on purpose.

    python mcp_fs_server.py [--http PORT [--only modern|legacy]] [--marks DIR]

stdio by default; ``--http PORT`` serves streamable HTTP on 127.0.0.1:PORT at ``/mcp``;
``--only modern`` makes it a server of the 2026-07-28 revision only: a request of an older
revision (``initialize``, or a ``MCP-Protocol-Version`` of the handshake era) is answered
-32022 "Unsupported protocol version", naming 2026-07-28. ``--only legacy`` makes it a
server of the handshake era only (as most servers and SDKs still are): a request at
2026-07-28 (``server/discover``) is answered as an older SDK does, HTTP 400 with a JSON-RPC
error "Unsupported protocol version".
``--marks DIR``: the tools that must be observed from outside (a cancelled call, the
process's id) write files there.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time
import uuid

import anyio
from mcp import MCPError
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import RequestParams
from pydantic import ConfigDict

FILES = {
    "/notes/todo.txt": "buy milk",
    "/notes/ideas.txt": "an XML pump",
}

marks: pathlib.Path | None = None


class Tasks(Extension):
    """The 2026-07-28 Tasks extension (io.modelcontextprotocol/tasks) written on the SDK
    server's extension hooks, in memory: a call of ``add_later``, ``stuck`` or
    ``ask_later`` by a client that declares the extension is answered with a task handle.
    ``add_later``'s task completes (with the sum) once a second old; ``stuck``'s never
    does, and cancelling it writes the mark ``task-cancelled``; ``ask_later``'s waits for
    the answer to a question (an elicitation) until it is cancelled."""

    identifier = "io.modelcontextprotocol/tasks"

    def __init__(self) -> None:
        self.tasks: dict[str, dict] = {}

    def methods(self):
        return [
            MethodBinding("tasks/get", TaskIdParams, self.get),
            MethodBinding("tasks/update", TaskIdParams, self.ack),
            MethodBinding("tasks/cancel", TaskIdParams, self.cancel),
        ]

    async def intercept_tool_call(self, params, ctx, call_next):
        capabilities = ctx.session.client_capabilities
        declared = (capabilities.extensions if capabilities else None) or {}
        if (
            params.name not in ("add_later", "stuck", "ask_later")
            or self.identifier not in declared
        ):
            return await call_next(ctx)
        task_id = uuid.uuid4().hex
        arguments = params.arguments or {}
        total = arguments.get("a", 0) + arguments.get("b", 0)
        self.tasks[task_id] = {
            "tool": params.name,
            "born": time.monotonic(),
            "status": "working",
            "result": {
                "content": [{"type": "text", "text": f"later: {total}"}],
                "structuredContent": {"result": f"later: {total}"},
                "isError": False,
            },
        }
        return {"resultType": "task", **self.view(task_id)}

    def view(self, task_id: str) -> dict:
        task = self.tasks[task_id]
        if (
            task["status"] == "working"
            and task["tool"] == "add_later"
            and time.monotonic() - task["born"] > 1.0
        ):
            task["status"] = "completed"
        out = {
            "taskId": task_id,
            "status": task["status"],
            "createdAt": "2026-07-28T00:00:00Z",
            "lastUpdatedAt": "2026-07-28T00:00:00Z",
            "ttlMs": None,
            "pollIntervalMs": 100,
        }
        if task["status"] == "working" and task["tool"] == "ask_later":
            out["status"] = "input_required"
            out["inputRequests"] = {
                "name": {
                    "method": "elicitation/create",
                    "params": {
                        "mode": "form",
                        "message": "What is your name?",
                        "requestedSchema": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}},
                        },
                    },
                }
            }
        if task["status"] == "completed":
            out["result"] = task["result"]
        return out

    def known(self, params) -> str:
        if params.task_id not in self.tasks:
            raise MCPError(-32602, "Failed to retrieve task: Task not found")
        return params.task_id

    async def get(self, ctx, params):
        return {"resultType": "complete", **self.view(self.known(params))}

    async def ack(self, ctx, params):
        self.known(params)
        return {"resultType": "complete"}

    async def cancel(self, ctx, params):
        task = self.tasks[self.known(params)]
        if task["status"] == "working":
            task["status"] = "cancelled"
            if marks is not None:
                (marks / "task-cancelled").write_text(params.task_id)
        return {"resultType": "complete"}


class TaskIdParams(RequestParams):
    model_config = ConfigDict(extra="allow")
    task_id: str


server = MCPServer("fs", extensions=[Tasks()])


@server.tool(description="Adds two numbers (as a task, for a client of the Tasks extension).")
def add_later(a: int, b: int) -> str:
    return f"now: {a + b}"


@server.tool(description="Never ends as a task; at once otherwise.")
def stuck() -> str:
    return "not stuck"


@server.tool(description="As a task, waits for an answer to a question; at once otherwise.")
def ask_later() -> str:
    return "no question"


@server.tool(description="Read one file of the notes folder and return its text.")
def read_file(path: str) -> str:
    if path not in FILES:
        raise ToolError(f"no such file: {path}")
    return FILES[path]


@server.tool(description="List the files under a folder.")
def list_dir(folder: str, limit: int = 10) -> dict:
    names = sorted(p for p in FILES if p.startswith(folder.rstrip("/") + "/"))
    return {"files": names[:limit]}


@server.tool(description="Finds files; its schema is not all mappable to XML.")
def find(pattern: str | None = None, where: dict[str, str] | None = None) -> list[str]:
    return sorted(p for p in FILES if pattern is None or pattern in p)


@server.tool(description="Always fails.")
def boom(reason: str) -> str:
    raise ToolError(reason)


@server.tool(description="Takes its time; notes when it is cancelled.")
async def slow(seconds: float) -> str:
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        if marks is not None:
            (marks / "cancelled").write_text("cancelled")
        raise
    return "done"


@server.tool(description="The server process's id.")
def pid() -> str:
    return str(os.getpid())


@server.tool(description="Ends the server process in the middle of the call.")
def die() -> str:
    os._exit(3)


@server.tool(description="Ends the server process the first time it is called.")
def flaky() -> str:
    assert marks is not None
    if not (marks / "flaky").exists():
        (marks / "flaky").write_text(str(os.getpid()))
        os._exit(3)
    return f"survived in {os.getpid()}"


@server.tool(description="Adds a tool named extra and tells the client its tools changed.")
async def grow(ctx: Context) -> str:
    server.add_tool(lambda: "extra!", name="extra", description="Added later.")
    # subscriptions/listen streams: what a client at 2026-07-28 reads
    await ctx.notify_tools_changed()
    try:
        # the session's notification: what a client on a 2025 protocol revision reads
        await ctx.session.send_tool_list_changed()
    except Exception:  # no such channel at 2026-07-28 (stateless)
        pass
    return "grown"


def only(app, era: str):
    """``app`` refusing every request of the other era (the SDK serves both; this is the
    one switch it lacks): ``modern`` as a 2026-07-28-only server does, ``legacy`` as a
    server of the handshake era (an older SDK) does."""
    import json

    from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS

    async def asgi(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        headers = dict(scope["headers"])
        version = headers.get(b"mcp-protocol-version", b"").decode()
        modern = bool(version) and version not in HANDSHAKE_PROTOCOL_VERSIONS
        if modern == (era == "modern"):
            return await app(scope, receive, send)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            request_id = json.loads(body).get("id")
        except (ValueError, AttributeError):
            request_id = None
        if era == "modern":
            error = {
                "code": -32022,
                "message": "Unsupported protocol version",
                "data": {
                    "supported": list(MODERN_PROTOCOL_VERSIONS),
                    "requested": version or "2025-11-25",
                },
            }
        else:
            error = {
                "code": -32600,
                "message": f"Bad Request: Unsupported protocol version: {version}",
            }
        out = json.dumps({"jsonrpc": "2.0", "id": request_id, "error": error}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": out})

    return asgi


def main() -> None:
    global marks
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int)
    parser.add_argument("--marks")
    parser.add_argument("--only", choices=("modern", "legacy"))
    args = parser.parse_args()
    marks = pathlib.Path(args.marks) if args.marks else None
    if args.http and args.only:
        import uvicorn

        uvicorn.run(
            only(server.streamable_http_app(), args.only),
            host="127.0.0.1",
            port=args.http,
            log_level="warning",
        )
    elif args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
