"""The step log without an agent store: the last rows in memory. (The durable log in the
agent store, on every backend: tests/test_store_views.py.)"""

from __future__ import annotations

from serverutil import start_in_process

from agentserver.steps.log import MemoryStepLog, StepRow


def rows(n: int, listener: str = "search") -> list[StepRow]:
    return [
        StepRow(f"s{i // 2}", listener, "assistant", i % 2, "step.x", at=float(i)) for i in range(n)
    ]


async def test_memory_log_keeps_the_last_rows():
    log = MemoryStepLog(size=3)
    for r in rows(5):
        log.append(r)
    assert [r.seq for r in log] == [3, 4, 5]
    assert [r.seq for r in await log.rows(after=3)] == [4, 5]
    assert [r.seq for r in await log.rows(step="s2")] == [5]
    assert not log.durable


async def test_steps_over_http_without_an_agent_store_are_the_memory_log():
    """GET /v1/steps on a server with no agents: the in-memory rows (durable false), only
    for callers that may address the listener, paged with after=."""
    from functools import partial

    import httpx
    import trio
    from runner_handlers import Query, handle

    from agentserver.app.builtins import RunContext
    from agentserver.config import loader as boot
    from agentserver.net.client import open_client
    from agentserver.remote.runner import run_runner

    env = {"A": "alice-token", "B": "bob-token", "R": "runner-token"}
    xml = b"""<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="steps">
  <limits drain-timeout="1"/>
  <clients>
    <client name="alice" token-env="A"/>
    <client name="bob" token-env="B" may-address="echo"/>
    <client name="search-runner" token-env="R" serves="search"/>
  </clients>
  <http host="127.0.0.1" port="0"/>
  <listeners>
    <listener name="echo" handler="echo"/>
    <listener name="search" remote="true" timeout="5">
      <accepts type="runner_handlers:Query"/><responds type="runner_handlers:Result"/>
    </listener>
  </listeners>
</organism>"""
    topology = boot.load_bytes(xml, environ=env).topology
    ctx = RunContext(topology)
    async with trio.open_nursery() as nursery:
        server = await start_in_process(nursery, topology, ctx, environ=env, timeout_s=10)
        port, url, hub = server.port, server.urls[0], server.runner_hub
        nursery.start_soon(
            partial(
                run_runner,
                "127.0.0.1",
                port,
                client="search-runner",
                token="runner-token",
                listener="search",
                handler=handle,
            )
        )
        with trio.fail_after(5):
            await hub.wait_runners("search", 1)
        async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
            for i in range(2):
                await c.request(Query(text=f"q{i}"), to="search", timeout=5)
        async with httpx.AsyncClient() as http:

            async def steps(token: str, **params) -> dict:
                got = await http.get(
                    f"{url}/v1/steps", params=params, headers={"authorization": f"Bearer {token}"}
                )
                assert got.status_code == 200, got.text
                return got.json()

            alice = await steps("alice-token")
            bob = await steps("bob-token")
            page = await steps("alice-token", after=alice["steps"][1]["seq"], limit=1)
            bad = await http.get(
                f"{url}/v1/steps?after=x", headers={"authorization": "Bearer alice-token"}
            )
        server.shutdown.set()
        nursery.cancel_scope.cancel()
    assert alice["durable"] is False
    events = [s["event"] for s in alice["steps"]]
    assert events == ["step.dispatched", "step.succeeded"] * 2
    assert {s["caller"] for s in alice["steps"]} == {"alice"}
    assert bob == {"durable": False, "steps": []}  # bob may not address search
    assert [s["seq"] for s in page["steps"]] == [alice["steps"][2]["seq"]]
    assert bad.status_code == 400
