"""A named client without acks that leaves as docs/wire.md says (end of input, then reading
until the server closes) gets each answer once (found by bench/chaos.py, seed 1).

Before the fix the server still wrote a durable reply to such a connection after it had
read the client's end of input, and kept it (a reply written then "is not received"): the
client read it on the old connection and was handed it again on the next one. The client
cannot tell which replies the server wrote before it read the end of input, so it cannot
drop them either. Now the server writes no durable reply to a no-ack connection once its
input has ended: every reply the client reads is received, the rest is kept for the next
connection.
"""

from __future__ import annotations

import pytest
import trio
from llm_fakes import FakeServer, Script, Seen, openai_ok
from lxml import etree
from serverproc import DATA, RawConnection, ServerProcess, subprocess_env
from test_agents_crash import Store, until

from agentserver.core.envelope import build_envelope
from agentserver.core.handshake import hello_frame_body
from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task

pytestmark = pytest.mark.slow

BOOT = DATA / "agents-crash-boot.xml"
TOKEN = "alice-secret-token"
#: The answer comes this long after the task: after the client's end of input, before the
#: server closes the connection (its boot.xml's read-timeout is 2 s).
MODEL_DELAY = 0.8


class SlowModel(FakeServer):
    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        return openai_ok("Done with the job.", model="m", delay=MODEL_DELAY)


async def frames_until_closed(conn: RawConnection, patience: float) -> list[bytes]:
    frames = []
    with trio.fail_after(patience):
        while (frame := await conn.receive_frame()) is not None:
            frames.append(frame)
    return frames


@pytest.mark.parametrize(
    "store_kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)]
)
async def test_an_answer_ready_after_the_end_of_input_comes_once(tmp_path, store_kind, request):
    store = Store(tmp_path / "state" / "agents.sqlite3")
    extra = {}
    if store_kind == "postgresql":
        store.url = request.getfixturevalue("pg_url")
        extra["AGENTS_TEST_STORE_URL"] = store.url
    async with trio.open_nursery() as nursery:
        model = await SlowModel().start(nursery)
        env = subprocess_env(
            CRASH_LLM_BASE_URL=model.base_url,
            CRASH_LLM_KEY="test-key",
            CRASH_ALICE_TOKEN=TOKEN,
            **extra,
        )
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(BOOT, env=env, cwd=tmp_path)
        )
        try:
            thread = new_thread_id()
            conn = await RawConnection.open(server)
            await conn.send_frame(hello_frame_body("alice", TOKEN, ack=False))
            body = build_envelope("alice", "assistant", thread, Task(text="job").to_xml_tree())
            await conn.send_frame(etree.tostring(body))
            await trio.sleep(0.2)  # the task is taken; its answer is not ready yet
            await conn.stream.send_eof()
            first = await frames_until_closed(conn, 15)
            await conn.aclose()
            # The answer is kept or received: wait until it is out of the model's hands.
            await until(
                lambda: store.rows("SELECT count(*) FROM client_replies")[0][0] >= 1,
                "the answer is kept",
                store,
                [server],
            )
            conn = await RawConnection.open(server)
            await conn.send_frame(hello_frame_body("alice", TOKEN, ack=False))
            second = []
            with trio.move_on_after(2.0):
                while (frame := await conn.receive_frame()) is not None:
                    second.append(frame)
            await conn.aclose()
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
    answers = [f for f in first + second if thread.encode() in f]
    assert len(answers) == 1, (
        f"{len(answers)} copies of the answer: {len(first)} read after the end of input, "
        f"{len(second)} on the next connection"
    )
