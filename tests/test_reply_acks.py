"""A named client's answers are never lost (issue 10, items 2 and 3).

The real server runs tests/data/agents-crash-boot.xml (named client ``alice``,
``read-timeout="2"``: the window in which owed replies are still written after a client's
end of input) in a scratch directory; its model is a fake OpenAI-compatible server on
loopback in this test's trio run, which answers each task after a delay.

- The client library asks for acknowledgement: a reply stays kept until acknowledged,
  whether alice left just before it was ready, long before, or the server was killed
  between sending it and reading her acknowledgement; she gets exactly one answer.
- A client that never asks: a reply written after its end of input stays kept.
- A second simultaneous connection of alice: its answers reach alice's live connection,
  else are kept for her.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import trio
from llm_fakes import FakeServer, Script, Seen, openai_ok
from lxml import etree
from serverproc import DATA, RawConnection, ServerProcess, cli, subprocess_env
from test_agents_crash import Store, until

from agentserver.core.envelope import build_envelope
from agentserver.core.handshake import ack_frame_body, hello_frame_body
from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import NS as ASSISTANT_NS
from agentserver.listeners.assistant import Task
from agentserver.net.client import Client, Reply, open_client

BOOT = DATA / "agents-crash-boot.xml"
TOKEN = "alice-secret-token"
ANSWER = f"{{{ASSISTANT_NS}}}answer"
PATIENCE = 20.0
#: The boot file's read-timeout: after the client's end of input, owed replies are still
#: written for this long.
DRAIN_WINDOW = 2.0


class SlowModel(FakeServer):
    """Answers every task ``delay`` seconds after it arrives, quoting it."""

    def __init__(self, delay: float) -> None:
        super().__init__("openai")
        self.delay = delay

    def default(self, seen: Seen) -> Script:
        task = next(m["content"] for m in seen.body["messages"] if m["role"] == "user")
        job = next(w for w in task.split() if w.startswith("job-"))
        return openai_ok(f"Done with {job}", model="m", delay=self.delay)


@contextlib.asynccontextmanager
async def running(tmp_path: Path, model_delay: float):
    """(model, server, store, restart) with the fake model in this trio run."""
    servers: list[ServerProcess] = []
    async with trio.open_nursery() as nursery:
        model = await SlowModel(model_delay).start(nursery)
        env = subprocess_env(
            CRASH_LLM_BASE_URL=model.base_url, CRASH_LLM_KEY="test-key", CRASH_ALICE_TOKEN=TOKEN
        )

        async def start() -> ServerProcess:
            server = await trio.to_thread.run_sync(
                lambda: ServerProcess.start(BOOT, env=env, cwd=tmp_path)
            )
            servers.append(server)
            return server

        store = Store(tmp_path / "state" / "agents.sqlite3")
        try:
            yield model, await start(), store, start, servers
        finally:
            for server in servers:
                if server.proc.poll() is None:
                    await trio.to_thread.run_sync(server.proc.kill)
                    await trio.to_thread.run_sync(server.proc.wait)
            nursery.cancel_scope.cancel()


def alice(server: ServerProcess):
    return open_client(server.host, server.port, client="alice", token=TOKEN)


def task(job: str) -> Task:
    return Task(text=f"Please handle {job} now.")


def check_answer(reply: Reply, job: str, thread: str) -> None:
    assert reply.thread == thread, reply.raw
    assert reply.payload.tag == ANSWER, reply.raw
    text = reply.payload.findtext(f"{{{ASSISTANT_NS}}}text") or ""
    assert text.startswith(f"Done with {job}"), reply.raw


async def exactly_one(client: Client, quiet: float = 1.0) -> Reply:
    """The one reply, then a quiet while in which nothing more arrives."""
    with trio.fail_after(PATIENCE):
        reply = await client.receive()
    with trio.move_on_after(quiet) as waited:
        extra = await client.receive()
    assert waited.cancelled_caught, f"a second reply arrived: {extra.raw!r}"
    return reply


def kept(store: Store) -> int:
    return store.rows("SELECT count(*) FROM client_replies")[0][0]


def answered(store: Store) -> bool:
    """The Turn ended and its reply was handed to the client-reply path."""
    return store.rows("SELECT status FROM agent_replies") == [("sent",)]


async def raw_alice(server: ServerProcess, *, ack: bool) -> RawConnection:
    conn = await RawConnection.open(server)
    await conn.send_frame(hello_frame_body("alice", TOKEN, ack=ack))
    return conn


async def raw_task(conn: RawConnection, job: str) -> str:
    thread = new_thread_id()
    body = build_envelope("alice", "assistant", thread, task(job).to_xml_tree())
    await conn.send_frame(etree.tostring(body))
    return thread


async def next_frame(conn: RawConnection) -> bytes:
    with trio.fail_after(PATIENCE):
        frame = await conn.receive_frame()
    assert frame is not None, "the server closed the connection"
    return frame


async def close_soon_then_reconnect(tmp_path: Path, model_delay: float) -> None:
    """alice sends a task and closes 0.2 s later; once the answer is ready she
    reconnects: exactly one answer, and nothing stays kept once she acknowledged it."""
    async with running(tmp_path, model_delay) as (_, server, store, _, servers):
        async with alice(server) as client:
            thread = await client.send(task("job-1"), to="assistant")
            await trio.sleep(0.2)
        await until(lambda: answered(store), "the answer is ready", store, servers)
        async with alice(server) as client:
            reply = await exactly_one(client)
            check_answer(reply, "job-1", thread)
            assert reply.id is not None
        await until(lambda: kept(store) == 0, "the answer is acknowledged", store, servers)


async def test_answer_ready_while_the_closed_connection_drains_reaches_the_reconnect(tmp_path):
    # The answer is ready 0.8 s after she closed: within the drain window, while the
    # server still writes owed replies to her (dead) connection.
    await close_soon_then_reconnect(tmp_path, model_delay=1.0)


async def test_answer_ready_after_the_drain_window_reaches_the_reconnect(tmp_path):
    await close_soon_then_reconnect(tmp_path, model_delay=0.2 + DRAIN_WINDOW + 0.8)


async def test_sigkill_between_the_answer_and_its_ack_sends_it_again(tmp_path):
    async with running(tmp_path, 0.3) as (_, server, store, start, servers):
        conn = await raw_alice(server, ack=True)
        thread = await raw_task(conn, "job-2")
        frame = await next_frame(conn)  # the answer, not acknowledged
        first = etree.fromstring(frame)
        reply_id = first.get("reply-id")
        assert reply_id is not None and reply_id.isdigit(), frame
        assert kept(store) == 1
        await trio.to_thread.run_sync(server.proc.kill)
        assert await trio.to_thread.run_sync(server.wait_exit, 10) < 0
        await conn.aclose()
        second = await start()
        async with alice(second) as client:
            reply = await exactly_one(client)
            check_answer(reply, "job-2", thread)
            assert reply.id == int(reply_id)
        await until(lambda: kept(store) == 0, "the answer is acknowledged", store, servers)
        # acknowledged: a third connection gets nothing
        async with alice(second) as client:
            with trio.move_on_after(1.0) as quiet:
                extra = await client.receive()
            assert quiet.cancelled_caught, extra.raw


async def test_acknowledgements_are_consumed_not_routed_and_only_for_her_replies(tmp_path):
    async with running(tmp_path, 0.0) as (_, server, store, _, servers):
        conn = await raw_alice(server, ack=True)
        # an ack for ids she was never sent: consumed silently (no <huh>), changes nothing
        await conn.send_frame(ack_frame_body("alice", [12345]))
        thread = await raw_task(conn, "job-3")
        frame = etree.fromstring(await next_frame(conn))
        assert frame.findtext(".//{*}thread") == thread and frame.get("reply-id"), frame
        assert kept(store) == 1
        await conn.send_frame(ack_frame_body("alice", [int(frame.get("reply-id"))]))
        await until(lambda: kept(store) == 0, "the ack is applied", store, servers)
        await conn.aclose()


async def test_a_client_without_acks_keeps_a_reply_written_after_its_end_of_input(tmp_path):
    async with running(tmp_path, 0.5) as (_, server, store, _, servers):
        conn = await raw_alice(server, ack=False)
        thread = await raw_task(conn, "job-4")
        await conn.stream.send_eof()  # end of input: the answer is produced after it
        # She reads until the server closes: the answer is not written after her end of
        # input (she could not tell it from one written before, which is received) ...
        frames = []
        with trio.fail_after(15):
            while (frame := await conn.receive_frame()) is not None:
                frames.append(frame)
        assert not any(b"Done with job-4" in f for f in frames), frames
        await conn.aclose()
        await until(lambda: kept(store) == 1, "the answer is kept", store, servers)  # ... kept
        again = await raw_alice(server, ack=False)
        frame = await next_frame(again)  # written while her input is open: received
        assert thread.encode() in frame and b"Done with job-4" in frame, frame
        await until(lambda: kept(store) == 0, "the reply counts as received", store, servers)
        await again.aclose()


async def test_a_second_connection_answer_goes_to_her_live_connection(tmp_path):
    async with running(tmp_path, 1.0) as (_, server, store, _, servers):
        async with alice(server) as staying:
            async with alice(server) as second:
                thread = await second.send(task("job-5"), to="assistant")
                await trio.sleep(0.2)
            # the second connection is gone: the answer reaches the one still open
            check_answer(await exactly_one(staying), "job-5", thread)
        await until(lambda: kept(store) == 0, "the answer is acknowledged", store, servers)


async def test_a_second_connection_answer_is_kept_when_she_is_gone(tmp_path):
    async with running(tmp_path, 1.0) as (_, server, store, _, servers):
        async with alice(server):
            async with alice(server) as second:
                thread = await second.send(task("job-6"), to="assistant")
                await trio.sleep(0.2)
        await until(lambda: answered(store), "the answer is ready", store, servers)
        async with alice(server) as client:
            check_answer(await exactly_one(client), "job-6", thread)


async def test_agentserver_send_leaves_her_kept_answers_for_a_client_that_reads_them(tmp_path):
    async with running(tmp_path, 0.0) as (_, server, store, _, servers):
        async with alice(server) as client:
            thread = await client.send(task("job-7"), to="assistant")
        await until(lambda: answered(store), "the answer is ready", store, servers)
        # `agentserver send` as alice is handed the kept answer at her hello too: it
        # prints only the reply on its own thread and leaves the other unacknowledged
        add = '<add xmlns="urn:agentserver:calculator"><a>1</a><b>2</b></add>'
        result = await trio.to_thread.run_sync(
            lambda: cli(
                "send",
                "--connect",
                f"{server.host}:{server.port}",
                "--client",
                "alice",
                "--to",
                "calculator",
                "--linger",
                "1",
                input=add.encode(),
                env=subprocess_env(AGENTSERVER_TOKEN=TOKEN),
            )
        )
        assert result.returncode == 0, result.stderr
        assert b"<value>3</value>" in result.stdout and b"job-7" not in result.stdout
        assert kept(store) == 1
        async with alice(server) as client:
            check_answer(await exactly_one(client), "job-7", thread)
