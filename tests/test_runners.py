"""Remote listeners served by runners over real loopback sockets (agentserver.runners)."""

from __future__ import annotations

import contextlib

import trio
from runner_handlers import NS, Query, handle

from agentserver import boot
from agentserver.builtins import RunContext
from agentserver.client import open_client
from agentserver.runner import run_runner
from agentserver.server import ServeOptions, run_server

ENV = {"RT_ALICE": "alice-token", "RT_RUNNER": "runner-token", "RT_OTHER": "other-token"}


def boot_xml(search: str = 'timeout="5" idempotent="true"') -> bytes:
    return f"""<?xml version="1.0"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="runners">
  <limits drain-timeout="1" hello-timeout="2"/>
  <clients>
    <client name="alice" token-env="RT_ALICE"/>
    <client name="search-runner" token-env="RT_RUNNER" serves="search"/>
    <client name="other-runner" token-env="RT_OTHER" serves="search"/>
  </clients>
  <listeners>
    <listener name="search" remote="true" concurrency="16" {search}>
      <accepts type="runner_handlers:Query"/>
      <responds type="runner_handlers:Result"/>
    </listener>
  </listeners>
</organism>""".encode()


@contextlib.asynccontextmanager
async def serving(xml: bytes):
    """Run the server in this trio run; yields (port, hub)."""
    topology = boot.load_bytes(xml, environ=ENV).topology
    assert topology is not None
    ctx = RunContext(topology)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        ready = trio.Event()
        ports: list[int] = []

        def listening(addresses: list[str]) -> None:
            ports.append(int(addresses[0].rsplit(":", 1)[1]))
            ready.set()

        nursery.start_soon(
            lambda: run_server(
                topology,
                ServeOptions(port=0),
                ctx,
                shutdown,
                environ=ENV,
                on_listening=listening,
            )
        )
        await ready.wait()
        try:
            yield ports[0], ctx.services["runner_hub"]
        finally:
            shutdown.set()


async def wait_for_runners(hub, n: int, listener: str = "search") -> None:
    with trio.fail_after(5):
        await hub.wait_runners(listener, n)


def runner(port: int, client: str = "search-runner", handler=handle, **kw):
    token = ENV["RT_RUNNER"] if client == "search-runner" else ENV["RT_OTHER"]
    return lambda: run_runner(
        "127.0.0.1", port, client=client, token=token, listener="search", handler=handler, **kw
    )


async def test_a_python_runner_answers_a_client_request():
    async with serving(boot_xml()) as (port, hub), trio.open_nursery() as nursery:
        nursery.start_soon(runner(port))
        await wait_for_runners(hub, 1)
        async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
            replies = [await c.request(Query(text=f"q{i}"), timeout=5) for i in range(3)]
        assert [r.payload.findtext(f"{{{NS}}}text") for r in replies] == ["q0", "q1", "q2"]
        assert all(r.from_id == "search" for r in replies)
        nursery.cancel_scope.cancel()
