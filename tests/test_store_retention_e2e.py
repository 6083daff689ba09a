"""Retention end to end (issue 38), a real server (a subprocess) on SQLite and PostgreSQL:
its pruner removes a finished task once its window has passed, and then ``/v1`` reads,
forks, ``agentserver export`` and ``agentserver replay`` of it answer "pruned" (404
problem+json ``pruned`` over HTTP), never a partial record; ``agentserver store stats``
and ``store prune`` work beside the running server and on its stopped store.
"""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from httputil import http_url
from llm.llm_fakes import FakeServer
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
