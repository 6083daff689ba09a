"""The HTTP API with a running agent: Server-Sent Events carry the chunks of a streamed
answer in order (filtered by agent and thread), and the agent views show the task."""

from __future__ import annotations

import json

import httpx
import trio
from conftest import parse_reply
from httputil import http_url
from llm_fakes import FakeServer, openai_stream
from serverproc import REPO, ServerProcess, subprocess_env

from agentserver.core.threads import new_thread_id

ASSISTANT = "urn:agentserver:assistant"
PIECES = ["Hello", " there", ",", " streaming", " world", "."]


async def read_events(
    client: httpx.AsyncClient, params: dict, into: list, opened: trio.Event, done: trio.Event
):
    """Collect (event, data) pairs of one SSE stream until a task event."""
    async with client.stream("GET", "/v1/events", params=params) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        kind = None
        async for line in response.aiter_lines():
            if line.startswith(":"):
                opened.set()
            elif line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                into.append((kind, json.loads(line[len("data: ") :])))
                if kind == "task":
                    done.set()
                    return


async def test_sse_carries_the_chunks_of_a_streamed_answer_in_order(tmp_path):
    async with trio.open_nursery() as nursery:
        model = await FakeServer("openai").start(nursery)
        model.push(openai_stream(PIECES, model="m", chunk_delay=0.02))
        env = subprocess_env(
            OPENAI_BASE_URL=model.base_url, OPENAI_API_KEY="test-key", AGENTSERVER_MODEL="m"
        )
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(
                REPO / "boot.xml", "--http-port", "0", env=env, cwd=tmp_path
            )
        )
        try:
            async with httpx.AsyncClient(base_url=http_url(server), timeout=20) as client:
                thread, other = new_thread_id(), new_thread_id()
                mine: list = []
                others: list = []
                opened, other_opened = trio.Event(), trio.Event()
                done, other_done = trio.Event(), trio.Event()
                async with trio.open_nursery() as readers:
                    readers.start_soon(
                        read_events,
                        client,
                        {"agent": "assistant", "thread": thread},
                        mine,
                        opened,
                        done,
                    )
                    readers.start_soon(
                        read_events, client, {"thread": other}, others, other_opened, other_done
                    )
                    with trio.fail_after(10):
                        await opened.wait()
                        await other_opened.wait()
                    task = f'<task xmlns="{ASSISTANT}"><text>Say hello.</text></task>'
                    response = await client.post(
                        "/v1/messages",
                        params={"to": "assistant", "thread": thread},
                        content=task.encode(),
                    )
                    assert response.status_code == 200, response.text
                    meta, answer = parse_reply(response.content)
                    assert meta["from"] == "assistant" and meta["thread"] == thread
                    assert answer.findtext(f"{{{ASSISTANT}}}text") == "".join(PIECES)
                    with trio.fail_after(10):
                        await done.wait()
                    readers.cancel_scope.cancel()
                chunks = [data for kind, data in mine if kind == "chunk"]
                assert [c["text"] for c in chunks] == PIECES
                assert {c["agent_id"] for c in chunks} == {"assistant"}
                turn = chunks[0]["agent_turn_id"]
                assert all(data["agent_turn_id"] == turn for _, data in mine)
                assert mine[-1] == (
                    "task",
                    {**mine[-1][1], "agent_id": "assistant", "status": "succeeded"},
                )
                assert any(kind == "step" for kind, _ in mine)
                # the subscriber of another thread saw none of it
                assert others == []

                agents = (await client.get("/v1/agents")).json()["agents"]
                assert [a["name"] for a in agents] == ["assistant"]
                assert agents[0]["queue"] == 0 and agents[0]["last_error"] is None
                found = (await client.get(f"/v1/agents/assistant/tasks/{thread}")).json()
                assert found["status"] == "succeeded" and found["turn"] == turn
                assert len(found["steps"]) == 1
                assert found["steps"][0]["model"] == "m"
                assert found["usage"]["prompt_tokens"] == 10
                missing = await client.get(f"/v1/agents/assistant/tasks/{other}")
                assert missing.status_code == 404
                ready = (await client.get("/readyz")).json()
                assert ready == {
                    "ready": True,
                    "checks": {"pump": True, "store": True, "llm": True},
                }
        finally:
            code = await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
        assert code == 0, server.stderr
