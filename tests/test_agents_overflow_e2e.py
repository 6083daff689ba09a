"""A provider's context overflow, black-box (issue 12): the real server, one backend, a
scripted OpenAI-compatible model that answers ``context_length_exceeded``. Once: the Turn
compacts and the retried call succeeds. Twice: one failed answer, and no third call."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from llm_fakes import FakeServer, Seen, openai_error, openai_ok, openai_stream
from serverproc import DATA, ServerProcess, subprocess_env

from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client

BOOT = DATA / "agents-retry-boot.xml"
TOKEN = "alice-overflow-token"
PATIENCE = 20.0


def too_long(seen: Seen):
    return openai_error(
        400,
        "This model's maximum context length is 8192 tokens. However, your messages "
        "resulted in 9000 tokens.",
        code="context_length_exceeded",
    )


class Model(FakeServer):
    def default(self, seen: Seen):
        if seen.body.get("stream"):
            return openai_stream(["It fits now."], model="m")
        return openai_ok("It fits now.", model="m")


async def run_task(tmp_path: Path, overflows: int) -> tuple[str, str | None, int]:
    async with trio.open_nursery() as nursery:
        model = await Model("openai").push(*[too_long] * overflows).start(nursery)
        env = subprocess_env(
            CRETRY_LLM_BASE_URL=model.base_url, CRETRY_LLM_KEY="k", CRETRY_ALICE_TOKEN=TOKEN
        )
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(BOOT, env=env, cwd=tmp_path)
        )
        try:
            async with open_client(server.host, server.port, client="alice", token=TOKEN) as c:
                thread = await c.send(Task(text="hello"), to="assistant", thread=new_thread_id())
                with trio.fail_after(PATIENCE):
                    reply = await c.receive()
                assert reply.thread == thread
                with trio.move_on_after(1.0) as quiet:
                    extra = await c.receive()
                assert quiet.cancelled_caught, f"an extra reply arrived: {extra.raw!r}"
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
    text = "".join(reply.payload.itertext())
    return text, reply.payload.get("status"), len(model.requests)


@pytest.mark.parametrize("overflows", [1, 2])
async def test_context_overflow_compacts_once_then_fails(tmp_path, overflows):
    text, status, calls = await run_task(tmp_path, overflows)
    if overflows == 1:
        assert (text, status) == ("It fits now.", None)
        assert calls == 2  # nothing to fold in a one-card task: no summary call
    else:
        assert status == "failed" and "context window" in text
        assert calls == 2


async def test_an_auth_failure_is_one_model_call_and_one_failed_answer(tmp_path):
    async with trio.open_nursery() as nursery:
        model = (
            await Model("openai")
            .push(openai_error(401, "Incorrect API key provided", type="invalid_request_error"))
            .start(nursery)
        )
        env = subprocess_env(
            CRETRY_LLM_BASE_URL=model.base_url, CRETRY_LLM_KEY="k", CRETRY_ALICE_TOKEN=TOKEN
        )
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(BOOT, env=env, cwd=tmp_path)
        )
        try:
            async with open_client(server.host, server.port, client="alice", token=TOKEN) as c:
                await c.send(Task(text="hello"), to="assistant", thread=new_thread_id())
                with trio.fail_after(PATIENCE):
                    reply = await c.receive()
                with trio.move_on_after(1.0) as quiet:
                    extra = await c.receive()
                assert quiet.cancelled_caught, f"an extra reply arrived: {extra.raw!r}"
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
    assert reply.payload.get("status") == "failed"
    assert "AUTH" in "".join(reply.payload.itertext())
    assert len(model.requests) == 1
