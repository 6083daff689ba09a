"""The context budget through the real server (issue 12): a 32k-window model (declared on
``<model context-window>``) and a tool whose results are 400 KB each. The scripted model
counts what it receives as the issue says a provider would: characters / 4 over the
messages, plus the requested output; no request may exceed the window. The task fetches
three pages (each shown capped at a quarter of the window), so the Turn must compact
before its last step: a summary card exists, and the answer arrives."""

from __future__ import annotations

import sqlite3

import trio
from agents_budget_support import TOOL_NS
from llm_fakes import FakeServer, Seen, openai_ok, openai_stream
from serverproc import DATA, ServerProcess, subprocess_env

from agentserver.agents.turn.compaction import SUMMARY_SYSTEM
from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client

BOOT = DATA / "agents-budget-boot.xml"
TOKEN = "alice-budget-token"
WINDOW = 32_000
PATIENCE = 30.0


class Model(FakeServer):
    def __init__(self) -> None:
        super().__init__("openai")
        self.sizes: list[int] = []
        self.summaries = 0

    def default(self, seen: Seen):
        messages = seen.body["messages"]
        chars = sum(len(str(m["content"])) for m in messages)
        self.sizes.append(chars // 4 + int(seen.body.get("max_tokens") or 0))
        if messages[0]["content"] == SUMMARY_SYSTEM:
            self.summaries += 1
            text = f"SUMMARY {self.summaries}: pages were fetched."
        else:
            said = "\n".join(str(m["content"]) for m in messages[1:])
            pages = said.count("page ") - said.count("<page>")
            if "SUMMARY" in said or pages >= 3:
                text = "I have read the pages."
            else:
                text = f'Next page. <fetch xmlns="{TOOL_NS}"><page>{pages + 1}</page></fetch>'
        if seen.body.get("stream"):
            return openai_stream([text], model="m")
        return openai_ok(text, model="m")


async def test_huge_tool_results_never_push_a_request_over_the_window(tmp_path):
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        env = subprocess_env(
            BUDGET_LLM_BASE_URL=model.base_url, BUDGET_LLM_KEY="k", BUDGET_ALICE_TOKEN=TOKEN
        )
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(BOOT, env=env, cwd=tmp_path)
        )
        try:
            async with open_client(server.host, server.port, client="alice", token=TOKEN) as c:
                await c.send(Task(text="read three pages"), to="assistant", thread=new_thread_id())
                with trio.fail_after(PATIENCE):
                    reply = await c.receive()
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
    assert reply.payload.get("status") is None, reply.raw
    assert "".join(reply.payload.itertext()) == "I have read the pages."
    assert model.sizes and max(model.sizes) <= WINDOW, model.sizes
    assert model.summaries >= 1
    db = sqlite3.connect(tmp_path / "state" / "agents.sqlite3")
    try:
        kinds = dict(db.execute("SELECT card_type, count(*) FROM cards GROUP BY card_type"))
        longest = db.execute(
            "SELECT max(length(content)) FROM cards WHERE card_type = 'tool.result'"
        ).fetchone()[0]
    finally:
        db.close()
    assert kinds.get("sys.summary", 0) >= 1
    assert longest > 400_000  # the store keeps each result whole
