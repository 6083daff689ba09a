"""Every answer reaches a named client once, on the wire (issue 25, item 1).

The real server (tests/data/agents-crash-boot.xml: named client ``alice``, three agents)
on SQLite, on PostgreSQL, and as two processes on one PostgreSQL store; its model is a
fake OpenAI-compatible server on loopback that answers each task at once. alice sends 40
tasks on one raw connection, with and without acknowledgements, and counts the frames of
each answer: before the fix a connection without acks got some answers twice,
byte-identical, milliseconds apart, on PostgreSQL (this process's own flusher, woken by
its own keep, offered the reply again while its receipt committed). Without a reconnect,
docs/wire.md allows no repeat, with acks or without.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio
from agents_crash_support import MixTask, PlanTask
from llm_fakes import FakeServer, Script, Seen, openai_ok, openai_stream
from lxml import etree
from serverproc import DATA, RawConnection, ServerProcess, subprocess_env
from test_agents_crash import Store, until

from agentserver.core.envelope import build_envelope
from agentserver.core.handshake import ack_frame_body, hello_frame_body
from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task

pytestmark = pytest.mark.slow

BOOT = DATA / "agents-crash-boot.xml"
TOKEN = "alice-secret-token"
TASKS = 40
AGENTS = (("assistant", Task), ("planner", PlanTask), ("mixer", MixTask))
PATIENCE = 60.0
#: After the last answer: a repeat comes within milliseconds; this is plenty.
QUIET = 1.5
_PG = pytest.mark.postgresql


class QuickModel(FakeServer):
    """Answers every task at its first step, naming its job."""

    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        texts = " ".join(str(m.get("content")) for m in seen.body.get("messages", []))
        jobs = re.findall(r"job-\d+", texts)
        text = f"Done with {jobs[-1] if jobs else '?'}"
        return openai_stream([text]) if seen.body.get("stream") else openai_ok(text, model="m")


@pytest.fixture(
    params=[
        ("sqlite", 1),
        pytest.param(("postgresql", 1), marks=_PG),
        pytest.param(("postgresql", 2), marks=_PG),
    ],
    ids=["sqlite", "postgresql", "postgresql-two-processes"],
)
def servers_on(request, tmp_path) -> tuple[Store, dict[str, str], int]:
    """The store the servers use, the environment naming it, how many servers."""
    backend, processes = request.param
    store = Store(tmp_path / "one" / "state" / "agents.sqlite3")
    if backend == "sqlite":
        return store, {}, processes
    store.url = request.getfixturevalue("pg_url")
    return store, {"AGENTS_TEST_STORE_URL": store.url}, processes


def kept(store: Store) -> int:
    return store.rows("SELECT count(*) FROM client_replies")[0][0]


@pytest.mark.parametrize("acks", [False, True], ids=["no-acks", "acks"])
async def test_each_answer_reaches_a_named_client_once(tmp_path: Path, servers_on, acks):
    store, store_env, processes = servers_on
    servers: list[ServerProcess] = []
    frames: dict[str, list[bytes]] = {}  # thread -> the frames of its answer
    jobs: dict[str, str] = {}  # thread -> job
    async with trio.open_nursery() as nursery:
        model = await QuickModel().start(nursery)
        env = subprocess_env(
            CRASH_LLM_BASE_URL=model.base_url,
            CRASH_LLM_KEY="test-key",
            CRASH_ALICE_TOKEN=TOKEN,
            **store_env,
        )
        try:
            for name in ("one", "two")[:processes]:
                cwd = tmp_path / name
                cwd.mkdir()
                servers.append(
                    await trio.to_thread.run_sync(
                        lambda cwd=cwd: ServerProcess.start(BOOT, env=env, cwd=cwd)
                    )
                )
            conn = await RawConnection.open(servers[0])
            await conn.send_frame(hello_frame_body("alice", TOKEN, ack=acks))
            for i in range(TASKS):
                agent, task_type = AGENTS[i % len(AGENTS)]
                thread = new_thread_id()
                jobs[thread] = f"job-{i}"
                task = task_type(text=f"Please handle job-{i} now.")
                body = build_envelope("alice", agent, thread, task.to_xml_tree())
                await conn.send_frame(etree.tostring(body))

            async def read_one() -> None:
                frame = await conn.receive_frame()
                assert frame is not None, "the server closed the connection"
                root = etree.fromstring(frame)
                thread = root.findtext(".//{*}thread")
                assert thread in jobs, frame
                frames.setdefault(thread, []).append(frame)
                reply_id = root.get("reply-id")
                assert (reply_id is not None) == acks, frame
                if acks:
                    await conn.send_frame(ack_frame_body("alice", [int(reply_id)]))

            with trio.fail_after(PATIENCE):
                while len(frames) < TASKS:
                    await read_one()
            with trio.move_on_after(QUIET):  # a repeat would come now
                while True:
                    await read_one()
            await until(lambda: kept(store) == 0, "every answer is received", store, servers)
            await conn.aclose()
        finally:
            for server in servers:
                if server.proc.poll() is None:
                    await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
    repeats = {
        jobs[t]: (len(f), "byte-identical" if len(set(f)) == 1 else "different")
        for t, f in frames.items()
        if len(f) != 1
    }
    assert repeats == {}, f"answers that arrived more than once: {repeats}"
    for thread, [frame] in frames.items():
        assert f"Done with {jobs[thread]}".encode() in frame, frame
