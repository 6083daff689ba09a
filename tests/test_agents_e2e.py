"""The bundled assistant end to end: real server, real sockets, a scripted model on loopback.

The server runs the bundled boot.xml with OPENAI_BASE_URL pointing at a fake
OpenAI-compatible server in this test's trio run. The model asks the calculator twice in
parallel, iterates once on the assistant's own root tag, then answers; the client gets
exactly one reply on its thread.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import trio
from llm_fakes import FakeServer, Script, Seen, openai_ok, openai_stream
from serverproc import REPO, ServerProcess, subprocess_env

from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client

CALC = "urn:agentserver:calculator"
ASSISTANT = "urn:agentserver:assistant"


def say(seen: Seen, text: str) -> Script:
    """The text as the model would send it: streamed in word chunks if asked to stream."""
    if seen.body.get("stream"):
        words = text.split(" ")
        return openai_stream([w if i == 0 else " " + w for i, w in enumerate(words)], model="m")
    return openai_ok(text, model="m")


class ScriptedModel(FakeServer):
    """Decides each step from the conversation it is sent, like a model would."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.steps: list[str] = []

    def default(self, seen: Seen) -> Script:
        messages = seen.body["messages"]
        text = "\n".join(str(m.get("content", "")) for m in messages)
        assert messages[0]["role"] == "system"
        if "<value>5</value>" not in text:
            self.steps.append("tools")
            return say(
                seen,
                "I will use the calculator twice at once. "
                f'<add xmlns="{CALC}"><a>2</a><b>3</b></add> '
                f'<multiply xmlns="{CALC}"><a>6</a><b>7</b></multiply>',
            )
        if "double-check" not in text:
            self.steps.append("iterate")
            return say(
                seen,
                f'Let me check once more. <task xmlns="{ASSISTANT}"><text>double-check</text></task>',
            )
        self.steps.append("answer")
        total = re.search(r"<sum [^>]*><value>(-?\d+)</value>", text).group(1)
        product = re.search(r"<product [^>]*><value>(-?\d+)</value>", text).group(1)
        return say(seen, f"2+3 = {total} and 6*7 = {product}.")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def boot_file(request, tmp_path) -> tuple[str | None, pathlib.Path]:
    """The bundled boot.xml, or a copy of it whose ``<store>`` is a PostgreSQL database."""
    if request.param == "sqlite":
        return None, REPO / "boot.xml"
    url = request.getfixturevalue("pg_url")
    text = (REPO / "boot.xml").read_text()
    store = '<store path="state/agents.sqlite3"/>'
    assert store in text
    copy = tmp_path / "boot-pg.xml"
    copy.write_text(text.replace(store, f'<store url-env="E2E_STORE_URL" url="{url}"/>'))
    return url, copy


async def test_assistant_calls_tools_in_parallel_iterates_and_answers_once(tmp_path, boot_file):
    pg_url, boot = boot_file
    async with trio.open_nursery() as nursery:
        model = await ScriptedModel().start(nursery)
        env = subprocess_env(
            OPENAI_BASE_URL=model.base_url, OPENAI_API_KEY="test-key", AGENTSERVER_MODEL="m"
        )
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(boot, env=env, cwd=tmp_path)
        )
        try:
            async with open_client(server.host, server.port) as client:
                thread = new_thread_id()
                await client.send(Task(text="What are 2+3 and 6*7?"), to="assistant", thread=thread)
                with trio.fail_after(20):
                    reply = await client.receive()
                assert reply.thread == thread
                assert reply.from_id == "assistant"
                assert reply.payload.tag == f"{{{ASSISTANT}}}answer"
                assert reply.payload.findtext(f"{{{ASSISTANT}}}text") == "2+3 = 5 and 6*7 = 42."
                assert reply.payload.get("status") is None  # a success carries no status
                # exactly one reply: nothing else arrives on any thread
                with trio.move_on_after(1.0) as quiet:
                    extra = await client.receive()
                assert quiet.cancelled_caught, extra
        finally:
            code = await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
        assert code == 0, server.stderr
    assert model.steps == ["tools", "iterate", "answer"]
    # the two calculator calls went out in the same step, before the model saw any result
    assert len(model.requests) == 3
    # the agent streams its model calls (chunks become events as they arrive)
    assert all(r.body.get("stream") for r in model.requests)
    # the store used is the one configured (no SQLite file beside a PostgreSQL store)
    assert (tmp_path / "state" / "agents.sqlite3").exists() == (pg_url is None)
    if pg_url is not None:
        import psycopg

        with psycopg.connect(pg_url) as db:
            rows = db.execute("SELECT count(*) FROM cards WHERE card_type = 'task.deliverable'")
            assert rows.fetchall() == [(1,)]


async def test_assistant_without_a_reachable_backend_answers_one_clear_failure(tmp_path):
    env = subprocess_env(
        OPENAI_BASE_URL="http://127.0.0.1:9/v1", OPENAI_API_KEY="k", AGENTSERVER_MODEL="m"
    )
    server = await trio.to_thread.run_sync(
        lambda: ServerProcess.start(REPO / "boot.xml", env=env, cwd=tmp_path)
    )
    try:
        async with open_client(server.host, server.port) as client:
            reply = await client.request(Task(text="hello?"), to="assistant", timeout=60)
            assert reply.payload.tag == f"{{{ASSISTANT}}}answer"
            text = reply.payload.findtext(f"{{{ASSISTANT}}}text")
            assert "could not be reached" in text
            assert reply.payload.get("status") == "failed"
            with trio.move_on_after(0.5) as quiet:
                await client.receive()
            assert quiet.cancelled_caught
    finally:
        assert await trio.to_thread.run_sync(server.stop) == 0


async def test_second_server_on_the_same_store_refuses_to_start(tmp_path):
    import subprocess
    import sys

    env = subprocess_env(OPENAI_API_KEY="k")
    first = await trio.to_thread.run_sync(
        lambda: ServerProcess.start(REPO / "boot.xml", env=env, cwd=tmp_path)
    )
    try:
        second = await trio.to_thread.run_sync(
            lambda: subprocess.run(
                # The same boot.xml as the first: the same store, next to it.
                [
                    sys.executable,
                    "-m",
                    "agentserver",
                    "run",
                    str(tmp_path / "boot.xml"),
                    "--port",
                    "0",
                ],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                timeout=30,
            )
        )
        assert second.returncode == 1
        assert b"in use by another agentserver process" in second.stderr
    finally:
        assert await trio.to_thread.run_sync(first.stop) == 0
