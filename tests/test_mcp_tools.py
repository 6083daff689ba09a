"""MCP servers' tools as listeners, end to end: the real server (a subprocess) with
``<mcp>`` servers written with the SDK (tests/mcp_fs_server.py, over stdio and over
streamable HTTP on loopback), real sockets, a scripted model on loopback."""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest
import trio
from llm_fakes import FakeServer, Script, Seen, openai_ok
from lxml import etree
from serverproc import TESTS, ServerProcess, cli, subprocess_env, wait_until

from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client

SERVER = TESTS / "mcp_fs_server.py"
FS = "urn:agentserver:mcp:fs"
WEB = "urn:agentserver:mcp:web"
SLOW = "urn:agentserver:mcp:slow"
MCP = "urn:agentserver:mcp"
ASSISTANT = "urn:agentserver:assistant"


def stdio_mcp(name: str, marks: pathlib.Path | None = None, extra: str = "", body: str = "") -> str:
    args = str(SERVER) + (f" --marks {marks}" if marks else "")
    return f'<mcp name="{name}" command="{sys.executable}" args="{args}" {extra}>{body}</mcp>'


def boot(path: pathlib.Path, listeners: str, *, llm: bool = False) -> pathlib.Path:
    llm_section = (
        """<llm><backend name="scripted" provider="openai" base-url="http://127.0.0.1:1/v1"
             base-url-env="OPENAI_BASE_URL" timeout="30"><model name="m"/></backend></llm>
           <store path="state/agents.sqlite3"/>"""
        if llm
        else ""
    )
    path.write_text(
        f"""<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="mcp-test">
  {llm_section}
  <listeners>
    {listeners}
  </listeners>
</organism>"""
    )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpMcpServer:
    """tests/mcp_fs_server.py serving streamable HTTP on a loopback port (``only``: a
    server of one revision only, ``modern`` or ``legacy``)."""

    def __init__(self, *, only: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), "--http", str(self.port)]
            + (["--only", only] if only else []),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            except OSError:
                return False
            return True

        if not wait_until(listening, timeout=20):
            self.stop()
            raise RuntimeError("the HTTP MCP server did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def http_mcp():
    server = HttpMcpServer()
    yield server
    server.stop()


@pytest.fixture
def modern_mcp():
    server = HttpMcpServer(only="modern")
    yield server
    server.stop()


@pytest.fixture
def legacy_mcp():
    server = HttpMcpServer(only="legacy")
    yield server
    server.stop()


async def test_mcp_calls_servers_of_either_revision(tmp_path, modern_mcp, legacy_mcp):
    """``<mcp>`` reaches a server that speaks only 2026-07-28 (``server/discover``, no
    ``initialize``) and one that speaks only the handshake era, with the SDK client's
    automatic mode (a server of both, the SDK's over stdio, is met at 2026-07-28)."""
    from mcp import Client, MCPError

    # The modern server really refuses the older handshake (what <mcp> did before).
    with pytest.raises(BaseException) as refused:
        async with Client(modern_mcp.url, mode="legacy"):
            pass
    error = refused.value
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    assert isinstance(error, MCPError) and error.code == -32022, refused.value
    # And the legacy one the newer revision.
    with pytest.raises(BaseException) as refused:
        async with Client(legacy_mcp.url, mode="2026-07-28") as client:
            await client.list_tools()
    error = refused.value
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    assert isinstance(error, MCPError), refused.value
    path = boot(
        tmp_path / "boot.xml",
        f'<mcp name="web" url="{modern_mcp.url}"><tool name="list_dir"/></mcp>'
        f'<mcp name="old" url="{legacy_mcp.url}"/>' + stdio_mcp("fs", body='<tool name="pid"/>'),
    )
    done = cli("check", str(path))
    assert done.returncode == 0, done.stderr
    assert "mcp web: tool 'list_dir' -> listener web-list_dir" in done.stdout.decode()
    server = await trio.to_thread.run_sync(
        lambda: ServerProcess.start(path, cwd=tmp_path, timeout=40, log_level="info")
    )
    try:
        async with open_client(server.host, server.port) as client:
            listed = await _call(
                client,
                f'<list_dir xmlns="{WEB}"><folder>/notes</folder></list_dir>',
                "web-list_dir",
            )
            read = await _call(
                client,
                '<read_file xmlns="urn:agentserver:mcp:old"><path>/notes/todo.txt</path></read_file>',
                "old-read_file",
            )
            pid = await _call(client, f'<pid xmlns="{FS}"/>', "fs-pid")
            # A handshake-era server's tool-list change comes as the session's notification.
            grown = await _call(client, '<grow xmlns="urn:agentserver:mcp:old"/>', "old-grow")
            relisted = await trio.to_thread.run_sync(
                lambda: wait_until(
                    lambda: "MCP server old: tools changed: added ['extra']" in server.stderr,
                    timeout=10,
                )
            )
    finally:
        assert await trio.to_thread.run_sync(server.stop) == 0, server.stderr
    assert listed.payload.get("status") == "ok", listed.payload
    assert json.loads(listed.payload.findtext(f"{{{MCP}}}text"))["files"] == [
        "/notes/ideas.txt",
        "/notes/todo.txt",
    ]
    assert read.payload.findtext(f"{{{MCP}}}text") == "buy milk"
    assert pid.payload.get("status") == "ok"
    assert grown.payload.get("status") == "ok", grown.payload
    assert relisted, server.stderr
    # Each at its own revision: the modern one by discovery, the others by the handshake.
    for name, revision in (("web", "2026-07-28"), ("old", "2025-11-25"), ("fs", "2026-07-28")):
        connected = rf"MCP server {name} connected \(\d+ tools, protocol {revision}\)"
        assert re.search(connected, server.stderr), server.stderr


async def test_a_tool_answered_with_a_task_is_followed_and_cancelled(tmp_path, modern_mcp):
    """A 2026-07-28 server that answers a call with a task handle (the Tasks extension,
    tests/mcp_fs_server.py's, on the SDK's server hooks): ``<mcp>`` declared the extension,
    follows the task with ``tasks/get`` to its result, and cancels it with ``tasks/cancel``
    when the call is past its ``timeout``; over streamable HTTP and over stdio."""
    marks = tmp_path / "marks"
    marks.mkdir()
    path = boot(
        tmp_path / "boot.xml",
        f'<mcp name="web" url="{modern_mcp.url}"><tool name="add_later"/></mcp>'
        + stdio_mcp(
            "fs",
            marks,
            extra='timeout="2"',
            body='<tool name="add_later"/><tool name="stuck"/><tool name="ask_later"/>',
        ),
    )
    server = await trio.to_thread.run_sync(
        lambda: ServerProcess.start(path, cwd=tmp_path, timeout=40, log_level="info")
    )
    try:
        async with open_client(server.host, server.port) as client:
            web = await _call(
                client, f'<add_later xmlns="{WEB}"><a>2</a><b>3</b></add_later>', "web-add_later"
            )
            fs = await _call(
                client, f'<add_later xmlns="{FS}"><a>4</a><b>5</b></add_later>', "fs-add_later"
            )
            stuck = await _call(client, f'<stuck xmlns="{FS}"/>', "fs-stuck")
            # A task waiting for input nobody here answers: waited on (logged), then
            # ended by the call's timeout.
            asked = await _call(client, f'<ask_later xmlns="{FS}"/>', "fs-ask_later")
            cancelled = await trio.to_thread.run_sync(
                lambda: wait_until(lambda: (marks / "task-cancelled").exists(), timeout=10)
            )
    finally:
        assert await trio.to_thread.run_sync(server.stop) == 0, server.stderr
    assert cancelled, server.stderr
    # "later": the task's result, not the tool's synchronous one ("now").
    assert web.payload.findtext(f"{{{MCP}}}text") == "later: 5", web.payload
    assert fs.payload.findtext(f"{{{MCP}}}text") == "later: 9", fs.payload
    assert _is_system_error(stuck.payload, "timeout"), stuck.payload
    assert _is_system_error(asked.payload, "timeout"), asked.payload
    assert "waits for input nobody here answers: ['name']" in server.stderr
    assert "MCP tool add_later: task " in server.stderr


def test_check_prints_the_mapping_and_refuses_collisions(tmp_path):
    good = boot(
        tmp_path / "good.xml",
        stdio_mcp("fs", body='<tool name="read_file"/><tool name="list_dir"/><tool name="find"/>')
        + '<listener name="echo" handler="echo"/>',
    )
    done = cli("check", str(good))
    assert done.returncode == 0, done.stderr
    out = done.stdout.decode()
    assert "mcp fs: tool 'read_file' -> listener fs-read_file" in out
    assert "mcp fs: tool 'list_dir' -> listener fs-list_dir" in out
    # what the JSON Schema mapping could not do is said, tool by tool
    assert "mcp fs: tool 'find' -> listener fs-find (as JSON text: pattern, where)" in out
    assert "fs-pid" not in out  # not in the allow-list
    # The tools' payload schemas export like any (one file per namespace, compiling).
    done = cli("schemas", str(good), "--out", str(tmp_path / "xsd"))
    assert done.returncode == 0, done.stderr
    exported = etree.XMLSchema(etree.parse(str(tmp_path / "xsd" / "urn-agentserver-mcp-fs.xsd")))
    assert exported.validate(
        etree.fromstring(f'<read_file xmlns="{FS}"><path>/notes/todo.txt</path></read_file>')
    )
    clash = boot(
        tmp_path / "clash.xml",
        '<listener name="fs-pid" handler="echo"/>'
        + stdio_mcp("fs", body='<tool name="pid"/><tool name="nope"/>'),
    )
    done = cli("check", str(clash))
    assert done.returncode == 1
    err = (done.stdout + done.stderr).decode()
    assert "<tool name='nope'/> is not among the tools it offers" in err
    assert "tool 'pid' maps to the listener name 'fs-pid', which is already used on line" in err
    unreachable = boot(
        tmp_path / "down.xml",
        '<mcp name="gone" command="/nonexistent/mcp-server" timeout="5"/>',
    )
    done = cli("check", str(unreachable))
    assert done.returncode == 1
    assert "<mcp name='gone'>" in (done.stdout + done.stderr).decode()


class ScriptedModel(FakeServer):
    """Calls two MCP tools at once, then answers with what they returned."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.system = ""

    def default(self, seen: Seen) -> Script:
        messages = seen.body["messages"]
        self.system = str(messages[0]["content"])
        text = self.last = "\n".join(str(m.get("content", "")) for m in messages)
        todo = re.search(r'tool="fs-read_file">\s*<text>([^<]*)</text>', text)
        files = re.search(r'tool="web-list_dir">\s*<text>([^<]*)</text>', text)
        if todo is None or files is None:
            return openai_ok(
                f'<read_file xmlns="{FS}"><path>/notes/todo.txt</path></read_file>'
                f'<read_file xmlns="{FS}"><path>/notes/secret.txt</path></read_file>'
                f'<list_dir xmlns="{WEB}"><folder>/notes</folder><limit>5</limit></list_dir>',
                model="m",
            )
        listed = ", ".join(json.loads(files[1])["files"])
        return openai_ok(f"todo: {todo[1]}; files: {listed}", model="m")


async def test_an_agent_calls_two_mcp_tools_and_answers_with_their_results(tmp_path, http_mcp):
    path = boot(
        tmp_path / "boot.xml",
        stdio_mcp("fs", body='<tool name="read_file"/>')
        + f'<mcp name="web" url="{http_mcp.url}"><tool name="list_dir"/></mcp>'
        + '<listener name="assistant" handler="assistant" agent="true" '
        'peers="fs-read_file web-list_dir" timeout="60"><agent model="m" max-steps="4"/>'
        # Governance applies to MCP tools as to any peer.
        '<policy default="allow"><rule priority="10" id="no-secrets" decision="deny" '
        'target="fs-*"><arg path="path" equals="/notes/secret.txt"/></rule></policy>'
        "</listener>",
        llm=True,
    )
    async with trio.open_nursery() as nursery:
        model = await ScriptedModel().start(nursery)
        env = subprocess_env(OPENAI_BASE_URL=model.base_url, OPENAI_API_KEY="k")
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(path, env=env, cwd=tmp_path, timeout=40)
        )
        try:
            async with open_client(server.host, server.port) as client:
                thread = new_thread_id()
                await client.send(
                    Task(text="What is on my todo list?"), to="assistant", thread=thread
                )
                with trio.fail_after(30):
                    reply = await client.receive()
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
    assert reply.payload.tag == f"{{{ASSISTANT}}}answer", server.stderr
    answer = reply.payload.findtext(f"{{{ASSISTANT}}}text")
    assert answer == "todo: buy milk; files: /notes/ideas.txt, /notes/todo.txt"
    # The agent's instructions describe the tools from their MCP descriptions and schemas.
    assert "Read one file of the notes folder and return its text." in model.system
    assert f'<list_dir xmlns="{WEB}">' in model.system
    assert "<limit>: integer (optional)" in model.system
    # The call the policy denied never reached the MCP server; the model was told.
    assert "no-secrets" in model.last
    assert "no such file" not in model.last
    assert "Error executing tool" not in model.last


async def _call(client, payload: str, to: str):
    thread = new_thread_id()
    await client.send(etree.fromstring(payload), to=to, thread=thread)
    with trio.fail_after(20):
        return await client.receive()


def _is_system_error(el, code: str) -> bool:
    core = "https://xml-pipeline.org/ns/core/v1"
    return el.tag == f"{{{core}}}SystemError" and el.findtext(f"{{{core}}}code") == code


async def test_errors_timeouts_a_killed_server_and_a_changed_tool_list(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    path = boot(
        tmp_path / "boot.xml",
        stdio_mcp("fs") + stdio_mcp("slow", marks, extra='timeout="1"', body='<tool name="slow"/>'),
    )
    server = await trio.to_thread.run_sync(
        lambda: ServerProcess.start(path, cwd=tmp_path, timeout=40)
    )
    try:
        async with open_client(server.host, server.port) as client:
            # A tool that raises: a failed result, not a crash.
            reply = await _call(
                client, f'<boom xmlns="{FS}"><reason>disk on fire</reason></boom>', "fs-boom"
            )
            assert reply.payload.tag == f"{{{MCP}}}result"
            assert reply.payload.get("status") == "failed"
            assert "disk on fire" in reply.payload.findtext(f"{{{MCP}}}text")
            # Past its timeout: a SystemError here, and the call cancelled on the MCP side.
            reply = await _call(
                client, f'<slow xmlns="{SLOW}"><seconds>30</seconds></slow>', "slow-slow"
            )
            assert _is_system_error(reply.payload, "timeout"), reply.payload
            assert await trio.to_thread.run_sync(
                lambda: wait_until(lambda: (marks / "cancelled").exists(), timeout=10)
            )
            # Killed mid-call: SystemError; restarted with backoff, the calls work again.
            first = (await _call(client, f'<pid xmlns="{FS}"/>', "fs-pid")).payload
            first_pid = first.findtext(f"{{{MCP}}}text")
            reply = await _call(client, f'<die xmlns="{FS}"/>', "fs-die")
            assert _is_system_error(reply.payload, "routing"), reply.payload
            for _ in range(100):
                reply = (await _call(client, f'<pid xmlns="{FS}"/>', "fs-pid")).payload
                if reply.tag == f"{{{MCP}}}result":
                    break
                assert _is_system_error(reply, "routing")
                await trio.sleep(0.1)
            assert reply.get("status") == "ok", reply
            assert reply.findtext(f"{{{MCP}}}text") != first_pid
            # The server says its tools changed: listed again, the change logged.
            reply = await _call(client, f'<grow xmlns="{FS}"/>', "fs-grow")
            assert reply.payload.get("status") == "ok"
            assert await trio.to_thread.run_sync(
                lambda: wait_until(lambda: "added ['extra']" in server.stderr, timeout=10)
            ), server.stderr
    finally:
        code = await trio.to_thread.run_sync(server.stop)
    assert code == 0, server.stderr
    assert "MCP server fs failed" in server.stderr or "reconnecting" in server.stderr


async def test_an_idempotent_servers_failed_call_is_retried_after_the_restart(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    path = boot(
        tmp_path / "boot.xml",
        stdio_mcp(
            "fs",
            marks,
            extra='idempotent="true" retries="4" timeout="10"',
            body='<tool name="flaky"/>',
        ),
    )
    server = await trio.to_thread.run_sync(
        lambda: ServerProcess.start(path, cwd=tmp_path, timeout=40)
    )
    try:
        async with open_client(server.host, server.port) as client:
            reply = await _call(client, f'<flaky xmlns="{FS}"/>', "fs-flaky")
    finally:
        assert await trio.to_thread.run_sync(server.stop) == 0, server.stderr
    # The first attempt killed the server; the retry reached the restarted one.
    assert reply.payload.get("status") == "ok", reply.payload
    died = (marks / "flaky").read_text()
    assert reply.payload.findtext(f"{{{MCP}}}text").startswith("survived in ")
    assert not reply.payload.findtext(f"{{{MCP}}}text").endswith(f" {died}")
    assert "fs-flaky: attempt 1 failed" in server.stderr


def test_the_stdio_servers_stop_with_the_server(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    path = boot(tmp_path / "boot.xml", stdio_mcp("fs", marks))
    server = ServerProcess.start(path, cwd=tmp_path, timeout=40)
    try:
        children = _children(server.proc.pid)
    finally:
        assert server.stop() == 0, server.stderr
    assert children, "no MCP server process"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in children):
        time.sleep(0.1)
    assert not any(_alive(p) for p in children)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (from any of its threads: trio spawns in a worker)."""
    found = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    stat = pathlib.Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.subprocess
async def test_in_process_testing_runs_the_mcp_servers_too(tmp_path):
    from agentserver.testing import in_process

    path = boot(tmp_path / "boot.xml", stdio_mcp("fs", body='<tool name="read_file"/>'))
    async with in_process(path) as organism:
        reply = await organism.request(
            f'<read_file xmlns="{FS}"><path>/notes/ideas.txt</path></read_file>',
            to="fs-read_file",
            timeout=20,
        )
    assert reply.payload.get("status") == "ok", reply.payload
    assert reply.payload.findtext(f"{{{MCP}}}text") == "an XML pump"
