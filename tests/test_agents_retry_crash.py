"""SIGKILL during a step's retry wait (issue 12): the restarted server resumes the wait
(the same due time, not at once and not from the start) and gives exactly one answer.

The real server runs tests/data/agents-retry-boot.xml; its model is a scripted
OpenAI-compatible server in this test's trio run, which answers 503 once, then normally.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import trio
from llm_fakes import FakeServer, Seen, openai_error, openai_ok, openai_stream
from serverproc import DATA, ServerProcess, subprocess_env

from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client

BOOT = DATA / "agents-retry-boot.xml"
TOKEN = "alice-retry-token"
PATIENCE = 20.0


def rows(path: Path, sql: str) -> list[tuple]:
    if not path.exists():
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


async def start_server(env: dict[str, str], cwd: Path) -> ServerProcess:
    return await trio.to_thread.run_sync(lambda: ServerProcess.start(BOOT, env=env, cwd=cwd))


async def test_sigkill_during_a_retry_wait_resumes_it_and_answers_once(tmp_path):
    db = tmp_path / "state" / "agents.sqlite3"
    arrivals: list[float] = []
    servers: list[ServerProcess] = []

    def first_call(seen: Seen):
        arrivals.append(time.time())
        return openai_error(503, "overloaded, try later", type="server_error")

    class Model(FakeServer):
        def default(self, seen: Seen):
            arrivals.append(time.time())
            if seen.body.get("stream"):
                return openai_stream(["Hello ", "again."], model="m")
            return openai_ok("Hello again.", model="m")

    async with trio.open_nursery() as nursery:
        model = await Model("openai").push(first_call).start(nursery)
        env = subprocess_env(
            CRETRY_LLM_BASE_URL=model.base_url,
            CRETRY_LLM_KEY="k",
            CRETRY_ALICE_TOKEN=TOKEN,
        )
        try:
            first = await start_server(env, tmp_path)
            servers.append(first)
            async with open_client(first.host, first.port, client="alice", token=TOKEN) as c:
                thread = await c.send(Task(text="hello"), to="assistant", thread=new_thread_id())
                with trio.fail_after(PATIENCE):
                    # Another process writes the store: no event to wait on, so poll it.
                    while True:
                        if rows(db, "SELECT 1 FROM agent_steps WHERE status = 'retrying'"):
                            break
                        await trio.sleep(0.05)
                [(due,)] = rows(
                    db,
                    "SELECT next_retry_at FROM agent_inbox "
                    "WHERE message_type = 'resume' AND status = 'pending'",
                )
                await trio.to_thread.run_sync(first.proc.kill)
                assert await trio.to_thread.run_sync(first.wait_exit, 10) < 0
            assert len(arrivals) == 1

            second = await start_server(env, tmp_path)
            servers.append(second)
            async with open_client(second.host, second.port, client="alice", token=TOKEN) as c:
                with trio.fail_after(PATIENCE):
                    reply = await c.receive()
                assert reply.thread == thread
                assert reply.payload.get("status") is None  # not a failed answer
                assert "".join(reply.payload.itertext()) == "Hello again."
                with trio.move_on_after(1.0) as quiet:
                    extra = await c.receive()
                assert quiet.cancelled_caught, f"an extra reply arrived: {extra.raw!r}"
            # The wait went on across the restart: the retried call came at its due time.
            assert len(arrivals) == 2 and arrivals[1] >= due - 0.05
            assert rows(db, "SELECT status FROM agent_steps ORDER BY started_at") == [
                ("retrying",),
                ("completed",),
            ]
            deliverables = rows(
                db, "SELECT count(*) FROM cards WHERE card_type = 'task.deliverable'"
            )
            assert deliverables == [(1,)]
        finally:
            for s in servers:
                await trio.to_thread.run_sync(s.stop)
            nursery.cancel_scope.cancel()
