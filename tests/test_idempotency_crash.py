"""SIGKILL mid-step (issue 26): a tool call in progress when the server is killed is sent
again after the restart with the same idempotency key, and its side effect is written once.

The real server runs tests/data/agents-idem-boot.xml in a scratch directory: the agent's
model (a scripted OpenAI-compatible server in this test's trio run, which survives the
kill) asks for two identical ``charge`` calls in one message; ``ledger``
(tests/idem_support.py, ``idempotent="true"``) records each call's key, writes one effect
per key, then holds (a file ``hold``) until the test kills the server. The restarted server
finds the Turn suspended on both calls and sends them again; ``ledger`` sees the same two
keys, writes nothing more, answers; the Turn ends with one answer. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import pytest
import trio
from idem_support import rows
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import DATA, ServerProcess, subprocess_env
from test_agents_crash import Store

from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client

BOOT = DATA / "agents-idem-boot.xml"
TOKEN = "alice-idem-token"
PATIENCE = 30.0
CHARGE = '<charge xmlns="urn:test:idem"><amount>5</amount></charge>'


class LedgerModel(FakeServer):
    """Two identical charges, then (with both results) the answer."""

    def __init__(self) -> None:
        super().__init__("openai")
        self.decisions: list[str] = []

    def default(self, seen: Seen) -> Script:
        text = "\n".join(str(m["content"]) for m in seen.body["messages"][1:])
        if text.count("<charged") >= 2:
            self.decisions.append("answer")
            effects = text.count("<effects>1</effects>")
            return openai_ok(f"Charged twice; each result says one effect ({effects}).", model="m")
        self.decisions.append("charge")
        return openai_ok(f"Charging. {CHARGE} {CHARGE}", model="m")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def backend(request, tmp_path) -> tuple[Store, dict[str, str]]:
    store = Store(tmp_path / "state" / "agents.sqlite3")
    if request.param == "sqlite":
        return store, {}
    store.url = request.getfixturevalue("pg_url")
    return store, {"AGENTS_TEST_STORE_URL": store.url}


async def start_server(env: dict[str, str], cwd) -> ServerProcess:
    return await trio.to_thread.run_sync(lambda: ServerProcess.start(BOOT, env=env, cwd=cwd))


async def test_sigkill_mid_step_resends_the_call_with_its_key_and_the_effect_is_once(
    tmp_path, backend
):
    store, store_env = backend
    effects = tmp_path / "effects.sqlite3"
    hold = tmp_path / "hold"
    hold.write_text("")
    servers: list[ServerProcess] = []
    async with trio.open_nursery() as nursery:
        model = await LedgerModel().start(nursery)
        env = subprocess_env(
            IDEM_LLM_BASE_URL=model.base_url,
            IDEM_LLM_KEY="k",
            IDEM_ALICE_TOKEN=TOKEN,
            **store_env,
        )
        try:

            def in_progress() -> bool:
                return len(rows(effects, "SELECT key FROM effects")) == 2 and bool(
                    store.rows("SELECT 1 FROM turn_waiting_tools WHERE status = 'waiting'")
                )

            first = await start_server(env, tmp_path)
            servers.append(first)
            async with open_client(first.host, first.port, client="alice", token=TOKEN) as c:
                thread = await c.send(Task(text="charge me twice"), to="assistant")
                with trio.fail_after(PATIENCE):
                    # Both calls are in their handler (effect written, holding); the Turn
                    # waits for them. Another process writes these files: poll.
                    while not in_progress():  # noqa: ASYNC110 (another process's files)
                        await trio.sleep(0.05)
                await trio.to_thread.run_sync(first.proc.kill)
                assert await trio.to_thread.run_sync(first.wait_exit, 10) < 0
            before = rows(effects, "SELECT key FROM seen")
            assert len(before) == 2 and len(set(before)) == 2  # two calls, two keys
            hold.unlink()

            second = await start_server(env, tmp_path)
            servers.append(second)
            async with open_client(second.host, second.port, client="alice", token=TOKEN) as c:
                with trio.fail_after(PATIENCE):
                    reply = await c.receive()
                assert reply.thread == thread
                assert reply.payload.get("status") is None, reply.raw
                text = "".join(reply.payload.itertext())
                assert text == "Charged twice; each result says one effect (2)."
            seen = rows(effects, "SELECT key FROM seen")
            # Each call was seen again after the restart, with its own key, ...
            assert sorted(seen) == sorted(before * 2)
            # ... and wrote its effect once.
            assert sorted(rows(effects, "SELECT key FROM effects")) == sorted(before)
            # The restart re-sent the calls: the model was not asked again for them.
            assert model.decisions == ["charge", "answer"]
            deliverables = store.rows(
                "SELECT count(*) FROM cards WHERE card_type = 'task.deliverable'"
            )
            assert deliverables == [(1,)]
        finally:
            for s in servers:
                await trio.to_thread.run_sync(s.stop)
            nursery.cancel_scope.cancel()
