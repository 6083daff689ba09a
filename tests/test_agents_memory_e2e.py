"""Memory across tasks, black-box (issue 12): the real server with memory="client", two
named clients, a scripted OpenAI-compatible model; the conversation survives a restart."""

from __future__ import annotations

from pathlib import Path

import trio
from llm_fakes import FakeServer, Seen, openai_ok, openai_stream
from serverproc import DATA, ServerProcess, subprocess_env

from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client

BOOT = DATA / "agents-memory-boot.xml"
TOKENS = {"alice": "alice-mem-token", "bob": "bob-mem-token"}
PATIENCE = 20.0


class Model(FakeServer):
    """Says the name it was told in the conversation, if any."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.bodies: list[str] = []

    def default(self, seen: Seen):
        said = "\n".join(str(m["content"]) for m in seen.body["messages"][1:])
        self.bodies.append(said)
        text = "You are Ada." if "my name is Ada" in said else "I do not know."
        if seen.body.get("stream"):
            return openai_stream([text], model="m")
        return openai_ok(text, model="m")


#: Threads already answered: a named client's earlier answer may be handed over again at
#: her next hello when her last connection closed before it was acknowledged.
ANSWERED: set[str] = set()


async def ask(server: ServerProcess, who: str, text: str) -> str:
    async with open_client(server.host, server.port, client=who, token=TOKENS[who]) as c:
        thread = await c.send(Task(text=text), to="assistant", thread=new_thread_id())
        with trio.fail_after(PATIENCE):
            reply = await c.receive()
            while reply.thread != thread:
                assert reply.thread in ANSWERED, reply.raw
                reply = await c.receive()
        ANSWERED.add(thread)
        return "".join(reply.payload.itertext())


async def start(env: dict[str, str], cwd: Path) -> ServerProcess:
    return await trio.to_thread.run_sync(lambda: ServerProcess.start(BOOT, env=env, cwd=cwd))


async def test_alice_is_remembered_bob_is_not_across_a_restart(tmp_path):
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        env = subprocess_env(
            MEM_LLM_BASE_URL=model.base_url,
            MEM_LLM_KEY="k",
            MEM_ALICE_TOKEN=TOKENS["alice"],
            MEM_BOB_TOKEN=TOKENS["bob"],
        )
        servers: list[ServerProcess] = []
        try:
            first = await start(env, tmp_path)
            servers.append(first)
            assert await ask(first, "alice", "my name is Ada") == "You are Ada."
            assert await ask(first, "alice", "what is my name?") == "You are Ada."
            assert "my name is Ada" in model.bodies[1]
            assert await ask(first, "bob", "what is my name?") == "I do not know."
            assert "my name is Ada" not in model.bodies[2]
            await trio.to_thread.run_sync(first.stop)

            second = await start(env, tmp_path)
            servers.append(second)
            assert await ask(second, "alice", "and now?") == "You are Ada."
            assert "what is my name?" in model.bodies[3]
            assert await ask(second, "bob", "and now?") == "I do not know."
            assert "my name is Ada" not in model.bodies[4]
        finally:
            for s in servers:
                await trio.to_thread.run_sync(s.stop)
            nursery.cancel_scope.cancel()
