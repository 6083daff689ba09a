"""Anonymous callers on a shared store are answered by the process they are connected to.

Two real servers run one boot file (no named clients) on one PostgreSQL database; an
anonymous client is connected to each and sends tasks to three agents, so many Turns run
on the other server than the one holding the caller's connection. Every task gets exactly
one answer, on the connection that sent it, and the store shows Turns that ran away from
their caller's process (their answer went through the reply outbox and a NOTIFY to the
caller's process, docs/deploy.md).
"""

from __future__ import annotations

import psycopg
import pytest
import trio
from llm_fakes import FakeServer
from serverproc import ServerProcess, subprocess_env
from test_pg_two_processes import AGENT_LISTENERS, AGENTS, DoneModel

from agentserver.core.namespaces import BOOT_NS
from agentserver.core.threads import new_thread_id
from agentserver.net.client import open_client

pytestmark = [pytest.mark.postgresql, pytest.mark.slow]

TASKS_EACH = 40
PATIENCE = 90.0

BOOT = f"""<organism xmlns="{BOOT_NS}" name="anon">
  <limits hello-timeout="2" read-timeout="5" drain-timeout="1" write-timeout="2"/>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="http://127.0.0.1:9/v1"
             base-url-env="ANON_LLM_BASE_URL" api-key-env="ANON_LLM_KEY" timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  <store url-env="ANON_STORE_URL" worker-concurrency="4" lease="2" heartbeat="0.5"/>
{AGENT_LISTENERS}</organism>
"""


async def test_anonymous_callers_answered_by_their_own_process(tmp_path, pg_url):
    boot = tmp_path / "boot.xml"
    boot.write_text(BOOT)
    model: FakeServer
    answers: dict[str, dict[str, list[str]]] = {"one": {}, "two": {}}  # per connection
    sent: dict[str, dict[str, str]] = {"one": {}, "two": {}}  # thread -> task text

    async with trio.open_nursery() as nursery:
        model = await DoneModel().start(nursery)
        env = subprocess_env(
            ANON_LLM_BASE_URL=model.base_url, ANON_LLM_KEY="k", ANON_STORE_URL=pg_url
        )
        servers: dict[str, ServerProcess] = {}
        for name in ("one", "two"):
            cwd = tmp_path / name
            cwd.mkdir()
            servers[name] = await trio.to_thread.run_sync(
                lambda cwd=cwd: ServerProcess.start(boot, env=env, cwd=cwd)
            )
        try:

            async def caller(name: str) -> None:
                server = servers[name]
                async with open_client(server.host, server.port) as client:
                    for i in range(TASKS_EACH):
                        agent, model_type = AGENTS[i % len(AGENTS)]
                        thread = new_thread_id()
                        text = f"task {i} from {name}"
                        sent[name][thread] = text
                        await client.send(model_type(text=text), to=agent, thread=thread)
                    while sum(map(len, answers[name].values())) < TASKS_EACH:
                        reply = await client.receive()
                        answers[name].setdefault(reply.thread, []).append(
                            reply.payload.findtext("{*}text") or reply.raw.decode()
                        )
                    with trio.move_on_after(1.0):  # nothing more may arrive
                        reply = await client.receive()
                        answers[name].setdefault(reply.thread, []).append("extra")

            with trio.fail_after(PATIENCE):
                async with trio.open_nursery() as callers:
                    for name in servers:
                        callers.start_soon(caller, name)
        finally:
            for server in servers.values():
                if server.proc.poll() is None:
                    await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()

    for name in ("one", "two"):
        got = {t: a for t, a in answers[name].items()}
        want = {t: [f"done: {text}"] for t, text in sent[name].items()}
        assert got == want, name
    with psycopg.connect(pg_url) as db:
        # The process that ended each Turn wrote its inbox row last (the owner trigger);
        # the reply reference names the caller's process.
        away, total = db.execute(
            "SELECT count(*) FILTER (WHERE owner <> (reply_ref::json ->> 'process')), "
            "count(*) FROM agent_inbox WHERE message_type = 'turn'"
        ).fetchone()
        assert total == 2 * TASKS_EACH
        assert away > 0, "every Turn ran on its caller's process: nothing was tested"
        pending = db.execute(
            "SELECT count(*) FROM agent_replies WHERE status <> 'sent'"
        ).fetchone()[0]
        assert pending == 0
