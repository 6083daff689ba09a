"""Remote listeners called by an agent: a killed runner, the durable step log, one trace.

The server runs in this test's trio run (``run_server``) with an agent whose model is a
scripted OpenAI-compatible fake on loopback HTTP; the agent calls the remote listener
``search`` as a tool.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import sys
from functools import partial

import httpx
import trio
from llm_fakes import FakeServer, Script, Seen, openai_ok
from runner_handlers import NS
from serverproc import subprocess_env
from serverutil import start_in_process

from agentserver.app.builtins import RunContext
from agentserver.config import loader as boot
from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client

ASSISTANT = "urn:agentserver:assistant"
ENV = {"RT_ALICE": "alice-token", "RT_RUNNER": "runner-token", "OPENAI_API_KEY": "test-key"}


def boot_xml(store: str, base_url: str) -> bytes:
    return f"""<?xml version="1.0"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="runners-agent">
  <limits drain-timeout="1" hello-timeout="2"/>
  <clients>
    <client name="alice" token-env="RT_ALICE" operator="true"/>
    <client name="search-runner" token-env="RT_RUNNER" serves="search"/>
  </clients>
  <llm>
    <backend name="openai" provider="openai" base-url="{base_url}" api-key-env="OPENAI_API_KEY">
      <model name="m"/>
    </backend>
  </llm>
  <store path="{store}"/>
  <http host="127.0.0.1" port="0"/>
  <listeners>
    <listener name="search" remote="true" timeout="20" idempotent="true">
      <accepts type="runner_handlers:Query"/>
      <responds type="runner_handlers:Result"/>
    </listener>
    <listener name="assistant" handler="assistant" agent="true" peers="search" timeout="60">
      <agent model="m"/>
    </listener>
  </listeners>
</organism>""".encode()


class SearchingModel(FakeServer):
    """Asks ``search`` once (a query that takes ``seconds``), then answers with which
    runner found it."""

    def __init__(self, seconds: float) -> None:
        super().__init__("openai")
        self.seconds = seconds

    def default(self, seen: Seen) -> Script:
        text = "\n".join(str(m.get("content", "")) for m in seen.body["messages"])
        found = re.search(r"<runner>(\w+)</runner>", text)
        if found is None:
            return openai_ok(
                f'Searching. <query xmlns="{NS}"><text>needle</text>'
                f"<seconds>{self.seconds}</seconds></query>",
                model="m",
            )
        return openai_ok(f"found by {found.group(1)}", model="m")


@contextlib.asynccontextmanager
async def serving(xml: bytes, *, tracing=None):
    """run_server in this trio run; yields (socket port, HTTP URL, runner hub)."""
    topology = boot.load_bytes(xml, environ=ENV).topology
    assert topology is not None
    ctx = RunContext(topology)
    async with trio.open_nursery() as nursery:
        server = await start_in_process(nursery, topology, ctx, environ=ENV, tracing=tracing)
        try:
            yield server.port, server.urls[0], server.runner_hub
        finally:
            server.shutdown.set()


async def test_killing_the_runner_holding_an_agents_tool_call_moves_it_once(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    store = tmp_path / "agents.sqlite3"
    env = {**subprocess_env(RUNNER_MARKS=str(marks)), **ENV}
    async with trio.open_nursery() as nursery:
        model = await SearchingModel(seconds=1.5).start(nursery)
        async with serving(boot_xml(str(store), model.base_url)) as (port, url, hub):
            procs = []
            for _ in range(2):
                cmd = [sys.executable, "-m", "agentserver", "runner"]
                cmd += ["--connect", f"127.0.0.1:{port}", "--token-env", "RT_RUNNER"]
                cmd += ["--listener", "search", "--handler", "runner_handlers:handle"]
                cmd += ["--concurrency", "1"]
                procs.append(
                    await nursery.start(partial(trio.run_process, cmd, env=env, check=False))
                )
            with trio.fail_after(10):
                await hub.wait_runners("search", 2)
            async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
                thread = new_thread_id()
                await c.send(Task(text="find the needle"), to="assistant", thread=thread)
                with trio.fail_after(15):
                    while not list(marks.iterdir()):  # noqa: ASYNC110 (a file, not an event)
                        await trio.sleep(0.02)
                [first] = [int(p.name) for p in marks.iterdir()]
                victim = next(p for p in procs if p.pid == first)
                victim.kill()  # SIGKILL: no goodbye on the wire
                with trio.fail_after(20):
                    reply = await c.receive_on(thread)
                survivor = next(p for p in procs if p.pid != first)
                assert reply.from_id == "assistant"
                assert reply.payload.findtext(f"{{{ASSISTANT}}}text") == (
                    f"found by {survivor.pid}"
                )
                with trio.move_on_after(1):
                    extra = await c.receive_on(thread)
                    raise AssertionError(f"the agent answered twice: {extra.raw!r}")
            rows = await hub.step_log.rows(listener="search")
            async with httpx.AsyncClient() as http:
                got = await http.get(
                    f"{url}/v1/steps",
                    params={"listener": "search"},
                    headers={"authorization": "Bearer alice-token"},
                )
            for proc in procs:
                proc.kill()
        nursery.cancel_scope.cancel()
    # One step, dispatched twice, retried once, succeeded once; the agent is its caller.
    events = [r.event for r in rows]
    assert events == ["step.dispatched", "step.retried", "step.dispatched", "step.succeeded"]
    assert {r.caller for r in rows} == {"assistant"} and len({r.step for r in rows}) == 1
    assert rows[1].attempt == 2 and rows[-1].attempt == 2
    assert len(model.requests) == 2  # the model saw only the final outcome
    # The rows are durable: in the agent store's file, and what GET /v1/steps shows.
    assert got.status_code == 200
    body = got.json()
    assert body["durable"] is True
    assert [s["event"] for s in body["steps"]] == events
    with contextlib.closing(sqlite3.connect(store)) as db:
        stored = db.execute("SELECT event, attempt, caller FROM step_log ORDER BY seq").fetchall()
    assert [e for e, _, _ in stored] == events
    assert stored.count(("step.retried", 2, "assistant")) == 1


async def test_a_remote_tool_call_and_its_runner_are_one_trace(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind
    from runner_handlers import handle

    from agentserver.observability import Tracing
    from agentserver.remote.runner import run_runner

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with trio.open_nursery() as nursery:
        model = await SearchingModel(seconds=0).start(nursery)
        xml = boot_xml(str(tmp_path / "agents.sqlite3"), model.base_url)
        async with serving(xml, tracing=Tracing(provider)) as (port, _url, hub):
            # The runner records with the same provider (in another process it would be
            # its own, exporting to the same collector).
            nursery.start_soon(
                partial(
                    run_runner,
                    "127.0.0.1",
                    port,
                    client="search-runner",
                    token=ENV["RT_RUNNER"],
                    listener="search",
                    handler=handle,
                    tracer_provider=provider,
                )
            )
            with trio.fail_after(10):
                await hub.wait_runners("search", 1)
            async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
                reply = await c.request(Task(text="find"), to="assistant", timeout=20)
            assert reply.payload.findtext(f"{{{ASSISTANT}}}text").startswith("found by ")
        nursery.cancel_scope.cancel()

    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}

    def parent(span):
        return by_id[span.parent.span_id] if span.parent is not None else None

    (runner_span,) = [s for s in spans if s.attributes.get("agentserver.runner")]
    assert runner_span.name == "handle search" and runner_span.kind is SpanKind.CONSUMER
    assert runner_span.attributes["agentserver.runner"] == "search-runner"
    # runner handler -> the server's handle search -> execute_tool -> the Turn -> request
    chain = [runner_span]
    while parent(chain[-1]) is not None:
        chain.append(parent(chain[-1]))
    assert [s.name for s in chain] == [
        "handle search",
        "handle search",
        "execute_tool search",
        "invoke_agent assistant",
        "handle assistant",
    ]
    assert chain[-1].kind is SpanKind.SERVER  # the client's request is the root
    trace_id = chain[-1].context.trace_id
    # What the runner sent back continues the same trace: the agent got it, and its Turn
    # resumed and answered in it.
    (answer,) = [s for s in spans if s.name == "handle assistant" and parent(s) is chain[1]]
    assert answer.context.trace_id == trace_id
    runs = [s for s in spans if s.name == "invoke_agent assistant"]
    assert len(runs) == 2 and all(s.context.trace_id == trace_id for s in runs)


async def test_a_stop_sends_the_runner_holding_the_turns_tool_call_a_cancel(tmp_path):
    """``stop`` of an agent whose Turn waits on a remote tool: the runner gets
    ``<cancel>`` (its handler is cancelled), the task is answered failed at once, and the
    agent's next task runs on the same runner."""
    from lxml import etree

    from agentserver.core.namespaces import CORE_NS

    marks, cancelled = tmp_path / "marks", tmp_path / "cancelled"
    marks.mkdir()
    cancelled.mkdir()
    store = tmp_path / "agents.sqlite3"
    env = {**subprocess_env(RUNNER_MARKS=str(marks), RUNNER_CANCELLED=str(cancelled)), **ENV}
    async with trio.open_nursery() as nursery:
        model = await SearchingModel(seconds=600).start(nursery)
        async with serving(boot_xml(str(store), model.base_url)) as (port, _url, hub):
            cmd = [sys.executable, "-m", "agentserver", "runner"]
            cmd += ["--connect", f"127.0.0.1:{port}", "--token-env", "RT_RUNNER"]
            cmd += ["--listener", "search", "--handler", "runner_handlers:handle"]
            runner = await nursery.start(partial(trio.run_process, cmd, env=env, check=False))
            with trio.fail_after(10):
                await hub.wait_runners("search", 1)
            async with open_client("127.0.0.1", port, client="alice", token="alice-token") as c:
                first, second = new_thread_id(), new_thread_id()
                await c.send(Task(text="find the needle"), to="assistant", thread=first)
                await c.send(Task(text="and again"), to="assistant", thread=second)
                with trio.fail_after(15):
                    while not list(marks.iterdir()):  # noqa: ASYNC110 (a file, not an event)
                        await trio.sleep(0.02)
                stop = etree.Element(f"{{{CORE_NS}}}stop", nsmap={None: CORE_NS})
                stop.set("agent", "assistant")
                stop.set("thread", first)
                with trio.fail_after(10):
                    outcome = await c.receive_on(await c.send(stop))
                    answer = await c.receive_on(first)
                assert outcome.payload.get("count") == "1", outcome.raw
                assert answer.payload.get("status") == "failed", answer.raw
                with trio.fail_after(10):
                    while not list(cancelled.iterdir()):  # noqa: ASYNC110 (a file)
                        await trio.sleep(0.02)
                assert [p.name for p in cancelled.iterdir()] == [str(runner.pid)]
                # The next task runs at once (its model call), not when the tool would
                # have answered (600 s).
                with trio.fail_after(15):
                    while len(model.requests) < 2:  # noqa: ASYNC110 (a list, not an event)
                        await trio.sleep(0.02)
            runner.kill()
        nursery.cancel_scope.cancel()
