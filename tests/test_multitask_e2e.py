"""Double texting, black-box (docs/runs.md): the real server, a named client on her
socket and over HTTP (her bearer token) in one conversation (memory="client"), a model
that hangs; ``POST /v1/messages?multitask=`` interrupts, rolls back or is rejected."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from httputil import http_url
from llm.llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import DATA, ServerProcess, subprocess_env

from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client

BOOT = DATA / "multitask-boot.xml"
TOKEN = "alice-multitask-token"
PATIENCE = 30.0


class Model(FakeServer):
    """Hangs on "hang"; otherwise says whether it was told of teal in the conversation."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.bodies: list[str] = []
        self.hanging = trio.Event()

    def default(self, seen: Seen) -> Script:
        said = "\n".join(str(m["content"]) for m in seen.body["messages"][1:])
        self.bodies.append(said)
        last = str(seen.body["messages"][-1]["content"])
        if "hang" in last:
            self.hanging.set()
            return Script(delay=600.0, body=openai_ok("too late").body)
        return openai_ok("teal remembered" if "teal" in said else "nothing of teal")


async def start(env: dict[str, str], cwd: Path) -> ServerProcess:
    return await trio.to_thread.run_sync(
        lambda: ServerProcess.start(BOOT, "--http-port", "0", env=env, cwd=cwd)
    )


def post(url: str, text: str, mode: str) -> httpx.Response:
    body = Task(text=text).to_xml()
    return httpx.post(
        f"{url}/v1/messages",
        params={"to": "assistant", "multitask": mode},
        content=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=PATIENCE,
    )


@pytest.mark.parametrize("mode", ["interrupt", "rollback", "reject"])
async def test_an_http_task_double_texts_her_socket_task(tmp_path, mode: str) -> None:
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        env = subprocess_env(MT_LLM_BASE_URL=model.base_url, MT_LLM_KEY="k", MT_ALICE_TOKEN=TOKEN)
        server = await start(env, tmp_path)
        try:
            url = http_url(server)
            async with open_client(server.host, server.port, client="alice", token=TOKEN) as c:
                first = await c.send(
                    Task(text="hang: my colour is teal"), to="assistant", thread=new_thread_id()
                )
                with trio.fail_after(PATIENCE):
                    await model.hanging.wait()
                answer = await trio.to_thread.run_sync(post, url, "which colour?", mode)
                with trio.fail_after(PATIENCE if mode != "reject" else 2.0):
                    got = await c.receive() if mode != "reject" else None
                if got is not None:
                    assert got.thread == first
                    assert got.payload.get("status") == "failed", got.raw
            text = answer.text
            if mode == "reject":
                assert "busy" in text, text
            else:
                assert answer.status_code == 200, text
                # Her HTTP task continues her socket conversation (interrupt keeps what
                # the stopped Turn saw; rollback drops it).
                expect = "teal remembered" if mode == "interrupt" else "nothing of teal"
                assert expect in text, text
                assert len(model.bodies) == 2
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
