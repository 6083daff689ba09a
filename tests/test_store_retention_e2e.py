"""Retention end to end (issue 38), a real server (a subprocess) on SQLite and PostgreSQL:
its pruner removes a finished task once its window has passed, and then ``/v1`` reads,
forks, ``agentserver export`` and ``agentserver replay`` of it answer "pruned" (404
problem+json ``pruned`` over HTTP), never a partial record; ``agentserver store stats``
and ``store prune`` work beside the running server and on its stopped store.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import trio
from httputil import http_url
from llm_fakes import FakeServer
from serverproc import DATA, ServerProcess, cli, subprocess_env

BOOT = DATA / "agents-retention-boot.xml"
TASK_NS = "urn:agentserver:assistant"
PATIENCE = 30.0
PRUNED = "https://xml-pipeline.org/problems/pruned"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def store_env(request) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"AGENTS_TEST_STORE_URL": request.getfixturevalue("pg_url")}


async def test_a_pruned_task_reads_as_pruned(tmp_path, store_env):
    async with trio.open_nursery() as nursery:
        model = await FakeServer("openai").start(nursery)
        env = subprocess_env(RET_LLM_BASE_URL=model.base_url, RET_LLM_KEY="k", **store_env)
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(BOOT, "--http-port", "0", env=env, cwd=tmp_path)
        )
        boot = str(tmp_path / BOOT.name)
        try:
            async with httpx.AsyncClient(base_url=http_url(server), timeout=PATIENCE) as client:
                sent = await client.post(
                    "/v1/messages",
                    params={"to": "assistant"},
                    content=f'<task xmlns="{TASK_NS}"><text>hello</text></task>',
                )
                assert sent.status_code == 200, sent.text
                thread = sent.headers["Agentserver-Thread"]
                view = await client.get(f"/v1/agents/assistant/tasks/{thread}")
                assert view.status_code == 200 and view.json()["status"] == "succeeded"
                # Retention is one second, the pruner runs every 0.2 s.
                with trio.fail_after(PATIENCE):
                    while True:
                        view = await client.get(f"/v1/agents/assistant/tasks/{thread}")
                        if view.status_code == 404:
                            break
                        await trio.sleep(0.2)
                problem = view.json()
                assert view.headers["content-type"] == "application/problem+json"
                assert problem["type"] == PRUNED and problem["status"] == 404
                forked = await client.post(
                    f"/v1/agents/assistant/tasks/{thread}/fork", json={"at_step": 1}
                )
                assert forked.status_code == 404 and forked.json()["type"] == PRUNED
                never = await client.get("/v1/agents/assistant/tasks/no-such-thread")
                assert never.status_code == 404 and never.json()["type"].endswith("not-found")

            # Beside the running server.
            stats = await trio.to_thread.run_sync(
                lambda: cli("store", "stats", boot, "--json", env=env)
            )
            assert stats.returncode == 0, stats.stderr
            data = json.loads(stats.stdout)
            tables = {t["table"]: t for t in data["tables"]}
            assert tables["pruned_turns"]["rows"] == 1
            assert data["would_remove"] is not None
            if not store_env:
                assert data["server_running"] and data["auto_vacuum"] == "incremental"
            # The server's pruner holds the lease while it runs (every 0.2 s): a prune
            # beside it may be told "skipped"; one of a few attempts gets the lease.
            outs = []
            for _ in range(10):
                pruned = await trio.to_thread.run_sync(
                    lambda: cli("store", "prune", boot, "--json", env=env)
                )
                assert pruned.returncode == 0, pruned.stderr
                outs.append(json.loads(pruned.stdout.decode().splitlines()[-1]))
                if not outs[-1]["skipped"]:
                    break
                await trio.sleep(0.3)
            ran = outs[-1]
            assert ran["skipped"] is False, outs
            # It ran beside the server (on SQLite, attached to the file the server holds)
            # and found the one task already gone: the server's pruner removed it.
            assert (ran["dry_run"], ran["server_running"]) == (False, not store_env), ran
            assert ran["tasks"] == 0 and isinstance(ran["rows"], dict), ran
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()

    # The stopped server's store.
    for args in (("store", "prune", boot, "--dry-run"), ("store", "stats", boot)):
        done = await trio.to_thread.run_sync(lambda a=args: cli(*a, env=env))
        assert done.returncode == 0, done.stderr
    export = await trio.to_thread.run_sync(
        lambda: cli("export", "assistant", thread, "--boot", boot, env=env)
    )
    assert export.returncode == 2 and b"pruned" in export.stderr and export.stdout == b""
    replay = await trio.to_thread.run_sync(
        lambda: cli("replay", "assistant", thread, "--boot", boot, env=env)
    )
    assert replay.returncode == 2 and b"pruned" in replay.stderr


# -- issue 44: "pruned" is told to the task's sender (and the operators) only ---------------

TOKENS = {"alice": "alice-ret-token", "bob": "bob-ret-token", "ops": "ops-ret-token"}

CLIENTS_BOOT = """\
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="retention-clients">
  <limits hello-timeout="2" read-timeout="10" drain-timeout="1" write-timeout="2"/>
  <http wait-timeout="30"/>
  <clients>
    <client name="alice" token-env="RET_ALICE"/>
    <client name="bob" token-env="RET_BOB"/>
    <client name="ops" token-env="RET_OPS" operator="true"/>
  </clients>
  <llm max-attempts="1" timeout="60">
    <backend name="fake" provider="openai" base-url="http://127.0.0.1:9/v1"
             base-url-env="RET_LLM_BASE_URL" api-key-env="RET_LLM_KEY" timeout="60">
      <model name="m"/>
    </backend>
  </llm>
  <store path="state/agents.sqlite3" watchdog-interval="0.2"
         url-env="AGENTS_TEST_STORE_URL" lease="1" heartbeat="0.25">
    <retention finished-tasks="1s" keep-last="0" events="1s" acknowledged-replies="1s"
               step-log="1s" interval="200ms"/>
  </store>
  <listeners>
    <listener name="assistant" handler="assistant" agent="true">
      <agent model="m" max-steps="6"/>
    </listener>
  </listeners>
</organism>
"""


def _as_missing(theirs: httpx.Response, thread: str, missing: str) -> tuple[int, str, str]:
    """Status, content type and body of ``theirs`` with ``thread`` named ``missing``."""
    return (
        theirs.status_code,
        theirs.headers.get("content-type", ""),
        theirs.text.replace(thread, missing),
    )


def _as_is(response: httpx.Response) -> tuple[int, str, str]:
    return response.status_code, response.headers.get("content-type", ""), response.text


async def test_a_pruned_task_is_pruned_to_its_sender_and_missing_to_another(tmp_path, store_env):
    """The tombstone names the task's sender (schema migration 17): alice (the sender) and
    the operator read "pruned" (the task view, fork, ``agentserver result`` from the store
    and over HTTP); bob gets byte for byte what a missing task answers."""
    from agentserver.core.threads import new_thread_id

    (tmp_path / "boot.xml").write_text(CLIENTS_BOOT)
    async with trio.open_nursery() as nursery:
        model = await FakeServer("openai").start(nursery)
        env = subprocess_env(
            RET_LLM_BASE_URL=model.base_url,
            RET_LLM_KEY="k",
            RET_ALICE=TOKENS["alice"],
            RET_BOB=TOKENS["bob"],
            RET_OPS=TOKENS["ops"],
            **store_env,
        )
        env.pop("AGENTSERVER_HTTP_URL", None)
        env.pop("AGENTSERVER_TOKEN", None)
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(
                tmp_path / "boot.xml", "--http-port", "0", env=env, cwd=tmp_path
            )
        )
        url = http_url(server)
        clients = {
            who: httpx.AsyncClient(
                base_url=url,
                timeout=PATIENCE,
                headers={"Authorization": f"Bearer {token}"},
                limits=httpx.Limits(max_keepalive_connections=0),
            )
            for who, token in TOKENS.items()
        }
        alice, bob, ops = clients["alice"], clients["bob"], clients["ops"]

        def result(who: str, thread: str, *args: str) -> tuple[int, str]:
            done = subprocess.run(
                [sys.executable, "-m", "agentserver", "result", thread, "--client", who, *args],
                capture_output=True,
                env={**env, "AGENTSERVER_TOKEN": TOKENS[who]},
                cwd=tmp_path,
                timeout=PATIENCE,
            )
            return done.returncode, done.stderr.decode()

        try:
            thread = new_thread_id()
            sent = await alice.post(
                "/v1/messages",
                params={"to": "assistant", "thread": thread},
                content=f'<task xmlns="{TASK_NS}"><text>hello</text></task>',
            )
            assert sent.status_code == 200, sent.text
            task = f"/v1/agents/assistant/tasks/{thread}"
            with trio.fail_after(PATIENCE):
                while True:
                    if (await alice.get(task)).status_code != 200:
                        break
                    await trio.sleep(0.2)
            missing = new_thread_id()
            none = f"/v1/agents/assistant/tasks/{missing}"
            for who in (alice, ops):
                view = await who.get(task)
                assert view.status_code == 404 and view.json()["type"] == PRUNED, view.text
                forked = await who.post(f"{task}/fork", json={"at_step": 1})
                assert forked.status_code == 404 and forked.json()["type"] == PRUNED
                # The console has nothing of it to show (not a server error).
                page = await who.get(f"/ui/api/agents/assistant/tasks/{thread}")
                assert page.status_code == 404, page.text
            # bob: exactly a missing task's answer, on every door that reads it.
            for path, options in (
                ("", {}),
                ("/fork", {"json": {"at_step": 1}}),
            ):
                method = "POST" if path else "GET"
                theirs = await bob.request(method, task + path, **options)
                nothing = await bob.request(method, none + path, **options)
                assert _as_missing(theirs, thread, missing) == _as_is(nothing), path
                assert theirs.status_code == 404 and "pruned" not in theirs.text
            theirs = await bob.get(f"/ui/api/agents/assistant/tasks/{thread}")
            nothing = await bob.get(f"/ui/api/agents/assistant/tasks/{missing}")
            assert _as_missing(theirs, thread, missing) == _as_is(nothing)

            # agentserver result, from the project's store and over the HTTP API.
            for args in ((), ("--url", url)):
                status, err = await trio.to_thread.run_sync(
                    lambda a=args: result("alice", thread, *a)
                )
                assert status == 1 and "removed by retention" in err, (args, err)
                status, err = await trio.to_thread.run_sync(
                    lambda a=args: result("bob", thread, *a)
                )
                assert status == 1 and "no task sent by client 'bob'" in err, (args, err)
                assert "retention" not in err
            status, err = await trio.to_thread.run_sync(lambda: result("ops", thread, "--url", url))
            assert status == 1 and "removed by retention" in err, err
        finally:
            for client in clients.values():
                await client.aclose()
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
