"""An A2A 0.3 agent: the official SDK at 0.3 (``a2a-sdk==0.3.26``: its
``DefaultRequestHandler``, an ``AgentExecutor``, the in-memory task store, its Starlette
application) served by Hypercorn on asyncio, run by tests/test_a2a_remote.py as a
separate process with the interpreter of the 0.3 virtual environment
(tests/test_a2a_v03.py's ``v03_python``): the remote that speaks only 0.3 (its card is
0.3's: ``url``, ``preferredTransport``, ``protocolVersion`` 0.3; it has no task listing).

    python tests/a2a_v03_server.py PORT CANCELS_FILE [--no-streaming] [--starts FILE]
        [--methods FILE]

The skills and behaviour of tests/a2a_sdk_server.py (``echo``, ``ask``; ``fail``,
``ask``, ``slow``, ``pause [N]`` by the task's text); and ``lag``: the task is made
2.5 s after the execution starts, so the send's answer comes that late. ``--starts``: each execution's task
id appended to FILE; ``--methods``: each JSON-RPC method called appended to FILE (a 0.3
remote is never asked for a method 0.3 lacks).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.apps import A2AStarletteApplication
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentSkill,
    Part,
    TaskState,
    TextPart,
)
from a2a.utils import new_task
from hypercorn.asyncio import serve
from hypercorn.config import Config


def pause_of(text: str) -> float:
    found = re.search(r"pause (\d+)", text)
    return float(found.group(1)) if found else 4.0


def record(path: str, line: str) -> None:
    with open(path, "a") as out:
        out.write(f"{line}\n")


class Executor(AgentExecutor):
    def __init__(self, cancels: str, starts: str | None) -> None:
        self.cancels = cancels
        self.starts = starts

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task = context.current_task
        text = context.get_user_input()
        if task is None:
            task = new_task(context.message)
            if self.starts:
                await asyncio.to_thread(record, self.starts, task.id)
            if "lag" in text:
                await asyncio.sleep(2.5)  # the send's answer (the task) comes late
            await event_queue.enqueue_event(task)
        elif self.starts:
            await asyncio.to_thread(record, self.starts, task.id)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        if task.status.state == TaskState.input_required:
            await updater.add_artifact([Part(root=TextPart(text=f"Color noted: {text}"))])
            await updater.complete()
            return
        await updater.start_work()
        if "fail" in text:
            await updater.failed(
                updater.new_agent_message([Part(root=TextPart(text="remote broke"))])
            )
        elif "ask" in text:
            await updater.requires_input(
                updater.new_agent_message([Part(root=TextPart(text="What color?"))]), final=True
            )
        elif "slow" in text:
            await asyncio.sleep(60)
            await updater.complete()
        else:
            if "pause" in text:
                await asyncio.sleep(pause_of(text))
            await updater.add_artifact([Part(root=TextPart(text=f"remote says: {text}"))])
            await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await asyncio.to_thread(record, self.cancels, context.task_id)
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.cancel()


def methods_recorder(app, path: str):
    """ASGI middleware appending each JSON-RPC request's method to ``path``."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            await asyncio.to_thread(record, path, json.loads(body).get("method", ""))
        except ValueError:
            pass
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await app(scope, replay, send)

    return wrapped


def main() -> None:
    port, cancels = int(sys.argv[1]), sys.argv[2]
    streaming = "--no-streaming" not in sys.argv
    starts = sys.argv[sys.argv.index("--starts") + 1] if "--starts" in sys.argv else None
    methods = sys.argv[sys.argv.index("--methods") + 1] if "--methods" in sys.argv else None
    card = AgentCard(
        name="remote-03",
        description="An agent of the 0.3 SDK's own.",
        version="0.3",
        url=f"http://127.0.0.1:{port}/",
        preferred_transport="JSONRPC",
        protocol_version="0.3.0",
        capabilities=AgentCapabilities(streaming=streaming),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[
            AgentSkill(id="echo", name="echo", description="Says it back.", tags=["echo"]),
            AgentSkill(id="ask", name="ask", description="Asks a question.", tags=["ask"]),
        ],
    )
    handler = DefaultRequestHandler(
        agent_executor=Executor(cancels, starts), task_store=InMemoryTaskStore()
    )
    app = A2AStarletteApplication(agent_card=card, http_handler=handler).build()
    if methods:
        app = methods_recorder(app, methods)
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    print(f"remote (0.3) listening on {port}", flush=True)
    asyncio.run(serve(app, config))


if __name__ == "__main__":
    main()
