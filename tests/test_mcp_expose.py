"""Our agents and listeners as an MCP server: the SDK's own client calls ``/mcp`` on the
HTTP API (streamable HTTP, the API's authentication) and ``agentserver mcp`` (stdio, a
subprocess relaying to the running server), and gets an agent's answer."""

from __future__ import annotations

import pathlib
import sys

import pytest
import trio
from httputil import http_url
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import ServerProcess, subprocess_env

ASSISTANT = "urn:agentserver:assistant"


def boot(path: pathlib.Path, *, clients: str = "") -> pathlib.Path:
    path.write_text(
        f"""<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="exposed">
  <llm><backend name="scripted" provider="openai" base-url="http://127.0.0.1:1/v1"
       base-url-env="OPENAI_BASE_URL" timeout="30"><model name="m"/></backend></llm>
  <store path="state/agents.sqlite3" url-env="AGENTS_TEST_STORE_URL" watchdog-interval="0.2"
         lease="1" heartbeat="0.25"/>
  {clients}
  <listeners>
    <listener name="calculator" handler="calculator"/>
    <listener name="assistant" handler="assistant" agent="true" timeout="60">
      <description>Answers questions.</description>
      <agent model="m" max-steps="3"/>
    </listener>
  </listeners>
  <expose-mcp listeners="assistant calculator"/>
</organism>"""
    )
    return path


class SlowModel(FakeServer):
    """Answers after a while (so the client sees progress), echoing the question."""

    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        question = str(seen.body["messages"][-1]["content"])
        everything = " ".join(str(m.get("content", "")) for m in seen.body["messages"][1:])
        if "loop" in everything:  # never answers: the Turn fails at max-steps
            return openai_ok(f'<task xmlns="{ASSISTANT}"><text>loop again</text></task>', model="m")
        answer = "Paris" if "capital" in question else "?"
        return openai_ok(f"You asked: {answer}", model="m", delay=2.5)


async def _session_calls(session) -> dict:
    """What the tests check, from one initialized ClientSession."""
    tools = {t.name: t for t in (await session.list_tools()).tools}
    progress: list[float] = []

    async def on_progress(value, total, message):
        progress.append(value)

    answer = await session.call_tool(
        "assistant", {"text": "What is the capital of France?"}, progress_callback=on_progress
    )
    failed = await session.call_tool("assistant", {"text": "loop"})
    add = await session.call_tool("calculator-add", {"a": 2, "b": 40})
    zero = await session.call_tool("calculator-divide", {"a": 1, "b": 0})
    bad = await session.call_tool("calculator-add", {"a": "x", "b": 1})
    return {
        "tools": tools,
        "answer": answer,
        "progress": progress,
        "failed": failed,
        "add": add,
        "zero": zero,
        "bad": bad,
    }


def _check(found: dict) -> None:
    tools = found["tools"]
    assert set(tools) >= {"assistant", "calculator-add", "calculator-divide"}
    assert tools["assistant"].description == "Answers questions."
    assert tools["assistant"].input_schema == {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    }
    assert tools["calculator-add"].input_schema["properties"]["a"] == {"type": "integer"}
    answer = found["answer"]
    assert not answer.is_error, answer
    assert answer.content[0].text == "You asked: Paris"
    # The Turn took a while: the client was told it was working, in order.
    assert found["progress"], "no progress notification"
    assert found["progress"] == sorted(found["progress"])
    # A failed Turn (here: out of steps) is a failed answer: isError.
    assert found["failed"].is_error, found["failed"]
    add = found["add"]
    assert not add.is_error
    assert "<value>42</value>" in add.content[0].text
    assert found["zero"].is_error
    assert "division-by-zero" in found["zero"].content[0].text
    assert found["bad"].is_error  # refused by the payload's schema: a <huh>


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def store_env(request) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"AGENTS_TEST_STORE_URL": request.getfixturevalue("pg_url")}


@pytest.fixture
async def running(tmp_path, nursery, store_env):
    model = await SlowModel().start(nursery)
    env = subprocess_env(
        OPENAI_BASE_URL=model.base_url,
        OPENAI_API_KEY="k",
        MCP_TOKEN="s3cret",
        NARROW_TOKEN="n",
        **store_env,
    )
    path = boot(
        tmp_path / "boot.xml",
        clients='<clients><client name="claude" token-env="MCP_TOKEN"/>'
        '<client name="narrow" token-env="NARROW_TOKEN" may-address="calculator"/></clients>',
    )
    server = await trio.to_thread.run_sync(
        lambda: ServerProcess.start(path, "--http-port", "0", env=env, cwd=tmp_path, timeout=40)
    )
    try:
        yield server, path, env
    finally:
        await trio.to_thread.run_sync(server.stop)


@pytest.mark.parametrize("revision", ["2025-11-25", "2026-07-28"])
async def test_the_sdk_client_calls_agents_and_listeners_at_slash_mcp(running, revision):
    """The SDK's client at either revision: the handshake of 2025-11-25 (``initialize``,
    a session) or 2026-07-28 (stateless, each request carrying its revision)."""
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    mode = "legacy" if revision == "2025-11-25" else revision

    server, _, _ = running
    url = http_url(server) + "/mcp"
    # Without the token: refused by the HTTP API's authentication.
    async with create_mcp_http_client() as http:
        response = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert response.status_code == 401
    headers = {"Authorization": "Bearer s3cret"}
    async with (
        create_mcp_http_client(headers=headers) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode) as session,
    ):
        assert session.protocol_version == revision
        with trio.fail_after(60):
            _check(await _session_calls(session))
    # A client's may-address bounds what it sees and calls.
    async with (
        create_mcp_http_client(headers={"Authorization": "Bearer n"}) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode) as session,
    ):
        assert session.protocol_version == revision
        names = {t.name for t in (await session.list_tools()).tools}
        assert names and all(n.startswith("calculator-") for n in names), names
        refused = await session.call_tool("assistant", {"text": "hi"})
        assert refused.is_error
        assert refused.content[0].text == "unknown tool 'assistant'"
    # A page that made its own name resolve to 127.0.0.1 (DNS rebinding) is refused.
    async with create_mcp_http_client(headers=headers) as http:
        response = await http.post(
            url,
            json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
            headers={"Host": "evil.example:80", "Accept": "application/json, text/event-stream"},
        )
        assert response.status_code == 421, response.status_code
        assert response.text == "Invalid Host header"


@pytest.mark.parametrize("revision", ["2025-11-25", "2026-07-28"])
async def test_the_sdk_client_calls_agentserver_mcp_over_stdio(running, revision):
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters, stdio_client

    server, path, env = running
    params = StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "agentserver",
            "mcp",
            str(path),
            "--connect",
            f"{server.host}:{server.port}",
            "--client",
            "claude",
        ],
        env={"AGENTSERVER_TOKEN": "s3cret", "PYTHONPATH": env["PYTHONPATH"]},
    )
    mode = "legacy" if revision == "2025-11-25" else "auto"
    with trio.fail_after(60):
        async with Client(stdio_client(params), mode=mode) as session:
            assert session.protocol_version == revision
            _check(await _session_calls(session))
