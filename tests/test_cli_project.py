"""Issue 45 as a user meets it: a project folder of their own, outside the checkout, with a
``boot.xml`` on non-default ports (``<listen>``, ``<http>``) and a listener module beside
it, the real server run from that folder, and every command run from there with no
address, BOOT or variable given.

- Commands find the project: ``check``, ``store stats``, ``export``, ``replay`` take
  ./boot.xml; ``send``, ``status``, ``schedule``, ``budget`` and ``console`` connect where
  it says; the environment and ``--connect`` still win.
- Errors that name the fix: no token where clients are declared, a console without a
  ``console-router``, ``schedule delete`` of a declared schedule, ``export``/``replay``
  beside the running server (no "in use by another agentserver process").
- Collecting an answer later: Ctrl-C on ``send`` and a server that goes away mid-task
  print the thread and the ``result`` command (no traceback); ``agentserver result``
  then prints the answer, from the store or through the HTTP API, for its sender only.

On SQLite and PostgreSQL (``pg_url``).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import ServerProcess, subprocess_env

ALICE, BOB, OPS = "alice-secret-token", "bob-secret-token", "ops-secret-token"
ANSWER = "the answer is forty-two"
TASK = '<task xmlns="urn:agentserver:assistant"><text>{}</text></task>'
COUNT = '<count xmlns="urn:me:wc"><text>one two three</text></count>'
THREAD = re.compile(r"thread ([0-9a-f-]{36})")
#: Bound on every wait (the test takes a few seconds).
PATIENCE = 60

WC = '''\
"""The project's own listener: counts the words of a text."""

from pydantic_xml import BaseXmlModel, element

from agentserver.listener import HandlerMetadata, HandlerResponse

NS = "urn:me:wc"


class Count(BaseXmlModel, tag="count", nsmap={"": NS}):
    text: str = element()


class Counted(BaseXmlModel, tag="counted", nsmap={"": NS}):
    words: int = element()


async def count(payload: Count, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Counted(words=len(payload.text.split())))
'''


class Model(FakeServer):
    """Answers every call with ANSWER, but holds a call for a task that says "slow"
    until :attr:`release` is set (the task is then in flight as long as the test
    wants)."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.release = trio.Event()
        #: Set once a call is held.
        self.holding = trio.Event()

    def default(self, seen: Seen) -> Script:
        script = openai_ok(ANSWER)
        if "slow" in json.dumps(seen.body) and not self.release.is_set():
            self.holding.set()
            script.headers.append(("x-held", "1"))
        return script

    async def _respond(self, stream, conn, s: Script) -> bool:
        if ("x-held", "1") in s.headers:
            await self.release.wait()
        return await super()._respond(stream, conn, s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_project(folder: Path, llm_url: str) -> tuple[int, int]:
    """The user's project: boot.xml on two free (non-default) ports, wc.py beside it."""
    port, http = free_port(), free_port()
    assert 7340 not in (port, http) and 7341 not in (port, http)
    folder.mkdir()
    (folder / "wc.py").write_text(WC)
    (folder / "boot.xml").write_text(
        textwrap.dedent(
            f"""\
            <organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="proj">
              <listen port="{port}"/>
              <http port="{http}"/>
              <limits drain-timeout="1"/>
              <clients>
                <client name="alice" token-env="PROJ_ALICE_TOKEN"/>
                <client name="bob" token-env="PROJ_BOB_TOKEN"/>
                <client name="ops" token-env="PROJ_OPS_TOKEN" operator="true"/>
              </clients>
              <llm max-attempts="1" timeout="300">
                <backend name="fake" provider="openai" base-url="{llm_url}"
                         api-key-env="PROJ_LLM_KEY" timeout="300">
                  <model name="m"/>
                </backend>
              </llm>
              <store path="state/agents.sqlite3" url-env="PROJ_STORE_URL"
                     watchdog-interval="0.2" lease="1" heartbeat="0.25"/>
              <listeners>
                <listener name="wc" handler="wc:count">
                  <accepts type="wc:Count"/>
                  <responds type="wc:Counted"/>
                </listener>
                <listener name="assistant" handler="assistant" agent="true" timeout="600">
                  <agent model="m" max-steps="4" resume-deadline="600" llm-timeout="300"/>
                </listener>
              </listeners>
              <schedules>
                <schedule name="nightly" agent="assistant" cron="0 3 * * *">
                  <task xmlns="urn:agentserver:assistant"><text>tidy up</text></task>
                </schedule>
              </schedules>
            </organism>
            """
        )
    )
    return port, http


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def store_env(request) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"PROJ_STORE_URL": request.getfixturevalue("pg_url")}


def user_env(**extra: str) -> dict[str, str]:
    """A user's shell: no agentserver variable set (the project says where to go)."""
    env = subprocess_env(
        PROJ_ALICE_TOKEN=ALICE, PROJ_BOB_TOKEN=BOB, PROJ_OPS_TOKEN=OPS, PROJ_LLM_KEY="k"
    )
    for name in list(env):
        if name.startswith("AGENTSERVER_"):
            del env[name]
    env.update(extra)
    return env


class User:
    """Runs ``agentserver ...`` from the project folder, as its user would."""

    def __init__(self, folder: Path, store_env: dict[str, str]) -> None:
        self.folder = folder
        self.store_env = store_env

    def env(self, **extra: str) -> dict[str, str]:
        return user_env(**self.store_env, **extra)

    def run(self, *args: str, input: bytes = b"", **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "agentserver", *args],
            input=input,
            capture_output=True,
            env=self.env(**env),
            cwd=self.folder,
            timeout=PATIENCE,
        )

    def alice(self, *args: str, input: bytes = b"") -> subprocess.CompletedProcess:
        """As client alice, with her token."""
        return self.run(*args, "--client", "alice", input=input, AGENTSERVER_TOKEN=ALICE)

    def popen(self, *args: str, **env: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "agentserver", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env(**env),
            cwd=self.folder,
        )

    def start_server(self, port: int) -> ServerProcess:
        # No BOOT: ./boot.xml (ServerProcess adds --port 0; the project's port wins).
        return ServerProcess.start(None, "--port", str(port), env=self.env(), cwd=self.folder)


async def held(model: Model) -> None:
    """Until the model holds a task's call (the task is in flight)."""
    with trio.fail_after(PATIENCE):
        await model.holding.wait()


def text(done: subprocess.CompletedProcess) -> tuple[str, str]:
    return done.stdout.decode(), done.stderr.decode()


async def test_a_project_folder_of_ones_own(tmp_path: Path, store_env: dict[str, str]) -> None:
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        folder = tmp_path / "myproject"
        port, http = make_project(folder, model.base_url)
        user = User(folder, store_env)
        server = await trio.to_thread.run_sync(user.start_server, port)
        try:
            assert server.port == port
            await trio.to_thread.run_sync(commands_find_the_project, user, port, http)
            await trio.to_thread.run_sync(errors_name_the_fix, user)
            await collect_an_interrupted_task(user, model, http)
            server = await collect_a_task_the_server_dropped(user, model, server, port)
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()


def commands_find_the_project(user: User, port: int, http: int) -> None:
    out, err = text(check := user.run("check"))
    assert check.returncode == 0 and "OK: organism 'proj'" in out, (out, err)
    assert "3 listeners, 3 clients" in out
    sent = user.alice("send", "--payload-only", COUNT)
    assert sent.returncode == 0, sent.stderr
    assert b"<words>3</words>" in sent.stdout
    out, err = text(status := user.run("status", AGENTSERVER_TOKEN=ALICE))
    assert status.returncode == 0 and "organism 'proj'" in out, err
    # boot.xml's schedule is nobody's: an operator sees it (docs/security.md).
    out, err = text(listed := user.run("schedule", "list", AGENTSERVER_TOKEN=OPS))
    assert listed.returncode == 0 and out.startswith("nightly"), err
    budgets = user.run("budget", "show", AGENTSERVER_TOKEN=ALICE)
    assert budgets.returncode == 0, budgets.stderr
    stats = user.run("store", "stats")
    out, err = text(stats)
    assert stats.returncode == 0, err
    assert "{" not in out and "retention: none configured" in out
    # The variables and --connect still win over the project: each names a closed port.
    closed = free_port()
    by_env = user.run(
        "send", COUNT, "--client", "alice", AGENTSERVER_TOKEN=ALICE, AGENTSERVER_PORT=str(closed)
    )
    assert by_env.returncode == 4 and f"127.0.0.1:{closed}".encode() in by_env.stderr
    by_url = user.run("status", AGENTSERVER_HTTP_URL=f"http://127.0.0.1:{closed}")
    assert by_url.returncode == 4 and f"127.0.0.1:{closed}".encode() in by_url.stderr
    by_option = user.alice("send", COUNT, "--connect", f"127.0.0.1:{closed}")
    assert by_option.returncode == 4 and f"127.0.0.1:{closed}".encode() in by_option.stderr


def errors_name_the_fix(user: User) -> None:
    # No token where clients are declared: what to pass, not "the server closed".
    anonymous = user.run("send", COUNT)
    assert anonymous.returncode == 4
    assert anonymous.stderr.decode().strip() == (
        "authentication required: pass --client NAME and set AGENTSERVER_TOKEN"
    )
    wrong = user.run("send", COUNT, "--client", "alice", AGENTSERVER_TOKEN="not-hers")
    assert wrong.returncode == 4
    assert "authentication refused for client 'alice'" in wrong.stderr.decode()
    assert "closed the connection" not in wrong.stderr.decode()
    # A schedule declared in boot.xml: refused (409) with the reason, and still there.
    out, err = text(deleted := user.run("schedule", "delete", "nightly", AGENTSERVER_TOKEN=OPS))
    assert deleted.returncode == 1 and "409" in err and "declared in boot.xml" in err, (out, err)
    listed = user.run("schedule", "list", AGENTSERVER_TOKEN=OPS)
    assert listed.stdout.decode().startswith("nightly")
    # No console-router: said at connect, and a line gets the reason, not "Invalid payload".
    console = user.alice("console", input=b"hello\n/quit\n")
    out, err = text(console)
    assert console.returncode == 0, (out, err)
    lines = out.splitlines()
    assert lines[0].startswith("agentserver console: connected to 127.0.0.1:")
    assert "no console-router" in lines[1]
    assert "Invalid payload structure." not in out
    assert any(line.startswith("error: this server has no console-router") for line in lines)


async def collect_an_interrupted_task(user: User, model: Model, http: int) -> None:
    sending = user.popen(
        "send", TASK.format("slow one"), "--client", "alice", AGENTSERVER_TOKEN=ALICE
    )
    try:
        await held(model)
        sending.send_signal(signal.SIGINT)
        _out, err = await trio.to_thread.run_sync(lambda: sending.communicate(timeout=PATIENCE))
    finally:
        if sending.poll() is None:
            sending.kill()
    err_text = err.decode()
    assert sending.returncode == 130, err_text
    assert "Traceback" not in err_text and "KeyboardInterrupt" not in err_text
    thread = THREAD.search(err_text)
    assert thread, err_text
    thread_id = thread.group(1)
    assert f"agentserver result {thread_id} --client alice" in err_text

    def while_held() -> None:
        # Still running: said so, exit 3 (send's "no reply in time").
        out, err = text(pending := user.alice("result", thread_id))
        assert pending.returncode == 3 and "running" in err, (out, err)
        # Another client's task reads as missing; without a client, what to pass.
        bob = user.run("result", thread_id, "--client", "bob", AGENTSERVER_TOKEN=BOB)
        assert bob.returncode == 1 and "no task sent by client 'bob'" in bob.stderr.decode()
        nobody = user.run("result", thread_id)
        assert nobody.returncode == 2
        assert "authentication required: pass --client NAME" in nobody.stderr.decode()

    await trio.to_thread.run_sync(while_held)
    model.release.set()

    def answered() -> None:
        out, err = text(done := user.alice("result", thread_id, "--wait", str(PATIENCE)))
        assert done.returncode == 0, (out, err)
        assert "<answer" in out and ANSWER in out
        # The same through the HTTP API (the project's <http>), for her.
        url = f"http://127.0.0.1:{http}"
        over_http = user.alice("result", thread_id, "--url", url)
        assert over_http.returncode == 0 and ANSWER in over_http.stdout.decode(), over_http.stderr
        # export and replay beside the running server read the store as store stats does.
        exported = user.run("export", "assistant", thread_id)
        assert exported.returncode == 0, exported.stderr
        assert b"in use by another" not in exported.stderr
        assert json.loads(exported.stdout.decode().splitlines()[0])
        replayed = user.run("replay", "assistant", thread_id)
        assert replayed.returncode == 0 and b"identical" in replayed.stdout, replayed.stderr

    await trio.to_thread.run_sync(answered)


async def collect_a_task_the_server_dropped(
    user: User, model: Model, server: ServerProcess, port: int
) -> ServerProcess:
    """The server stops mid-task: ``send`` names the thread and the ``result`` command;
    after the restart the task is answered and ``result`` collects it."""
    model.release = trio.Event()
    model.holding = trio.Event()
    sending = user.popen(
        "send", TASK.format("slow two"), "--client", "alice", AGENTSERVER_TOKEN=ALICE
    )
    try:
        await held(model)
        assert await trio.to_thread.run_sync(server.stop) == 0
        _out, err = await trio.to_thread.run_sync(lambda: sending.communicate(timeout=PATIENCE))
    finally:
        if sending.poll() is None:
            sending.kill()
    err_text = err.decode()
    assert sending.returncode == 4, err_text
    assert "Traceback" not in err_text
    thread = THREAD.search(err_text)
    assert thread, err_text
    assert f"agentserver result {thread.group(1)} --client alice --wait" in err_text
    model.release.set()
    server = await trio.to_thread.run_sync(user.start_server, port)

    def answered() -> None:
        out, err = text(done := user.alice("result", thread.group(1), "--wait", str(PATIENCE)))
        assert done.returncode == 0 and ANSWER in out, (out, err)

    await trio.to_thread.run_sync(answered)
    return server


async def test_store_prune_dry_run_reports_what_prune_removes(tmp_path: Path) -> None:
    """``store prune --dry-run`` then ``store prune`` on the same stopped store, from the
    project folder: the same figures, in words (no dict reprs)."""
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        folder = tmp_path / "myproject"
        port, _http = make_project(folder, model.base_url)
        user = User(folder, {})
        server = await trio.to_thread.run_sync(user.start_server, port)
        try:
            for i in range(3):
                sent = await trio.to_thread.run_sync(
                    lambda i=i: user.alice("send", TASK.format(f"task {i}"))
                )
                assert sent.returncode == 0, sent.stderr
        finally:
            assert await trio.to_thread.run_sync(server.stop) == 0
            nursery.cancel_scope.cancel()
    # The same store, with a retention that lets every finished task go.
    boot = (folder / "boot.xml").read_text()
    (folder / "prune.xml").write_text(
        boot.replace(
            'heartbeat="0.25"/>',
            'heartbeat="0.25"><retention finished-tasks="1s" keep-last="0" events="1s" '
            'acknowledged-replies="1s" step-log="1s"/></store>',
        )
    )
    await trio.sleep(1.5)  # past the one-second windows
    dry = user.run("store", "prune", "prune.xml", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    dry_words = user.run("store", "prune", "prune.xml", "--dry-run")
    assert dry_words.returncode == 0 and b"would remove: 3 tasks and" in dry_words.stdout
    assert b"{" not in dry_words.stdout + dry_words.stderr
    done = user.run("store", "prune", "prune.xml", "--json")
    assert done.returncode == 0, done.stderr
    would, removed = json.loads(dry.stdout), json.loads(done.stdout)
    assert would["tasks"] == removed["tasks"] == 3
    assert would["rows"] == removed["rows"] and removed["rows"]["task_rows"] > 0
    again = user.run("store", "prune", "prune.xml", "--dry-run", "--json")
    assert json.loads(again.stdout)["tasks"] == 0


def test_a_command_that_needs_a_topology_says_where_it_looks(tmp_path: Path) -> None:
    """No boot.xml here and none named: the command says how to give one (exit 2)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for args in (("check",), ("store", "stats"), ("export", "a", "t"), ("schemas",)):
        done = subprocess.run(
            [sys.executable, "-m", "agentserver", *args],
            capture_output=True,
            env=user_env(),
            cwd=empty,
            timeout=PATIENCE,
        )
        assert done.returncode == 2, (args, done.stderr)
        assert b"no boot.xml here: give BOOT, set $AGENTSERVER_BOOT" in done.stderr


def test_an_unreadable_project_is_a_usage_error(tmp_path: Path) -> None:
    """A client command in a folder whose boot.xml is broken names the file, not an
    address it guessed."""
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "boot.xml").write_text("<organism")
    done = subprocess.run(
        [sys.executable, "-m", "agentserver", "send", COUNT],
        capture_output=True,
        env=user_env(),
        cwd=folder,
        timeout=PATIENCE,
    )
    assert done.returncode == 2 and b"boot.xml:1: not well-formed XML" in done.stderr


def test_status_shows_whole_errors_and_counts_in_words() -> None:
    """``status`` once cut an agent's last error at 60 characters, in a repr."""
    from agentserver.cli.status import format_status

    long = "The model refused the request: " + "word " * 60 + "end of the sentence."
    doc = {
        "organism": "proj",
        "pump": {"state": "running", "inflight": 0, "threads": 1, "endpoints": 2},
        "agents": [
            {
                "name": "assistant",
                "state": "idle",
                "queue": 0,
                "active_turn": None,
                "last_error": {"status": "failed", "text": long},
            }
        ],
    }
    out = format_status(doc)
    [line] = [x for x in out.splitlines() if "last error" in x]
    assert line.strip() == f"last error (failed): {' '.join(long.split())}"
    assert "1 thread, 2 endpoints" in out


def test_store_output_is_words() -> None:
    """``store prune`` and ``store stats`` print counts in words, never a dict's repr."""
    from agentserver.cli.store import removed

    report = {"tasks": 1, "rows": {"task_rows": 12, "boxes": 0, "step_log": 1}}
    assert removed(report) == "1 task and 13 rows (task rows 12, step log 1)"
    assert removed({"tasks": 0, "rows": {}}) == "0 tasks and 0 rows"
