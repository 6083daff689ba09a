"""An A2A agent built with the official SDK's own server pieces (``DefaultRequestHandler``,
an ``AgentExecutor``, the in-memory task store, the SDK's Starlette routes), served by
Hypercorn on asyncio in its own process: the remote of tests/test_a2a_remote.py.

    python tests/a2a_sdk_server.py PORT CANCELS_FILE [--no-streaming] [--tls CERT KEY CA]
        [--starts FILE]

``--tls``: HTTPS with CERT and KEY, asking every client for a certificate issued by CA
(mutual TLS).

Skills ``echo`` and ``ask``; by the task's text: ``fail`` fails ("remote broke"),
``ask`` asks "What color?" (input-required) and a follow-up on the task completes with
"Color noted: TEXT"; ``slow`` works for 60 s (cancel appends the task id to
CANCELS_FILE); ``pause`` (or ``pause N``) works for 4 s (N s), then completes as
anything else does: with the artifact "remote says: TEXT". ``--starts``: the task's id is appended to FILE at
each execution (how many remote tasks a call made).
"""

from __future__ import annotations

import asyncio
import re
import sys

from a2a.helpers.proto_helpers import new_task_from_user_message
from a2a.server.agent_execution.agent_executor import AgentExecutor
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes.agent_card_routes import create_agent_card_routes
from a2a.server.routes.jsonrpc_routes import create_jsonrpc_routes
from a2a.server.tasks.inmemory_task_store import InMemoryTaskStore
from a2a.server.tasks.task_updater import TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Part,
    TaskState,
)
from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette


def pause_of(text: str) -> float:
    """``pause N``: N seconds; a bare ``pause``: 4."""
    found = re.search(r"pause (\d+)", text)
    return float(found.group(1)) if found else 4.0


class Executor(AgentExecutor):
    def __init__(self, cancels: str, starts: str | None) -> None:
        self.cancels = cancels
        self.starts = starts

    async def execute(self, context, event_queue) -> None:
        task = context.current_task
        text = context.get_user_input()
        if task is None:
            task = new_task_from_user_message(context.message)
            await event_queue.enqueue_event(task)
        if self.starts:
            await asyncio.to_thread(self.record, task.id, self.starts)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        if task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED:
            await updater.add_artifact([Part(text=f"Color noted: {text}")])
            await updater.complete()
            return
        await updater.start_work()
        if "fail" in text:
            await updater.failed(updater.new_agent_message([Part(text="remote broke")]))
        elif "ask" in text:
            await updater.requires_input(updater.new_agent_message([Part(text="What color?")]))
        elif "slow" in text:
            await asyncio.sleep(60)
            await updater.complete()
        else:
            if "pause" in text:
                await asyncio.sleep(pause_of(text))
            await updater.add_artifact([Part(text=f"remote says: {text}")])
            await updater.complete()

    def record(self, task_id: str, path: str = "") -> None:
        with open(path or self.cancels, "a") as out:
            out.write(f"{task_id}\n")

    async def cancel(self, context, event_queue) -> None:
        await asyncio.to_thread(self.record, context.task_id)
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.cancel()


def main() -> None:
    port, cancels = int(sys.argv[1]), sys.argv[2]
    streaming = "--no-streaming" not in sys.argv
    tls = sys.argv[sys.argv.index("--tls") + 1 :][:3] if "--tls" in sys.argv else None
    starts = sys.argv[sys.argv.index("--starts") + 1] if "--starts" in sys.argv else None
    scheme = "https" if tls else "http"
    card = AgentCard(
        name="remote",
        description="An agent of the SDK's own.",
        version="1.0",
        supported_interfaces=[
            AgentInterface(
                url=f"{scheme}://127.0.0.1:{port}/",
                protocol_binding="JSONRPC",
                protocol_version="1.0",
            )
        ],
        capabilities=AgentCapabilities(streaming=streaming),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[
            AgentSkill(id="echo", name="echo", description="Says it back.", tags=["echo"]),
            AgentSkill(id="ask", name="ask", description="Asks a question.", tags=["ask"]),
        ],
    )
    handler = DefaultRequestHandler(
        agent_executor=Executor(cancels, starts), task_store=InMemoryTaskStore(), agent_card=card
    )
    app = Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, "/")])
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    if tls:
        import ssl

        config.certfile, config.keyfile, config.ca_certs = tls
        config.verify_mode = ssl.CERT_REQUIRED
    print(f"remote listening on {port}", flush=True)
    asyncio.run(serve(app, config))


if __name__ == "__main__":
    main()
