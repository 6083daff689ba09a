"""A running server on each backend (``sqlite``; ``postgresql`` when a server is
reachable): an agent calls a remote listener, then ``GET /v1/agents``, the task view,
``/metrics``' store figures, ``/readyz`` and the durable ``GET /v1/steps`` answer the same
on both, and the step log is still there after a restart."""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import Callable

import httpx
import pytest
import trio
from llm_fakes import FakeServer, Script, Seen, openai_ok
from prometheus_client.parser import text_string_to_metric_families
from runner_handlers import NS, handle
from serverutil import start_in_process

from agentserver.app.builtins import RunContext
from agentserver.config import loader as boot
from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client
from agentserver.remote.runner import run_runner

ASSISTANT = "urn:agentserver:assistant"
ENV = {"SV_ALICE": "alice-token", "SV_RUNNER": "runner-token", "OPENAI_API_KEY": "test-key"}


def boot_xml(store: str, base_url: str) -> bytes:
    return f"""<?xml version="1.0"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="store-views">
  <limits drain-timeout="1" hello-timeout="2"/>
  <clients>
    <client name="alice" token-env="SV_ALICE"/>
    <client name="search-runner" token-env="SV_RUNNER" serves="search"/>
  </clients>
  <llm>
    <backend name="openai" provider="openai" base-url="{base_url}" api-key-env="OPENAI_API_KEY">
      <model name="m"/>
    </backend>
  </llm>
  {store}
  <http host="127.0.0.1" port="0"/>
  <listeners>
    <listener name="search" remote="true" timeout="20">
      <accepts type="runner_handlers:Query"/>
      <responds type="runner_handlers:Result"/>
    </listener>
    <listener name="assistant" handler="assistant" agent="true" peers="search" timeout="60">
      <agent model="m"/>
    </listener>
  </listeners>
</organism>""".encode()


class SearchingModel(FakeServer):
    """Asks ``search`` once, then answers with what it found."""

    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        text = "\n".join(str(m.get("content", "")) for m in seen.body["messages"])
        if re.search(r"<runner>\w+</runner>", text) is None:
            return openai_ok(
                f'Searching. <query xmlns="{NS}"><text>needle</text></query>', model="m"
            )
        return openai_ok("found it", model="m")


@contextlib.asynccontextmanager
async def serving(xml: bytes):
    """run_server in this trio run with one in-process runner for ``search``; yields the
    HTTP client (alice's token) and the socket port. Leaving it shuts the server down
    and waits until it has stopped."""
    topology = boot.load_bytes(xml, environ=ENV).topology
    assert topology is not None
    ctx = RunContext(topology)
    async with trio.open_nursery() as nursery:
        server = await start_in_process(nursery, topology, ctx, environ=ENV)
        hub = server.runner_hub
        runner = trio.CancelScope()

        async def run_search_runner() -> None:
            with runner:
                await run_runner(
                    "127.0.0.1",
                    server.port,
                    client="search-runner",
                    token="runner-token",
                    listener="search",
                    handler=handle,
                )

        nursery.start_soon(run_search_runner)
        with trio.fail_after(10):
            await hub.wait_runners("search", 1)
        headers = {"authorization": "Bearer alice-token"}
        try:
            async with httpx.AsyncClient(
                base_url=server.urls[0], headers=headers, timeout=20
            ) as http:
                yield http, server.port
        finally:
            runner.cancel()
            server.shutdown.set()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path) -> tuple[str, Callable[[str], None]]:
    """boot.xml's ``<store>``, and a function running one DDL statement on that store
    from outside the server (as an operator's client would)."""
    if request.param == "sqlite":
        path = tmp_path / "agents.sqlite3"

        def sqlite_ddl(sql: str) -> None:
            with contextlib.closing(sqlite3.connect(path, timeout=10)) as db:
                db.execute(sql)

        return f'<store path="{path}"/>', sqlite_ddl
    import psycopg

    url = request.getfixturevalue("pg_url")

    def pg_ddl(sql: str) -> None:
        with psycopg.connect(url, autocommit=True) as db:
            db.execute(sql)

    return f'<store url="{url}"/>', pg_ddl


def metric(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


async def test_agents_figures_and_steps_are_served_on_every_backend(store):
    element, ddl = store
    async with trio.open_nursery() as nursery:
        model = await SearchingModel().start(nursery)
        xml = boot_xml(element, model.base_url)
        async with serving(xml) as (http, port):
            thread = new_thread_id()
            async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
                reply = await c.request(Task(text="find it"), to="assistant", thread=thread)
            assert reply.payload.findtext(f"{{{ASSISTANT}}}text") == "found it"
            agents = (await http.get("/v1/agents")).json()
            task = (await http.get(f"/v1/agents/assistant/tasks/{thread}")).json()
            missing = await http.get(f"/v1/agents/assistant/tasks/{new_thread_id()}")
            ready = (await http.get("/readyz")).json()
            metrics = (await http.get("/metrics")).text
            steps = (await http.get("/v1/steps", params={"listener": "search"})).json()
            status = (await http.get("/v1/status")).json()
            # a store that cannot answer the view: a problem the caller may retry
            await trio.to_thread.run_sync(ddl, "ALTER TABLE boxes RENAME TO boxes_away")
            broken = await http.get("/v1/agents")
            await trio.to_thread.run_sync(ddl, "ALTER TABLE boxes_away RENAME TO boxes")
            mended = (await http.get("/v1/agents")).json()
        # the same run against the same store again: the step log is still there
        async with serving(xml) as (http, _port):
            again = (await http.get("/v1/steps", params={"listener": "search"})).json()
            agents_again = (await http.get("/v1/agents")).json()
        nursery.cancel_scope.cancel()

    # The agent's version: its digest (docs/deploy.md); none of its Turns is active.
    version = agents["agents"][0]["version"]
    assert re.fullmatch(r"[0-9a-f]{12}", version), agents
    idle = {"name": "assistant", "state": "idle", "active_turn": None, "queue": 0}
    idle |= {"version": version, "versions": {}}
    assert agents == {"agents": [{**idle, "last_error": None}]}
    assert agents_again == agents == mended
    assert broken.status_code == 503 and broken.headers["retry-after"] == "5"
    assert broken.json()["type"].endswith("/store-unavailable")
    assert status["agents"] == agents["agents"]
    assert task["status"] == "succeeded" and task["thread"] == thread
    assert [(s["step"], s["status"], s["model"]) for s in task["steps"]] == [
        (1, "completed", "m"),
        (2, "completed", "m"),
    ]
    assert task["steps"][0]["tool_calls"] == 1
    assert task["usage"]["total_tokens"] == sum(s["total_tokens"] for s in task["steps"]) > 0
    assert missing.status_code == 404
    assert ready["checks"]["store"] is True
    assert metric(metrics, "agentserver_agent_inbox_lag_seconds", agent="assistant") == 0
    assert metric(metrics, "agentserver_agent_approvals_pending", agent="assistant") == 0
    assert metric(metrics, "agentserver_step_log_dropped_total") == 0
    assert steps["durable"] is True
    events = [s["event"] for s in steps["steps"]]
    assert events == ["step.dispatched", "step.succeeded"]
    assert {s["caller"] for s in steps["steps"]} == {"assistant"}
    assert again == steps
