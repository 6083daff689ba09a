"""Remote listeners served by runners over real loopback sockets (agentserver.remote.hub)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
from functools import partial

import pytest
import trio
from idem_support import rows
from lxml import etree
from runner_handlers import NS, Query, Result, handle
from serverproc import subprocess_env
from serverutil import start_in_process

from agentserver.app.builtins import RunContext
from agentserver.config import loader as boot
from agentserver.core.envelope import encode
from agentserver.core.framing import encode_frame
from agentserver.core.listener import HandlerResponse
from agentserver.core.namespaces import CORE_NS
from agentserver.net.client import open_client
from agentserver.remote.runner import RunnerRefused, hello_frame, run_runner

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
    async with trio.open_nursery() as nursery:
        server = await start_in_process(nursery, topology, ctx, environ=ENV)
        try:
            yield server.port, server.runner_hub
        finally:
            server.shutdown.set()


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


def labelled(
    label: str,
    gate: trio.Event | None = None,
    seen: list | None = None,
    arrived: trio.Event | None = None,
):
    """A runner handler answering with ``label`` as its runner; it records the job's
    thread in ``seen`` and waits for ``gate`` first, if given."""

    async def handler(payload, meta):
        if seen is not None:
            seen.append(meta.thread_id)
        if arrived is not None:
            arrived.set()
        if gate is not None:
            await gate.wait()
        seconds = float(payload.findtext(f"{{{NS}}}seconds") or 0)
        await trio.sleep(seconds)
        return HandlerResponse.respond(Result(text=payload.findtext(f"{{{NS}}}text"), runner=label))

    return handler


async def test_jobs_spread_over_runners_within_their_concurrency():
    async with serving(boot_xml()) as (port, hub), trio.open_nursery() as nursery:
        nursery.start_soon(runner(port, handler=labelled("a"), concurrency=1))
        nursery.start_soon(runner(port, "other-runner", handler=labelled("b"), concurrency=1))
        await wait_for_runners(hub, 2)
        answers: list[str] = []
        async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:

            async def ask(i: int) -> None:
                reply = await c.request(Query(text=f"q{i}", seconds=0.2), timeout=10)
                answers.append(reply.payload.findtext(f"{{{NS}}}runner"))

            async with trio.open_nursery() as asks:
                for i in range(6):
                    asks.start_soon(ask, i)
        # Concurrency 1 each: never more than one job per runner, and both got some.
        assert sorted(answers) == ["a", "a", "a", "b", "b", "b"]
        nursery.cancel_scope.cancel()


async def test_a_reply_from_a_connection_not_given_the_job_is_ignored():
    gate, arrived = trio.Event(), trio.Event()
    seen: list[str] = []
    async with serving(boot_xml()) as (port, hub), trio.open_nursery() as nursery:
        nursery.start_soon(runner(port, handler=labelled("real", gate, seen, arrived)))
        await wait_for_runners(hub, 1)
        # A second runner that serves nothing yet: it holds no job.
        forger = await trio.open_tcp_stream("127.0.0.1", port)
        await forger.send_all(hello_frame("other-runner", ENV["RT_OTHER"]))
        async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
            thread = await c.send(Query(text="mine"), to="search")
            with trio.fail_after(5):
                await arrived.wait()
            forged = Result(text="forged", runner="forger").to_xml_tree()
            await forger.send_all(encode_frame(encode("other-runner", None, seen[0], forged)))
            with trio.move_on_after(0.5):
                early = await c.receive_on(thread)
                pytest.fail(f"the forged reply got through: {early.raw!r}")
            assert hub.counters["ignored"] == 1
            gate.set()
            with trio.fail_after(5):
                reply = await c.receive_on(thread)
        assert reply.payload.findtext(f"{{{NS}}}runner") == "real"
        await forger.aclose()
        nursery.cancel_scope.cancel()


async def test_a_client_not_declared_to_serve_a_listener_is_refused():
    async with serving(boot_xml()) as (port, hub):
        with pytest.raises(RunnerRefused):
            with trio.fail_after(5):
                await run_runner(
                    "127.0.0.1",
                    port,
                    client="search-runner",
                    token=ENV["RT_RUNNER"],
                    listener="other",
                    handler=handle,
                )
        assert hub.runners("search") == 0


async def test_a_runner_written_from_the_wire_doc_alone_serves_a_listener():
    script = pathlib.Path(__file__).with_name("raw_runner.py")
    async with serving(boot_xml()) as (port, hub), trio.open_nursery() as nursery:
        env = {**os.environ, "RAW_RUNNER_TOKEN": ENV["RT_RUNNER"]}
        # No agentserver on its path: -I ignores PYTHONPATH and the user site.
        cmd = [sys.executable, "-I", str(script), "127.0.0.1", str(port)]
        proc = await nursery.start(
            partial(trio.run_process, [*cmd, "search-runner", "search"], env=env, check=False)
        )
        await wait_for_runners(hub, 1)
        async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
            reply = await c.request(Query(text="hello"), to="search", timeout=5)
        assert reply.payload.findtext(f"{{{NS}}}text") == "HELLO"
        assert reply.payload.findtext(f"{{{NS}}}runner") == "raw"
        proc.kill()
        nursery.cancel_scope.cancel()


async def test_killing_a_runner_mid_job_moves_the_step_to_the_other(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    effects = tmp_path / "effects.sqlite3"
    env = {**subprocess_env(RUNNER_MARKS=str(marks), RUNNER_EFFECTS=str(effects)), **ENV}
    async with serving(boot_xml()) as (port, hub), trio.open_nursery() as nursery:
        procs = []
        for _ in range(2):
            cmd = [sys.executable, "-m", "agentserver", "runner", "--connect", f"127.0.0.1:{port}"]
            cmd += ["--client", "search-runner", "--token-env", "RT_RUNNER", "--listener"]
            cmd += ["search", "--handler", "runner_handlers:handle", "--concurrency", "1"]
            procs.append(await nursery.start(partial(trio.run_process, cmd, env=env, check=False)))
        await wait_for_runners(hub, 2)
        async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
            thread = await c.send(Query(text="slow", seconds=1.5), to="search")
            with trio.fail_after(10):
                while not list(marks.iterdir()):  # noqa: ASYNC110 (a file, not a trio event)
                    await trio.sleep(0.02)
            [first] = [int(p.name) for p in marks.iterdir()]
            victim = next(p for p in procs if p.pid == first)
            victim.kill()
            with trio.fail_after(15):
                reply = await c.receive_on(thread)
            survivor = next(p for p in procs if p.pid != first)
            assert reply.payload.findtext(f"{{{NS}}}runner") == str(survivor.pid)
            with trio.move_on_after(0.5):
                extra = await c.receive_on(thread)
                pytest.fail(f"answered twice: {extra.raw!r}")
        retried = [row for row in hub.step_log if row.event == "step.retried"]
        assert len(retried) == 1 and retried[0].attempt == 2
        # Both runners saw the step's one idempotency key; its effect was written once.
        seen = rows(effects, "SELECT key, pid FROM seen")
        assert len(seen) == 2 and len({k for k, _ in seen}) == 1
        assert {pid for _, pid in seen} == {p.pid for p in procs}
        assert rows(effects, "SELECT count(*) FROM effects") == [(1,)]
        for proc in procs:
            proc.kill()
        nursery.cancel_scope.cancel()


def slow_first(seconds: float, cancelled: list[str], keys: list[str] | None = None):
    """A handler whose first job takes ``seconds``, the others none; it records the jobs
    that were cancelled (by the server's <cancel>), and each job's idempotency key."""
    calls: list[str] = []
    keys = [] if keys is None else keys

    async def handler(payload, meta):
        calls.append(meta.thread_id)
        keys.append(meta.idempotency_key)
        try:
            if len(calls) == 1:
                await trio.sleep(seconds)
        except trio.Cancelled:
            cancelled.append(meta.thread_id)
            raise
        return HandlerResponse.respond(Result(text="late" if len(calls) == 1 else "ok", runner="r"))

    return handler


async def test_a_slow_runner_times_out_and_an_idempotent_step_is_retried():
    cancelled: list[str] = []
    keys: list[str] = []
    xml = boot_xml('timeout="10" step-timeout="0.5" idempotent="true"')
    async with serving(xml) as (port, hub), trio.open_nursery() as nursery:
        nursery.start_soon(runner(port, handler=slow_first(5, cancelled, keys)))
        await wait_for_runners(hub, 1)
        async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
            reply = await c.request(Query(text="q"), to="search", timeout=10)
        assert reply.payload.findtext(f"{{{NS}}}text") == "ok"
        events = [row.event for row in hub.step_log]
        assert events.count("step.retried") == 1
        assert events[-1] == "step.succeeded"
        assert len(cancelled) == 1  # the runner was told to abandon the first attempt
        # Two jobs (two wire threads), one step: the same idempotency key on both.
        assert len(keys) == 2 and keys[0] == keys[1] and keys[0] not in cancelled
        nursery.cancel_scope.cancel()


async def test_a_slow_runner_times_out_and_a_non_idempotent_step_is_not_retried():
    cancelled: list[str] = []
    xml = boot_xml('timeout="10" step-timeout="0.5"')
    async with serving(xml) as (port, hub), trio.open_nursery() as nursery:
        nursery.start_soon(runner(port, handler=slow_first(5, cancelled)))
        await wait_for_runners(hub, 1)
        async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
            reply = await c.request(Query(text="q"), to="search", timeout=10)
        assert reply.is_system_error and reply.error_text
        assert reply.payload.findtext(f"{{{CORE_NS}}}code") == "timeout"
        events = [row.event for row in hub.step_log]
        assert "step.retried" not in events and events[-1] == "step.timed_out"
        assert len(cancelled) == 1
        nursery.cancel_scope.cancel()


async def test_a_runners_invalid_answer_comes_back_to_it_as_a_huh_job():
    seen: list[str] = []

    async def sloppy(payload, meta):
        seen.append(etree.QName(payload).localname)
        if payload.tag == f"{{{CORE_NS}}}huh":
            return HandlerResponse.respond(Result(text="fixed", runner="sloppy"))
        return HandlerResponse.respond(etree.Element("{urn:test:runner}bogus"))

    async with serving(boot_xml()) as (port, hub), trio.open_nursery() as nursery:
        nursery.start_soon(runner(port, handler=sloppy))
        await wait_for_runners(hub, 1)
        async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
            reply = await c.request(Query(text="q"), to="search", timeout=5)
        assert reply.payload.findtext(f"{{{NS}}}text") == "fixed"
        assert seen == ["query", "huh"]
        nursery.cancel_scope.cancel()


async def test_the_python_runner_sends_started_only_for_a_job_still_running():
    """Against a listening socket playing the server: a job answered at once goes out as
    its answer alone (any reply counts as started); a slow one says <started/> first."""
    from agentserver.core.framing import FrameDecoder
    from agentserver.core.xmlsafe import SafeParser

    async def handler(payload, meta):
        seconds = float(payload.findtext(f"{{{NS}}}seconds") or 0)
        if seconds:
            await trio.sleep(seconds)
        return HandlerResponse.respond(Result(text="ok", runner="py"))

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    parser, decoder = SafeParser(), FrameDecoder(1 << 20)

    async def frames(stream, n: int) -> list:
        out = []
        with trio.fail_after(5):
            while len(out) < n:
                decoder.feed(await stream.receive_some(65536))
                out.extend(parser.parse(f) for f in decoder.frames())
        return out

    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner(port, handler=handler))
        with trio.fail_after(5):
            stream = await listeners[0].accept()
        hello, serve = await frames(stream, 2)
        assert hello[1].tag == f"{{{CORE_NS}}}hello" and serve[1].tag == f"{{{CORE_NS}}}serve"
        tags = {}
        for job, seconds in (("fast-job", 0.0), ("slow-job", 0.3)):
            query = Query(text="q", seconds=seconds).to_xml_tree()
            await stream.send_all(encode_frame(encode("alice", "search", job, query)))
            got = await frames(stream, 2 if seconds else 1)
            tags[job] = [(f[0][-1].text, etree.QName(f[1]).localname) for f in got]
        assert tags == {
            "fast-job": [("fast-job", "result")],
            "slow-job": [("slow-job", "started"), ("slow-job", "result")],
        }
        await stream.aclose()
        nursery.cancel_scope.cancel()
    for listener in listeners:
        await listener.aclose()
