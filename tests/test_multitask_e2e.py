"""Double texting, black-box (docs/runs.md): the real server, a named client on her
sockets and over HTTP (her bearer token) in one conversation (memory="client").

- Each mode, given per task on the socket (``<message multitask="...">``), with the first
  task's model call hung and with it suspended on a tool call mid-call; on SQLite, and on
  PostgreSQL with two processes on one store (the first task sent to one process, the
  double text to the other; either may run either Turn). Each task gets exactly one
  answer, on whichever of her connections, and the tool's effect is never repeated.
- ``POST /v1/messages?multitask=`` interrupts, rolls back or is rejected the same way.
- A mode that is none of the four: a ``<huh>`` naming them, the frame echoed, nothing run.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import h11
import httpx
import pytest
import trio
from httputil import http_url
from llm_fakes import FakeServer, Script, Seen, openai_ok
from multitask_support import EFFECTS_ENV, mark_call
from serverproc import DATA, ServerProcess, cli, subprocess_env

from agentserver.core.errors import HuhReason
from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.net.client import Client, DeliveredIds, Reply, open_client

BOOT = DATA / "multitask-boot.xml"
TOKEN = "alice-multitask-token"
PATIENCE = 30.0
#: After the last answer expected: a second answer to a task would come by then.
QUIET = 1.5
#: How long an enqueued double text is watched for an answer it must not get yet.
QUEUED_FOR = 1.0
_PG = pytest.mark.postgresql


class Model(FakeServer):
    """Decides each step from the conversation, as a model would:

    - a tool result is last: the first task's final answer;
    - the first task ("hang: ..."): its call is held until :attr:`release` is set;
    - the first task ("tool: ..."): a call to ``marker`` (which holds it);
    - any other task: answered at once, saying whether teal was said in the conversation.
    """

    def __init__(self) -> None:
        super().__init__("openai")
        self.bodies: list[str] = []
        self.hanging = trio.Event()
        #: Steps that continued a Turn from its tool result.
        self.resumed = 0
        self.release = trio.Event()
        self._held: set[int] = set()

    def default(self, seen: Seen) -> Script:
        said = "\n".join(str(m["content"]) for m in seen.body["messages"][1:])
        self.bodies.append(said)
        last = str(seen.body["messages"][-1]["content"])
        if "Result from " in last or "Tool call to " in last:
            self.resumed += 1
            return openai_ok("first done")
        if "hang" in last:
            self.hanging.set()
            script = openai_ok("first done")
            self._held.add(id(script))
            return script
        if "tool" in last:
            return openai_ok("Let me mark it. " + mark_call("tool: my colour is teal"))
        return openai_ok("teal remembered" if "teal" in said else "nothing of teal")

    async def _respond(self, stream: trio.SocketStream, conn: h11.Connection, s: Script) -> bool:
        if id(s) in self._held:
            await self.release.wait()
        return await super()._respond(stream, conn, s)


@dataclass
class Alice:
    """Her connections (one per server process) and every reply they got, by thread."""

    clients: list[Client]
    servers: list[ServerProcess]
    replies: dict[str, list[Reply]] = field(default_factory=dict)
    arrived: trio.Event = field(default_factory=trio.Event)

    async def read(self, client: Client) -> None:
        async for reply in client:
            self.replies.setdefault(reply.thread, []).append(reply)
            self.arrived.set()
            self.arrived = trio.Event()

    async def answer(self, thread: str) -> Reply:
        with trio.fail_after(PATIENCE):
            while not self.replies.get(thread):
                await self.arrived.wait()
        return self.replies[thread][0]


async def start(env: dict[str, str], cwd: Path, *args: str) -> ServerProcess:
    def run() -> ServerProcess:
        cwd.mkdir(exist_ok=True)
        return ServerProcess.start(BOOT, *args, env=env, cwd=cwd)

    return await trio.to_thread.run_sync(run)


@pytest.fixture(
    params=["sqlite", pytest.param("postgresql", marks=_PG)],
    ids=["sqlite", "postgresql-two-processes"],
)
def store_env(request) -> tuple[dict[str, str], int]:
    """The environment naming the store, and how many server processes share it."""
    if request.param == "sqlite":
        return {}, 1
    return {"MT_STORE_URL": request.getfixturevalue("pg_url")}, 2


@asynccontextmanager
async def servers_and_alice(
    tmp_path: Path, model: Model, store: dict[str, str], processes: int
) -> AsyncIterator[Alice]:
    env = subprocess_env(
        MT_LLM_BASE_URL=model.base_url,
        MT_LLM_KEY="k",
        MT_ALICE_TOKEN=TOKEN,
        **{EFFECTS_ENV: str(tmp_path / "effects")},
        **store,
    )
    servers: list[ServerProcess] = []
    try:
        for name in ("one", "two")[:processes]:
            servers.append(await start(env, tmp_path / name))
        # One client, two connections: connected to two processes she may be offered a
        # reply by both (docs/wire.md); her ids drop the copy, as the wire contract says.
        ids = DeliveredIds()
        first, last = servers[0], servers[-1]
        async with open_client(
            first.host, first.port, client="alice", token=TOKEN, delivered=ids
        ) as a:
            async with open_client(
                last.host, last.port, client="alice", token=TOKEN, delivered=ids
            ) as b:
                alice = Alice([a, b], servers)
                async with trio.open_nursery() as readers:
                    for c in alice.clients:
                        readers.start_soon(alice.read, c)
                    yield alice
                    readers.cancel_scope.cancel()
    finally:
        for server in servers:
            await trio.to_thread.run_sync(server.stop)
        for server in servers:
            assert "Traceback" not in server.all_stderr(), server.stderr


def effects(tmp_path: Path) -> list[str]:
    path = tmp_path / "effects"
    return path.read_text().splitlines() if path.exists() else []


async def stalled(tmp_path: Path, model: Model, stall: str) -> None:
    """The first task's Turn is stalled: its model call held, or its tool call made (by
    whichever process took the Turn)."""
    with trio.fail_after(PATIENCE):
        if stall == "hang":
            await model.hanging.wait()
        else:
            # A server process writes the file: there is no event to wait on.
            while not effects(tmp_path):  # noqa: ASYNC110
                await trio.sleep(0.05)


def release(tmp_path: Path, model: Model) -> None:
    """Let the held model call and the held tool call end (late, for a Turn ended)."""
    model.release.set()
    (tmp_path / "release").touch()


def failed(reply: Reply) -> bool:
    return reply.payload.get("status") == "failed"


@pytest.mark.parametrize("stall", ["hang", "tool"], ids=["hung-model", "tool-mid-call"])
@pytest.mark.parametrize("mode", ["enqueue", "reject", "interrupt", "rollback"])
async def test_each_mode_on_her_socket(tmp_path: Path, store_env, mode: str, stall: str) -> None:
    store, processes = store_env
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        async with servers_and_alice(tmp_path, model, store, processes) as alice:
            first_socket, second_socket = alice.clients
            first = await first_socket.send(
                Task(text=f"{stall}: my colour is teal"), to="assistant", thread=new_thread_id()
            )
            await stalled(tmp_path, model, stall)
            # The double text, from her other connection (on PostgreSQL: the other process).
            second = await second_socket.send(
                Task(text="which colour?"), to="assistant", multitask=mode
            )
            if mode == "enqueue":
                with trio.move_on_after(QUEUED_FOR):
                    await alice.answer(second)
                assert not alice.replies, "an enqueued task was answered before its turn"
                release(tmp_path, model)
                done, then = await alice.answer(first), await alice.answer(second)
                assert not failed(done) and "first done" in done.payload_xml, done.raw
                assert "teal remembered" in then.payload_xml, then.raw
            elif mode == "reject":
                busy = await alice.answer(second)
                assert failed(busy) and "busy" in busy.payload_xml, busy.raw
                assert first not in alice.replies  # the running Turn goes on
                release(tmp_path, model)
                done = await alice.answer(first)
                assert not failed(done) and "first done" in done.payload_xml, done.raw
            else:
                ended = await alice.answer(first)
                word = "interrupted" if mode == "interrupt" else "rolled back"
                assert failed(ended) and word in ended.payload_xml, ended.raw
                then = await alice.answer(second)
                # interrupt keeps what the ended Turn saw; rollback drops it.
                expect = "teal remembered" if mode == "interrupt" else "nothing of teal"
                assert expect in then.payload_xml, then.raw
                release(tmp_path, model)  # the late tool result resumes nothing
            await trio.sleep(QUIET)
        nursery.cancel_scope.cancel()
    counts = {thread: len(got) for thread, got in alice.replies.items()}
    assert counts == {first: 1, second: 1}, counts
    marks = effects(tmp_path)
    assert len(marks) == (1 if stall == "tool" else 0), marks
    # A Turn still running resumed once from its tool result; an ended one never did.
    goes_on = stall == "tool" and mode in ("enqueue", "reject")
    assert model.resumed == (1 if goes_on else 0)


async def test_a_bad_mode_is_refused_naming_the_modes(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        async with servers_and_alice(tmp_path, model, {}, 1) as alice:
            c = alice.clients[0]
            huh = await c.request(Task(text="hello"), to="assistant", multitask="shout")
            assert huh.is_huh and huh.error_text == HuhReason.INVALID_MULTITASK.value, huh.raw
            for mode in ("enqueue", "reject", "interrupt", "rollback"):
                assert mode in huh.error_text
            # Nothing lost: the refused frame comes back whole, to be sent again.
            attempt = base64.b64decode(huh.payload.findtext("{*}original-attempt"))
            assert b'multitask="shout"' in attempt and b"hello" in attempt
            assert model.bodies == []  # nothing was run
            # The connection goes on; the CLI's flag carries a good mode, refuses a bad one.
            sent = await trio.to_thread.run_sync(
                lambda: cli(
                    "send",
                    "--client",
                    "alice",
                    "--connect",
                    f"{alice.servers[0].host}:{alice.servers[0].port}",
                    "--to",
                    "assistant",
                    "--multitask",
                    "reject",
                    "--payload-only",
                    Task(text="hello").to_xml().decode(),
                    env=subprocess_env(AGENTSERVER_TOKEN=TOKEN),
                )
            )
            assert sent.returncode == 0 and b"nothing of teal" in sent.stdout, sent.stderr
            bad = await trio.to_thread.run_sync(
                lambda: cli("send", "--multitask", "shout", "<x/>", env=subprocess_env())
            )
            assert bad.returncode == 2 and b"--multitask" in bad.stderr, bad.stderr
        nursery.cancel_scope.cancel()


def post(url: str, text: str, mode: str) -> httpx.Response:
    body = Task(text=text).to_xml()
    return httpx.post(
        f"{url}/v1/messages",
        params={"to": "assistant", "multitask": mode},
        content=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=PATIENCE,
    )


@pytest.mark.parametrize("mode", ["interrupt", "rollback", "reject"])
async def test_an_http_task_double_texts_her_socket_task(tmp_path, mode: str) -> None:
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        env = subprocess_env(
            MT_LLM_BASE_URL=model.base_url,
            MT_LLM_KEY="k",
            MT_ALICE_TOKEN=TOKEN,
            **{EFFECTS_ENV: str(tmp_path / "effects")},
        )
        server = await start(env, tmp_path / "one", "--http-port", "0")
        try:
            url = http_url(server)
            bad = await trio.to_thread.run_sync(post, url, "hello", "shout")
            assert bad.status_code == 400 and "bad-multitask" in bad.text, bad.text
            async with open_client(server.host, server.port, client="alice", token=TOKEN) as c:
                first = await c.send(
                    Task(text="hang: my colour is teal"), to="assistant", thread=new_thread_id()
                )
                with trio.fail_after(PATIENCE):
                    await model.hanging.wait()
                answer = await trio.to_thread.run_sync(post, url, "which colour?", mode)
                with trio.fail_after(PATIENCE if mode != "reject" else 2.0):
                    got = await c.receive() if mode != "reject" else None
                if got is not None:
                    assert got.thread == first
                    assert got.payload.get("status") == "failed", got.raw
            text = answer.text
            if mode == "reject":
                assert "busy" in text, text
            else:
                assert answer.status_code == 200, text
                # Her HTTP task continues her socket conversation (interrupt keeps what
                # the stopped Turn saw; rollback drops it).
                expect = "teal remembered" if mode == "interrupt" else "nothing of teal"
                assert expect in text, text
                assert len(model.bodies) == 2
        finally:
            model.release.set()
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
