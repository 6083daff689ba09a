"""Remote A2A agents as tools (issue 35, docs/a2a.md): our server (a subprocess) calls an
agent built with the official SDK's own server pieces, in its own asyncio process
(tests/a2a_sdk_server.py): a plain answer (over the remote's stream, and by polling a
remote without streaming), a remote failure, our timeout cancelling the remote task, a
remote input-required question reaching our agent's model and answered by its next call,
our stop cancelling the remote task, and the remote killed mid-task; ``check`` printing
the mapping, an unreachable card an error (a warning with ``required="false"``). A call's
step retries and its resend after our server is SIGKILLed continue the remote task it
started (one remote task per call); on PostgreSQL another process takes the call over,
and two processes on the one store each complete a task sent to them exactly once.

Each of those runs twice: against the 1.x SDK's agent (A2A 1.0), and against the 0.3
SDK's own (tests/a2a_v03_server.py, ``a2a-sdk==0.3.26`` in its own virtual environment:
A2A 0.3 only, no ``ListTasks``), which our client reaches by its card's 0.3 interface
with 0.3's method names alone, its retries and restarts finding the remote task by the
step log's record.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys

import httpx
import pytest
import trio
from httputil import http_url
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import TESTS, ServerProcess, cli, subprocess_env
from test_a2a_v03 import v03_python  # noqa: F401 - the 0.3 SDK's interpreter (fixture)
from test_agents_crash import Store

SERVER = TESTS / "a2a_sdk_server.py"
SERVER_V03 = TESTS / "a2a_v03_server.py"
#: The JSON-RPC methods of A2A 0.3.
V03_METHODS = {
    "message/send",
    "message/stream",
    "tasks/get",
    "tasks/cancel",
    "tasks/resubscribe",
}
REMOTE_NS = "urn:agentserver:a2a:remote"
PATIENCE = 40.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Remote:
    """The SDK's server in its own process: 1.x's (tests/a2a_sdk_server.py), or with
    ``python`` (the 0.3 SDK's interpreter) 0.3's (tests/a2a_v03_server.py), which also
    records the JSON-RPC methods it is called with."""

    def __init__(
        self, tmp_path, name: str, *flags: str, scheme: str = "http", python: str | None = None
    ) -> None:
        self.port = free_port()
        self.methods_file = tmp_path / f"{name}-methods.txt"
        self.methods_file.write_text("")
        server, env = SERVER, subprocess_env()
        if python is not None:
            server = SERVER_V03
            flags = (*flags, "--methods", str(self.methods_file))
            env.pop("PYTHONPATH", None)
        self.cancels = tmp_path / f"{name}-cancels.txt"
        self.cancels.write_text("")
        #: Each execution's task id, one a line.
        self.starts = tmp_path / f"{name}-starts.txt"
        self.starts.write_text("")
        flags = (*flags, "--starts", str(self.starts))
        self.proc = subprocess.Popen(
            [python or sys.executable, str(server), str(self.port), str(self.cancels), *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self.url = f"{scheme}://127.0.0.1:{self.port}"

    def wait_ready(self, **options) -> None:
        for _ in range(200):
            try:
                card = httpx.get(self.url + "/.well-known/agent-card.json", **options)
                if card.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            import time

            time.sleep(0.05)
        raise AssertionError("the SDK's server did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def tasks(self) -> list[str]:
        """The remote tasks executed, in order (one line per execution)."""
        return self.starts.read_text().split()

    def methods(self) -> set[str]:
        """The JSON-RPC methods a 0.3 remote was called with."""
        return set(self.methods_file.read_text().split())


class CallingModel(FakeServer):
    """``colors``: asks the remote's ``ask`` skill, answers its question with "blue",
    then reports what it noted. ``stall``: calls ``echo`` with a slow task. Else "ok"."""

    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        messages = seen.body["messages"]
        everything = "\n".join(str(m.get("content", "")) for m in messages[1:])
        if "colors" in everything:
            noted = re.search(r"Color noted: \w+", everything)
            if noted:
                return openai_ok(f"Done: {noted.group(0)}", model="m")
            if "The remote agent asks" in everything:
                return openai_ok(f'<ask xmlns="{REMOTE_NS}"><text>blue</text></ask>', model="m")
            return openai_ok(f'<ask xmlns="{REMOTE_NS}"><text>ask me</text></ask>', model="m")
        if "stall" in everything:
            if "<answer" in everything:
                return openai_ok("stalled", model="m")
            return openai_ok(f'<echo xmlns="{REMOTE_NS}"><text>slow</text></echo>', model="m")
        return openai_ok("ok", model="m")


def boot(path, remote: Remote, plain: Remote, extra: str = "") -> None:
    path.write_text(
        f"""<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="caller">
  <limits hello-timeout="2" read-timeout="2" drain-timeout="1" write-timeout="2"/>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="http://127.0.0.1:9/v1"
             base-url-env="A2A_LLM_BASE_URL" api-key-env="A2A_LLM_KEY" timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  <store path="state/agents.sqlite3" watchdog-interval="0.2"
         url-env="AGENTS_TEST_STORE_URL" lease="1" heartbeat="0.25"/>
  <listeners>
    <a2a name="remote" url="{remote.url}" timeout="30"/>
    <a2a name="plain" url="{plain.url}" timeout="3" concurrency="2"/>
    {extra}
    <listener name="assistant" handler="assistant" agent="true"
              peers="remote-echo remote-ask">
      <agent model="m" max-steps="6"/>
    </listener>
  </listeners>
</organism>"""
    )


async def post(url: str, to: str, body: str) -> str:
    async with httpx.AsyncClient(timeout=PATIENCE) as http:
        response = await http.post(
            f"{url}/v1/messages",
            params={"to": to},
            content=body.encode(),
            headers={"content-type": "application/xml"},
        )
        return response.text


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def store_env(request) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"AGENTS_TEST_STORE_URL": request.getfixturevalue("pg_url")}


@pytest.fixture(params=["1.0", "0.3"])
def remote_python(request) -> str | None:
    """The remote's A2A version: None for the 1.x SDK's agent, else the 0.3 SDK's
    interpreter (its agent speaks only 0.3)."""
    return None if request.param == "1.0" else request.getfixturevalue("v03_python")


def only_v03(*remotes: Remote) -> None:
    """A 0.3 remote was called with 0.3's method names alone (never ``ListTasks``)."""
    for remote in remotes:
        called = remote.methods()
        assert called and called <= V03_METHODS, called


async def test_remote_sdk_agents_as_tools(tmp_path, store_env, remote_python):
    remote = Remote(tmp_path, "remote", python=remote_python)
    plain = Remote(tmp_path, "plain", "--no-streaming", python=remote_python)
    try:
        await trio.to_thread.run_sync(remote.wait_ready)
        await trio.to_thread.run_sync(plain.wait_ready)
        path = tmp_path / "boot.xml"
        boot(path, remote, plain)
        checked = await trio.to_thread.run_sync(lambda: cli("check", str(path)))
        out = checked.stdout.decode()
        assert checked.returncode == 0, checked.stderr
        assert "a2a remote: skill 'echo' -> listener remote-echo" in out
        assert "a2a plain: skill 'ask' -> listener plain-ask" in out
        async with trio.open_nursery() as nursery:
            model = await CallingModel().start(nursery)
            env = subprocess_env(A2A_LLM_BASE_URL=model.base_url, A2A_LLM_KEY="k", **store_env)
            server = await trio.to_thread.run_sync(
                lambda: ServerProcess.start(path, "--http-port", "0", env=env, cwd=tmp_path)
            )
            try:
                url = http_url(server)
                await _answers_failures_timeouts(url, plain)
                await _input_required_reaches_the_model(url)
                await _stop_cancels_the_remote_task(url, server, remote)
                await _remote_killed_mid_task(url, remote)
                if remote_python is not None:
                    only_v03(remote, plain)
            finally:
                await trio.to_thread.run_sync(server.stop)
                nursery.cancel_scope.cancel()
    finally:
        remote.stop()
        plain.stop()


async def _answers_failures_timeouts(url: str, plain: Remote) -> None:
    # A plain answer: over the remote's stream, and by polling the one without streaming.
    for name in ("remote", "plain"):
        body = f'<echo xmlns="urn:agentserver:a2a:{name}"><text>hello</text></echo>'
        reply = await post(url, f"{name}-echo", body)
        assert 'state="completed"' in reply and "remote says: hello" in reply, reply
    # Data fields ride along as a data part.
    body = '<echo xmlns="urn:agentserver:a2a:plain"><text>with data</text><data>[1]</data></echo>'
    assert "must be a JSON object" in await post(url, "plain-echo", body)
    # A remote failure: a failed answer with the remote's text.
    reply = await post(
        url, "plain-echo", '<echo xmlns="urn:agentserver:a2a:plain"><text>fail</text></echo>'
    )
    assert 'status="failed"' in reply and "remote broke" in reply, reply
    # Our timeout (3 s): the remote task is cancelled there.
    reply = await post(
        url, "plain-echo", '<echo xmlns="urn:agentserver:a2a:plain"><text>slow</text></echo>'
    )
    assert "the remote task was cancelled" in reply, reply
    task = re.search(r'task="([^"]+)"', reply).group(1)
    assert task in plain.cancels.read_text().split()


async def _input_required_reaches_the_model(url: str) -> None:
    body = '<task xmlns="urn:agentserver:assistant"><text>colors please</text></task>'
    reply = await post(url, "assistant", body)
    assert "Done: Color noted: blue" in reply, reply


async def _stop_cancels_the_remote_task(url: str, server: ServerProcess, remote: Remote) -> None:
    body = '<task xmlns="urn:agentserver:assistant"><text>stall here</text></task>'
    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, url, "assistant", body)
        await trio.sleep(2.0)  # the agent's call to the remote's slow task is in flight
        connect = f"{server.host}:{server.port}"
        done = await trio.to_thread.run_sync(lambda: cli("stop", "assistant", "--connect", connect))
        assert done.returncode == 0, done.stdout + done.stderr
        with trio.fail_after(15):
            while not remote.cancels.read_text().strip():  # noqa: ASYNC110 (a file)
                await trio.sleep(0.1)


async def _remote_killed_mid_task(url: str, remote: Remote) -> None:
    body = '<echo xmlns="urn:agentserver:a2a:remote"><text>slow</text></echo>'
    async with trio.open_nursery() as nursery:
        replies: list[str] = []

        async def call() -> None:
            replies.append(await post(url, "remote-echo", body))

        nursery.start_soon(call)
        await trio.sleep(1.5)
        await trio.to_thread.run_sync(remote.stop)
    (reply,) = replies
    assert 'status="failed"' in reply and "Network communication error" in reply, reply


@pytest.mark.parametrize("required", ["true", "false"])
async def test_an_unreachable_card_is_an_error_or_a_warning(tmp_path, required):
    path = tmp_path / "boot.xml"
    path.write_text(
        f"""<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="caller">
  <listeners>
    <a2a name="gone" url="http://127.0.0.1:{free_port()}" required="{required}"
         connect-timeout="1"/>
    <listener name="calculator" handler="calculator"/>
  </listeners>
</organism>"""
    )
    done = await trio.to_thread.run_sync(lambda: cli("check", str(path)))
    err = done.stdout.decode() + done.stderr.decode()
    assert "<a2a name='gone'>" in err and "card unreachable" in err, err
    assert done.returncode == (0 if required == "false" else 1), err
    if required == "false":
        assert "its skills are absent" in err


async def test_a_remote_over_mutual_tls(tmp_path):
    from tlsutil import make_pki

    pki = make_pki(tmp_path / "pki")
    cert, key = pki.client_files("caller")
    remote = Remote(
        tmp_path,
        "secure",
        "--tls",
        str(pki.cert_file),
        str(pki.key_file),
        str(pki.ca_file),
        scheme="https",
    )
    try:
        context = pki.client_context()
        context.load_cert_chain(cert, key)
        await trio.to_thread.run_sync(lambda: remote.wait_ready(verify=context))
        path = tmp_path / "boot.xml"
        for tls, ok in (
            (f'ca="{pki.ca_file}" cert="{cert}" key="{key}"', True),
            (f'ca="{pki.ca_file}"', False),  # no client certificate: the remote refuses
            (f'cert="{cert}" key="{key}"', False),  # the remote's CA not trusted
        ):
            path.write_text(
                f"""<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="caller">
  <listeners><a2a name="secure" url="{remote.url}" {tls} connect-timeout="5"/></listeners>
</organism>"""
            )
            done = await trio.to_thread.run_sync(lambda: cli("check", str(path)))
            out = done.stdout.decode() + done.stderr.decode()
            assert (done.returncode == 0) == ok, out
            if ok:
                assert "a2a secure: skill 'echo' -> listener secure-echo" in out
        path.write_text(
            f"""<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="caller">
  <listeners>
    <a2a name="secure" url="{remote.url}" ca="{pki.ca_file}" cert="{cert}" key="{key}"/>
  </listeners>
</organism>"""
        )
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(path, "--http-port", "0", cwd=tmp_path)
        )
        try:
            body = '<echo xmlns="urn:agentserver:a2a:secure"><text>over TLS</text></echo>'
            reply = await post(http_url(server), "secure-echo", body)
            assert "remote says: over TLS" in reply, reply
        finally:
            await trio.to_thread.run_sync(server.stop)
    finally:
        remote.stop()


class ResumingModel(FakeServer):
    """``resume``: calls the streaming remote's ``echo`` with a task of 12 s, then answers
    with what it said, noting it. ``relay N``: calls it with that text, then answers with
    what it said."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.answers: list[str] = []

    def default(self, seen: Seen) -> Script:
        messages = seen.body["messages"]
        everything = "\n".join(str(m.get("content", "")) for m in messages[1:])
        said = re.search(r"remote says: pause 12 [\w-]+", everything)
        if said:
            self.answers.append(said.group(0))
            return openai_ok(f"Resumed: {said.group(0)}", model="m")
        relayed = re.search(r"remote says: relay \d+", everything)
        if relayed:
            return openai_ok(f"Relayed: {relayed.group(0)}", model="m")
        if asked := re.search(r"relay \d+", everything):
            body = f"<text>{asked.group(0)}</text>"
            return openai_ok(f'<echo xmlns="urn:agentserver:a2a:stream">{body}</echo>', model="m")
        if "resume" in everything:
            body = "<text>pause 12 longrun</text>"
            return openai_ok(f'<echo xmlns="urn:agentserver:a2a:stream">{body}</echo>', model="m")
        return openai_ok("ok", model="m")


def retrying_boot(path, stream: Remote, poll: Remote) -> None:
    attempts = 'step-timeout="1" retries="8" timeout="60"'
    path.write_text(
        f"""<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="caller">
  <limits hello-timeout="2" read-timeout="2" drain-timeout="1" write-timeout="2"/>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="http://127.0.0.1:9/v1"
             base-url-env="A2A_LLM_BASE_URL" api-key-env="A2A_LLM_KEY" timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  <store path="state/agents.sqlite3" watchdog-interval="0.2"
         url-env="AGENTS_TEST_STORE_URL" lease="1" heartbeat="0.25"/>
  <listeners>
    <a2a name="stream" url="{stream.url}" {attempts}/>
    <a2a name="poll" url="{poll.url}" {attempts}/>
    <listener name="assistant" handler="assistant" agent="true" peers="stream-echo">
      <agent model="m" max-steps="4" resume-deadline="600"/>
    </listener>
  </listeners>
</organism>"""
    )


async def test_retries_and_restarts_continue_the_remote_task(tmp_path, store_env, remote_python):
    """A call's retries (step-timeout 1 s against tasks of 4 s) and its resend after our
    server is SIGKILLed continue the remote task the call started: one remote task each.
    On PostgreSQL the call is taken over by another process, and then two processes each
    call the remote once. A 0.3 remote has no ListTasks: the task is found by the id the
    step log recorded (``a2a.task``)."""
    stream = Remote(tmp_path, "stream", python=remote_python)
    poll = Remote(tmp_path, "poll", "--no-streaming", python=remote_python)
    servers: list[ServerProcess] = []
    try:
        await trio.to_thread.run_sync(stream.wait_ready)
        await trio.to_thread.run_sync(poll.wait_ready)
        path = tmp_path / "boot.xml"
        retrying_boot(path, stream, poll)

        async def start() -> ServerProcess:
            server = await trio.to_thread.run_sync(
                lambda: ServerProcess.start(path, "--http-port", "0", env=env, cwd=tmp_path)
            )
            servers.append(server)
            return server

        async with trio.open_nursery() as nursery:
            model = await ResumingModel().start(nursery)
            env = subprocess_env(A2A_LLM_BASE_URL=model.base_url, A2A_LLM_KEY="k", **store_env)
            first = await start()
            url = http_url(first)
            # Step retries: each attempt times out after 1 s; the next continues the task
            # (by its stream again, or by polling), never sending the message twice. The
            # 0.3 remote answers the send itself only after 2.5 s ("lag"): without
            # ListTasks the first attempt waits for that answer past its step timeout.
            async with trio.open_nursery() as calls:
                for name, word in (("stream", "lag one"), ("poll", "lag two")):
                    body = (
                        f'<echo xmlns="urn:agentserver:a2a:{name}"><text>pause {word}</text></echo>'
                    )

                    async def call(name: str = name, body: str = body, word: str = word) -> None:
                        reply = await post(url, f"{name}-echo", body)
                        assert 'state="completed"' in reply, reply
                        assert f"remote says: pause {word}" in reply, reply

                    calls.start_soon(call)
            assert len(stream.tasks()) == 1 and len(poll.tasks()) == 1
            assert "same remote task" in first.stderr

            # Our server killed mid-call: the call is sent again (same key) after the
            # restart (SQLite) or by the process that takes over (PostgreSQL), and finds
            # and follows the remote task it started.
            async def ask() -> None:
                body = '<task xmlns="urn:agentserver:assistant"><text>resume me</text></task>'
                with contextlib.suppress(httpx.HTTPError):
                    await post(url, "assistant", body)

            nursery.start_soon(ask)
            store = Store(tmp_path / "state" / "agents.sqlite3")
            store.url = store_env.get("AGENTS_TEST_STORE_URL")

            def in_flight() -> bool:
                # The remote task started, and the Turn waits for the call; a 0.3
                # remote's task recorded (the window before the record is the one a
                # kill could make a second task in: docs/a2a.md).
                waiting = "SELECT 1 FROM turn_waiting_tools WHERE status = 'waiting'"
                if remote_python is not None:
                    recorded = "SELECT detail FROM step_log WHERE event = 'a2a.task'"
                    if stream.tasks()[-1:] not in ([r[0]] for r in store.rows(recorded)):
                        return False
                return len(stream.tasks()) == 2 and bool(store.rows(waiting))

            with trio.fail_after(PATIENCE):
                while not in_flight():  # noqa: ASYNC110 (other processes' files)
                    await trio.sleep(0.05)
            await trio.to_thread.run_sync(first.proc.kill)
            await trio.to_thread.run_sync(first.wait_exit, 10)
            second = await start()
            with trio.fail_after(PATIENCE):
                while not model.answers:  # noqa: ASYNC110 (set by the model's server)
                    await trio.sleep(0.1)
            assert model.answers == ["remote says: pause 12 longrun"], second.stderr
            assert len(stream.tasks()) == 2, stream.tasks()
            if store_env:
                # Two processes on one store: a call sent to either is one remote task.
                third = await start()
                for n, server in enumerate((second, third)):
                    body = f'<echo xmlns="urn:agentserver:a2a:stream"><text>hi {n}</text></echo>'
                    reply = await post(http_url(server), "stream-echo", body)
                    assert f"remote says: hi {n}" in reply, reply
                    # An agent's task: its Turn (and call) on either process.
                    body = f'<task xmlns="urn:agentserver:assistant"><text>relay {n}</text></task>'
                    reply = await post(http_url(server), "assistant", body)
                    assert f"Relayed: remote says: relay {n}" in reply, reply
                assert len(stream.tasks()) == 6, stream.tasks()
                assert len(set(stream.tasks())) == 6
            if remote_python is not None:
                only_v03(stream, poll)
                # The resent call found its task by the record, which names it.
                recorded = store.rows("SELECT detail FROM step_log WHERE event = 'a2a.task'")
                assert stream.tasks()[1] in {r[0] for r in recorded}, recorded
                # ... as GET /v1/steps shows it.
                async with httpx.AsyncClient(timeout=PATIENCE) as http:
                    log = (await http.get(http_url(second) + "/v1/steps?limit=1000")).json()
                assert log["durable"] is True, log
                shown = {r["detail"] for r in log["steps"] if r["event"] == "a2a.task"}
                assert stream.tasks()[1] in shown, log
            nursery.cancel_scope.cancel()
    finally:
        for server in servers:
            await trio.to_thread.run_sync(server.stop)
        stream.stop()
        poll.stop()
