"""An agent offered as an MCP tool on its durable Turn (docs/mcp.md, "Tasks and
approvals"), proven with the official SDK's client (this test's process) against our
real server (a subprocess) at ``/mcp``, on SQLite and PostgreSQL: the 2026-07-28 Tasks
extension (a task handle that is the Turn's thread; ``tasks/get`` after the server was
killed and started again; a pending approval as ``input_required`` answered with
``tasks/update``; ``tasks/cancel`` stopping the Turn), and in a plain call a pending
approval as an ``InputRequiredResult`` the client's retry answers (by hand, and by the
SDK's own driver with an elicitation callback), after a restart too. The model is a scripted
OpenAI-compatible server on loopback."""

from __future__ import annotations

import contextlib
import pathlib
import re
import signal

import pytest
import trio
from httputil import http_url
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import ServerProcess, subprocess_env

from agentserver.http.mcp_tasks import POLL_MAX

ASSISTANT = "urn:agentserver:assistant"
CALC = "urn:agentserver:calculator"
TOKEN, OTHER = "s3cret", "other-token"
PATIENCE = 40.0


def boot(path: pathlib.Path) -> pathlib.Path:
    path.write_text(
        """<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="mcp-tasks">
  <limits hello-timeout="2" read-timeout="2" drain-timeout="1" write-timeout="2"/>
  <http wait-timeout="30"/>
  <clients>
    <client name="claude" token-env="MCP_TOKEN"/>
    <client name="other" token-env="OTHER_TOKEN"/>
  </clients>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="http://127.0.0.1:9/v1"
             base-url-env="OPENAI_BASE_URL" api-key-env="OPENAI_API_KEY" timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  <store path="state/agents.sqlite3" url-env="AGENTS_TEST_STORE_URL" watchdog-interval="0.2"
         lease="1" heartbeat="0.25"/>
  <listeners>
    <listener name="calculator" handler="calculator"/>
    <listener name="assistant" handler="assistant" agent="true" peers="calculator" timeout="120">
      <description>Answers questions; adds numbers with the caller's approval.</description>
      <agent model="m" max-steps="4"/>
      <policy default="allow">
        <rule priority="1" id="sums" decision="require-approval" target="calculator"
              approver="claude" timeout="10m"/>
      </policy>
    </listener>
  </listeners>
  <expose-mcp listeners="assistant"/>
</organism>"""
    )
    return path


class Model(FakeServer):
    """``slow``: answers after 3 s. ``forever``: answers after 60 s. ``add``: asks the
    calculator (an approval first), then answers the sum, or that it was refused.
    Anything else: "You asked: ..."."""

    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        messages = seen.body["messages"]
        question = str(messages[-1]["content"])
        everything = "\n".join(str(m.get("content", "")) for m in messages[1:])
        if "forever" in everything:
            return openai_ok("too late", model="m", delay=60.0)
        if "slow" in question:
            return openai_ok("slow done", model="m", delay=3.0)
        if "add" in everything:
            sums = re.findall(r"<value>(-?\d+)</value>", everything)
            if sums:
                return openai_ok(f"The sum is {sums[-1]}.", model="m")
            if "denied" in everything or "refused" in everything or "reject" in everything:
                return openai_ok("I was not allowed to add.", model="m")
            return openai_ok(f'<add xmlns="{CALC}"><a>2</a><b>3</b></add>', model="m")
        text = re.sub(r"<[^>]+>", "", question).strip()
        return openai_ok(f"You asked: {text}", model="m")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def store_env(request) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"AGENTS_TEST_STORE_URL": request.getfixturevalue("pg_url")}


class Deployment:
    """Our server as a subprocess, started (and started again) on one state folder."""

    def __init__(self, tmp_path: pathlib.Path, env: dict[str, str]) -> None:
        self.path = boot(tmp_path / "boot.xml")
        self.cwd = tmp_path
        self.env = env
        self.server: ServerProcess | None = None

    async def start(self) -> str:
        self.server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(
                self.path, "--http-port", "0", env=self.env, cwd=self.cwd, timeout=40
            )
        )
        return http_url(self.server) + "/mcp"

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            await trio.to_thread.run_sync(lambda: server.stop(sig))
            # (shown when a test fails)
            print(server.stderr)


@pytest.fixture
async def deployment(tmp_path, nursery, store_env):
    model = await Model().start(nursery)
    env = subprocess_env(
        OPENAI_BASE_URL=model.base_url,
        OPENAI_API_KEY="k",
        MCP_TOKEN=TOKEN,
        OTHER_TOKEN=OTHER,
        **store_env,
    )
    found = Deployment(tmp_path, env)
    try:
        yield found
    finally:
        await found.stop()


@contextlib.asynccontextmanager
async def connect(url: str, token: str = TOKEN, **options):
    """The SDK's client at 2026-07-28 (unless ``mode`` says otherwise)."""
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    options.setdefault("mode", "2026-07-28")
    async with (
        create_mcp_http_client(headers={"Authorization": f"Bearer {token}"}) as http,
        Client(streamable_http_client(url, http_client=http), **options) as client,
    ):
        yield client


def tasks_client(url: str, token: str = TOKEN):
    from agentserver.remote.mcp_tasks import TasksExtension

    return connect(url, token, mode="auto", extensions=[TasksExtension()])


async def call_raw(client, text: str, **options):
    """``tools/call`` on the assistant, its raw answer (a task handle, an
    InputRequiredResult or a CallToolResult)."""
    return await client.session.call_tool(
        "assistant",
        {"text": text},
        allow_input_required=True,
        allow_claimed=True,
        **options,
    )


async def status_until(client, task_id: str, wanted: str):
    from agentserver.remote.mcp_tasks import get_task

    with trio.fail_after(PATIENCE):
        while True:
            task = await get_task(client.session, task_id)
            if task.status == wanted:
                return task
            assert task.status in ("working", "input_required"), task
            await trio.sleep(0.1)


def grant(yes: bool = True, reason: str = "fine"):
    import mcp_types as types

    return types.ElicitResult(action="accept", content={"grant": yes, "reason": reason})


async def test_a_task_survives_a_restart_asks_for_approval_and_is_cancelled(deployment):
    from mcp import MCPError

    from agentserver.remote.mcp_tasks import (
        TASKS,
        CreateTaskResult,
        cancel_task,
        get_task,
        update_task,
    )

    url = await deployment.start()
    async with tasks_client(url) as client:
        # The extension is advertised by server/discover (the client's automatic mode).
        assert client.protocol_version == "2026-07-28"
        assert client.server_capabilities.extensions == {TASKS: {}}
        handle = await call_raw(client, "slow question")
        assert isinstance(handle, CreateTaskResult), handle
        assert handle.status == "working"
        task_id = handle.task_id
        # Known to the store before the handle was answered.
        assert (await get_task(client.session, task_id)).status == "working"
    # Killed with the Turn running; started again on the same store.
    await deployment.stop(signal.SIGKILL)
    url = await deployment.start()
    async with tasks_client(url) as client:
        done = await status_until(client, task_id, "completed")
        assert done.result["content"][0]["text"] == "slow done", done
        assert not done.result.get("isError")
        # Another client may not see it; an unknown id is an error, as the extension says.
        async with tasks_client(url, OTHER) as other:
            with pytest.raises(MCPError) as hidden:
                await get_task(other.session, task_id)
            assert hidden.value.code == -32602
        # A client that did not declare the extension is told what it lacks.
        async with connect(url) as plain:
            with pytest.raises(MCPError) as lacking:
                await get_task(plain.session, task_id)
            assert lacking.value.code == -32021

        # A pending approval of the Turn: input_required, answered with tasks/update.
        handle = await call_raw(client, "add 2 and 3")
        asking = await status_until(client, handle.task_id, "input_required")
        ((key, request),) = asking.input_requests.items()
        assert request["method"] == "elicitation/create"
        assert "approve a call to calculator" in request["params"]["message"]
        assert request["params"]["requestedSchema"]["required"] == ["grant"]
        # Only outstanding keys count: another key is ignored.
        await update_task(client.session, handle.task_id, {"nope": grant()})
        assert (await get_task(client.session, handle.task_id)).status == "input_required"
        await update_task(client.session, handle.task_id, {key: grant()})
        done = await status_until(client, handle.task_id, "completed")
        assert done.result["content"][0]["text"] == "The sum is 5.", done

        # Refused: the answer decides it the other way.
        handle = await call_raw(client, "add 2 and 3 again")
        asking = await status_until(client, handle.task_id, "input_required")
        (key,) = asking.input_requests
        await update_task(client.session, handle.task_id, {key: grant(False, "not today")})
        done = await status_until(client, handle.task_id, "completed")
        assert done.result["content"][0]["text"] == "I was not allowed to add.", done

        # Cancelling the task stops the Turn.
        handle = await call_raw(client, "forever")
        await status_until(client, handle.task_id, "working")
        await cancel_task(client.session, handle.task_id)
        await status_until(client, handle.task_id, "cancelled")


async def test_a_plain_call_asks_for_approval_with_input_required(deployment):
    import mcp_types as types

    url = await deployment.start()
    async with connect(url) as client:
        first = await call_raw(client, "add 2 and 3")
        assert isinstance(first, types.InputRequiredResult), first
        ((key, request),) = first.input_requests.items()
        assert isinstance(request, types.ElicitRequest)
        assert "approve a call to calculator" in request.params.message
    # The state is the durable Turn's: the retry may reach the server after a kill and a
    # restart (on the same store).
    await deployment.stop(signal.SIGKILL)
    url = await deployment.start()
    async with connect(url) as client:
        # The client's retry carries the answer and the state; the answer decides it.
        with trio.fail_after(PATIENCE):
            done = await client.session.call_tool(
                "assistant",
                {"text": "add 2 and 3"},
                input_responses={key: grant()},
                request_state=first.request_state,
                allow_input_required=True,
            )
        assert isinstance(done, types.CallToolResult), done
        assert done.content[0].text == "The sum is 5."
        # Another client cannot continue it.
        async with connect(url, OTHER) as other:
            stolen = await other.session.call_tool(
                "assistant",
                {"text": "add"},
                input_responses={key: grant()},
                request_state=first.request_state,
                allow_input_required=True,
            )
            assert stolen.is_error
            assert "requestState names no task" in stolen.content[0].text

    # The SDK's own driver: its elicitation callback answers, it retries.
    asked: list[str] = []

    async def refuse(context, params):
        asked.append(params.message)
        return types.ElicitResult(action="decline")

    async with connect(url, elicitation_callback=refuse) as client:
        with trio.fail_after(PATIENCE):
            done = await client.call_tool("assistant", {"text": "add 2 and 3 please"})
    assert done.content[0].text == "I was not allowed to add.", done
    assert len(asked) == 1 and "calculator" in asked[0]


@pytest.mark.postgresql
async def test_two_processes_on_postgresql_answer_for_each_others_tasks(tmp_path, nursery, pg_url):
    """A task sent to one process is read, answered and cancelled through another on the
    same PostgreSQL store: the task is the durable Turn, not the request."""
    from agentserver.remote.mcp_tasks import cancel_task, update_task

    model = await Model().start(nursery)
    env = subprocess_env(
        OPENAI_BASE_URL=model.base_url,
        OPENAI_API_KEY="k",
        MCP_TOKEN=TOKEN,
        OTHER_TOKEN=OTHER,
        AGENTS_TEST_STORE_URL=pg_url,
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = Deployment(tmp_path / "a", env), Deployment(tmp_path / "b", env)
    try:
        url_a, url_b = await first.start(), await second.start()
        async with tasks_client(url_a) as a, tasks_client(url_b) as b:
            handle = await call_raw(a, "add 2 and 3")
            asking = await status_until(b, handle.task_id, "input_required")
            (key,) = asking.input_requests
            await update_task(b.session, handle.task_id, {key: grant()})
            done = await status_until(a, handle.task_id, "completed")
            assert done.result["content"][0]["text"] == "The sum is 5.", done
            handle = await call_raw(b, "forever")
            await status_until(a, handle.task_id, "working")
            await cancel_task(a.session, handle.task_id)
            await status_until(b, handle.task_id, "cancelled")
    finally:
        await first.stop()
        await second.stop()


async def test_at_2025_11_25_a_call_waits_while_the_approver_decides_elsewhere(deployment):
    """No ``input_required`` at 2025-11-25: the call waits for the answer while the
    approval's approver decides it at another door (here its socket connection)."""
    import mcp_types as types

    from agentserver.net.client import approval_ack_status, approval_request, open_client
    from agentserver.primitives.approval import ApprovalDecision

    url = await deployment.start()
    server = deployment.server
    results: list = []
    async with (
        open_client(server.host, server.port, client="claude", token=TOKEN) as approver,
        connect(url, mode="legacy") as client,
    ):
        assert client.protocol_version == "2025-11-25"

        async def call() -> None:
            results.append(
                await client.session.call_tool(
                    "assistant", {"text": "add 2 and 3"}, allow_input_required=True
                )
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            with trio.fail_after(PATIENCE):
                request = None
                while request is None:
                    request = approval_request(await approver.receive())
            # Long enough for the waiting call to have read the pending approval (it
            # polls at least every POLL_MAX): it must wait on, not answer input_required.
            await trio.sleep(2 * POLL_MAX + 0.5)
            assert not results  # still waiting
            decision = ApprovalDecision(request=request["request"], grant=True, reason="ok")
            ack = await approver.request(decision, to=request["agent"], timeout=PATIENCE)
            assert approval_ack_status(ack) == "applied"
    (done,) = results
    assert isinstance(done, types.CallToolResult), done
    assert done.content[0].text == "The sum is 5."
