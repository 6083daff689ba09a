"""Traces, metrics and structured logs of a running server (issue #16, part 1).

The server runs in this test's trio run (``run_server``, the CLI's composition root) so
that an SDK ``TracerProvider`` with an in-memory exporter and a ``CollectorRegistry`` can
be handed to it; clients talk to it over a real socket, the model is a real HTTP fake on
loopback. The JSON log test runs the real CLI in a subprocess.
"""

from __future__ import annotations

import io
import json
import logging
import re
from contextlib import asynccontextmanager

import pytest
import trio
from conftest import store_in
from llm_fakes import FakeServer, Script, Seen, openai_ok, openai_stream
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from serverproc import DATA, REPO, ServerProcess, subprocess_env
from serverutil import start_in_process

from agentserver.agents.events import counting
from agentserver.agents.store.sql import inbox, turns
from agentserver.app.builtins import RunContext
from agentserver.config import loader as boot
from agentserver.core.listener import HandlerResponse, Listener
from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.listeners.echo import Ping, Pong
from agentserver.net.client import open_client
from agentserver.observability import Tracing
from agentserver.observability.logs import configure_logging
from agentserver.pump.pump import open_pump

CALC = "urn:agentserver:calculator"
ASSISTANT = "urn:agentserver:assistant"

ECHO_BOOT = b"""<?xml version="1.0"?>
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="obs">
  <listeners>
    <listener name="boot" handler="system-boot"/>
    <listener name="echo" handler="echo"/>
  </listeners>
</organism>
"""


def recording() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


@asynccontextmanager
async def app(topology, *, environ, registry=None, tracing=None):
    """run_server in this trio run; yields the bound port; shuts down on exit."""
    async with trio.open_nursery() as nursery:
        server = await start_in_process(
            nursery,
            topology,
            RunContext(topology),
            environ=environ,
            registry=registry,
            tracing=tracing,
        )
        try:
            yield server.port
        finally:
            server.shutdown.set()


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """Every sample of the registry's exposition, parsed with prometheus-client's parser."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def value(all_samples, name: str, **labels: str) -> float:
    return all_samples.get((name, tuple(sorted(labels.items()))), 0.0)


def family_names(registry: CollectorRegistry) -> set[str]:
    return {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}


def by_trace(spans, trace_id: int) -> list:
    return [s for s in spans if s.context.trace_id == trace_id]


def parent_of(span, spans):
    if span.parent is None:
        return None
    (parent,) = [s for s in spans if s.context.span_id == span.parent.span_id]
    return parent


# -- the echo round trip: one trace, and the pump's counters -------------------------------


async def test_echo_round_trip_is_one_trace_and_moves_the_counters():
    topology = boot.load_bytes(ECHO_BOOT, name="obs.xml").topology
    tracing, exporter = recording()
    registry = CollectorRegistry()
    async with app(topology, environ={}, registry=registry, tracing=tracing) as port:
        before = samples(registry)
        async with open_client("127.0.0.1", port) as client:
            thread = new_thread_id()
            reply = await client.request(Ping(text="hi"), to="echo", thread=thread, timeout=10)
            assert reply.payload.tag.endswith("pong")
            # a refused message: nobody takes this payload
            refused = await client.request(Task(text="?"), to="echo", timeout=10)
            assert refused.payload.tag.endswith("huh")
            during = samples(registry)
        after = samples(registry)
    received = "agentserver_messages_received_total"
    assert value(after, received, listener="echo") - value(before, received, listener="echo") == 1
    injected = "agentserver_messages_injected_total"
    assert value(after, injected) - value(before, injected) == 2
    sent = "agentserver_messages_sent_total"
    assert value(after, sent) - value(before, sent) == 1
    refusals = {
        labels: v
        for (name, labels), v in after.items()
        if name == "agentserver_messages_refused_total"
    }
    assert sum(refusals.values()) == 1, refusals
    ((labels, _),) = refusals.items()
    assert dict(labels)["listener"].startswith("client-")
    assert value(after, "agentserver_handler_duration_seconds_count", listener="echo") >= 1
    assert value(during, "agentserver_connections") == 1
    assert value(before, "agentserver_connections") == 0
    assert value(before, "agentserver_queue_depth", listener="echo") == 0
    # no agents, no router: their metrics are not registered at all
    names = family_names(registry)
    assert not {
        n for n in names if n.startswith(("agentserver_agent", "agentserver_llm", "gen_ai"))
    }

    spans = exporter.get_finished_spans()
    # the client's message is its trace's root span; the refused one (unknown payload)
    # reached no handler, so it has none
    (handle,) = [s for s in spans if s.name == "handle echo"]
    assert by_trace(spans, handle.context.trace_id) == [handle]
    assert handle.parent is None
    assert handle.kind is SpanKind.SERVER
    assert handle.attributes["agentserver.listener"] == "echo"
    assert handle.attributes["agentserver.sender"].startswith("client-")
    hop = handle.attributes["agentserver.thread.id"]
    assert hop != thread and len(hop) == 36  # the echo's hop under the client's thread
    assert sorted(s.name for s in spans) == ["handle boot", "handle echo"]


# -- an assistant task with a tool call: one trace with the GenAI spans ----------------------


def say(seen: Seen, text: str) -> Script:
    if seen.body.get("stream"):
        words = text.split(" ")
        return openai_stream([w if i == 0 else " " + w for i, w in enumerate(words)], model="m")
    return openai_ok(text, model="m")


class OneToolModel(FakeServer):
    """Asks the calculator once, then answers with the result."""

    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        text = "\n".join(str(m.get("content", "")) for m in seen.body["messages"])
        found = re.search(r"<sum [^>]*><value>(-?\d+)</value>", text)
        if found is None:
            return say(seen, f'Let me add. <add xmlns="{CALC}"><a>2</a><b>3</b></add>')
        return say(seen, f"2+3 = {found.group(1)}.")


async def test_assistant_task_with_a_tool_call_is_one_trace(tmp_path):
    tracing, exporter = recording()
    registry = CollectorRegistry()
    async with trio.open_nursery() as nursery:
        model = await OneToolModel().start(nursery)
        environ = {
            "OPENAI_BASE_URL": model.base_url,
            "OPENAI_API_KEY": "test-key",
            "AGENTSERVER_MODEL": "m",
        }
        topology = store_in(boot.load(REPO / "boot.xml", environ=environ).topology, tmp_path)
        async with app(topology, environ=environ, registry=registry, tracing=tracing) as port:
            async with open_client("127.0.0.1", port) as client:
                thread = new_thread_id()
                reply = await client.request(
                    Task(text="2+3?"), to="assistant", thread=thread, timeout=20
                )
                assert reply.payload.findtext(f"{{{ASSISTANT}}}text") == "2+3 = 5."
            live = samples(registry)  # the store figures are refreshed only while it runs
        nursery.cancel_scope.cancel()
    assert len(model.requests) == 2

    spans = exporter.get_finished_spans()
    (request,) = [s for s in spans if s.name == "handle assistant" and s.parent is None]
    assert request.kind is SpanKind.SERVER  # the client's message: the root
    chain = by_trace(spans, request.context.trace_id)
    names = sorted(s.name for s in chain)
    assert names == sorted(
        [
            "handle assistant",  # the task (intake)
            "invoke_agent assistant",  # the Turn until it suspends on the tool call
            "chat assistant",
            "execute_tool calculator",
            "handle calculator",
            "handle assistant",  # the tool's answer
            "invoke_agent assistant",  # the Turn resumed with the result
            "chat assistant",
        ]
    ), names
    runs = [s for s in chain if s.name == "invoke_agent assistant"]
    assert all(parent_of(r, chain) is request for r in runs)
    for chat in (s for s in chain if s.name == "chat assistant"):
        assert parent_of(chat, chain) in runs
        a = chat.attributes
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "openai"
        # the bundled assistant asks for its alias; the server answers with its model
        assert a["gen_ai.request.model"] == "assistant"
        assert a["gen_ai.response.model"] == "m"
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
        assert tuple(a["gen_ai.response.finish_reasons"]) == ("stop",)
        assert "gen_ai.input.messages" not in a  # contents only when opted in
    (tool,) = [s for s in chain if s.name == "execute_tool calculator"]
    assert parent_of(tool, chain) in runs
    assert tool.attributes["gen_ai.tool.name"] == "calculator"
    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
    (calc,) = [s for s in chain if s.name == "handle calculator"]
    assert parent_of(calc, chain) is tool and calc.kind is SpanKind.CONSUMER
    (answer,) = [s for s in chain if s.name == "handle assistant" and s is not request]
    assert parent_of(answer, chain) is calc  # the tool's answer, sent by the calculator
    assert tool.attributes["gen_ai.tool.call.id"] == calc.attributes["agentserver.thread.id"]
    for run in runs:
        assert run.attributes["gen_ai.agent.name"] == "assistant"
        assert run.attributes["gen_ai.conversation.id"] == thread
        assert run.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert runs[0].attributes["gen_ai.agent.id"] == runs[1].attributes["gen_ai.agent.id"]

    got = samples(registry)
    ok = {"backend": "openai", "model": "assistant", "status": "ok"}
    assert value(got, "agentserver_llm_calls_total", **ok) == 2
    assert (
        value(
            got,
            "agentserver_llm_tokens_total",
            backend="openai",
            model="assistant",
            direction="output",
        )
        > 0
    )
    assert (
        value(
            got,
            "gen_ai_client_operation_duration_seconds_count",
            gen_ai_operation_name="chat",
            gen_ai_provider_name="openai",
            gen_ai_request_model="assistant",
            error_type="",
        )
        == 2
    )
    assert value(got, "agentserver_agent_turns_total", agent="assistant", status="succeeded") == 1
    assert value(got, "agentserver_agent_steps_total", agent="assistant") == 2
    assert value(got, "agentserver_llm_breaker_state", backend="openai", state="closed") == 1
    assert value(got, "agentserver_messages_received_total", listener="calculator") == 1
    # the store figures are wired (a snapshot the server refreshes): nothing waits
    assert live[("agentserver_agent_inbox_lag_seconds", (("agent", "assistant"),))] == 0
    assert live[("agentserver_agent_approvals_pending", (("agent", "assistant"),))] == 0


def test_message_contents_are_recorded_only_when_opted_in():
    from agentserver.llm.types import Completion, Message, Usage

    messages = [Message.user("what is 2+3?")]
    done = Completion("it is 5", "m", "openai", Usage(3, 2), "stop", 0.1)
    for opted_in in (False, True):
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracing = Tracing(provider, capture_content=opted_in)
        tracing.end_chat(tracing.start_chat("m", "assistant", messages), done, "openai")
        with tracing.execute_tool("calculator", "<add/>"):
            pass
        chat, tool = exporter.get_finished_spans()
        assert chat.attributes["gen_ai.usage.output_tokens"] == 2
        if opted_in:
            assert "what is 2+3?" in chat.attributes["gen_ai.input.messages"]
            assert chat.attributes["gen_ai.output.messages"] == "it is 5"
            assert tool.attributes["gen_ai.tool.call.arguments"] == "<add/>"
        else:
            assert not any("messages" in k or "arguments" in k for k in chat.attributes)
            assert "gen_ai.tool.call.arguments" not in tool.attributes


def test_tracing_is_switched_by_the_otel_variables():
    assert not Tracing.from_environ({}).enabled  # nothing set: off, no exporter
    disabled = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SDK_DISABLED": "true"}
    assert not Tracing.from_environ(disabled).enabled
    assert not Tracing.from_environ({"OTEL_TRACES_EXPORTER": "none"}).enabled
    on = Tracing.from_environ({"OTEL_TRACES_EXPORTER": "console", "AGENTSERVER_TRACE_CONTENT": "1"})
    assert on.enabled and on.capture_content
    on.shutdown()
    otlp = Tracing.from_environ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert otlp.enabled and not otlp.capture_content
    otlp.shutdown()  # nothing was recorded: nothing is sent


# -- logs ------------------------------------------------------------------------------------


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


async def test_json_logs_carry_the_chain_of_the_handled_message(restore_logging):
    stream = io.StringIO()
    assert configure_logging("info", "json", stream) == "json"
    seen: list[str] = []

    async def noisy(payload: Ping, meta) -> HandlerResponse:
        seen.append(meta.thread_id)
        logging.getLogger("tests.noisy").info("handling %s", payload.text)
        return HandlerResponse.respond(Pong(text=payload.text))

    listener = Listener("noisy", (Ping,), noisy, responses=(Pong,))
    async with open_pump([listener]) as pump:
        ep = pump.open_endpoint("tester")
        from lxml import etree

        from agentserver.core.envelope import build_envelope

        thread = new_thread_id()
        await ep.send(
            etree.tostring(build_envelope("tester", "noisy", thread, Ping(text="x").to_xml_tree()))
        )
        with trio.fail_after(5):
            await ep.receive()
        ep.close()
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    (record,) = [r for r in records if r.get("logger") == "tests.noisy"]
    assert record["event"] == "handling x"
    assert record["level"] == "info"
    assert record["listener"] == "noisy"
    assert record["thread"] == seen[0]
    assert record["caller_thread"] == thread
    assert "timestamp" in record


async def test_cli_json_logs_parse_line_by_line_and_carry_the_thread_id():
    server = await trio.to_thread.run_sync(
        lambda: ServerProcess.start(
            DATA / "e2e-boot.xml",
            "--log-level",
            "info",
            "--log-format",
            "json",
            env=subprocess_env(),
        )
    )
    try:
        async with open_client(server.host, server.port) as client:
            from e2e_handlers import Crash

            thread = new_thread_id()
            reply = await client.request(Crash(text="boom"), to="crash", thread=thread, timeout=10)
            assert reply.payload.tag.endswith("huh")
    finally:
        assert await trio.to_thread.run_sync(server.stop) == 0
    # Every line is one JSON object, the start-up lines included (tests/test_json_logs.py).
    records = [json.loads(line) for line in server.all_stderr().splitlines()]
    (crash,) = [r for r in records if "handler raised" in r["event"]]
    assert crash["level"] == "error"
    assert crash["listener"] == "crash"
    assert crash["caller_thread"] == thread
    assert "RuntimeError" in crash["exception"]
    (booted,) = [r for r in records if r["event"].startswith("organism e2e booted")]
    assert booted["listener"] == "boot" and re.fullmatch(r"[0-9a-f-]{36}", booted["thread"])


async def test_agent_log_records_carry_the_agent_turn_and_threads(tmp_path, restore_logging):
    from agents.agents_fakes import make_harness, task

    stream = io.StringIO()
    configure_logging("info", "json", stream)

    def broken_port(request):
        raise RuntimeError("a bug in the LLM port")

    h = make_harness(tmp_path, broken_port)
    try:
        ref = {
            "hop": new_thread_id(),
            "caller_thread": new_thread_id(),
            "chain": ["c", "assistant"],
        }
        await h.rt.enqueue("assistant", task("hello"), ref)
        await h.pump()
        (ended,) = h.task_events()
        assert ended.status == "failed"
    finally:
        await h.rt.aclose()
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    (failed,) = [r for r in records if r["event"] == "LLM port failed"]
    assert failed["agent"] == "assistant"
    assert failed["turn"] == ended.agent_turn_id
    assert failed["thread"] == ref["hop"]
    assert failed["caller_thread"] == ref["caller_thread"]
    assert "a bug in the LLM port" in failed["exception"]
    # the bindings end with the Turn's run
    import structlog

    assert structlog.contextvars.get_contextvars() == {}


@pytest.mark.parametrize("pause", [0.0, 0.002])
async def test_handler_durations_stand_for_every_call(pause):
    """Fast handlers are timed one call in 16, each timing counting for the calls it
    stands for: the histogram's count is the calls up to the last timed one."""
    from lxml import etree

    from agentserver.core.envelope import build_envelope

    async def answer(payload: Ping, meta) -> HandlerResponse:
        if pause:
            await trio.sleep(pause)
        return HandlerResponse.respond(Pong(text=payload.text))

    n = 40
    listener = Listener("answer", (Ping,), answer, responses=(Pong,), concurrency=1)
    async with open_pump([listener]) as pump:
        ep = pump.open_endpoint("tester")
        for _ in range(n):
            envelope = build_envelope(
                "tester", "answer", new_thread_id(), Ping(text="x").to_xml_tree()
            )
            await ep.send(etree.tostring(envelope))
        with trio.fail_after(10):
            for _ in range(n):
                await ep.receive()
        hist = pump.handler_latency()["answer"]
        ep.close()
    count = hist.buckets()[-1][1]
    assert n - 16 < count <= n
    if pause:
        assert count == n  # every slow call is timed
        assert hist.total >= n * pause


def test_spans_are_exported_with_otlp_to_the_endpoint_of_the_environment():
    """A collector fake on loopback (real HTTP) receives the spans as OTLP/protobuf."""
    import http.server
    import threading

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    received: list[tuple[str, str, bytes]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        tracing = Tracing.from_environ({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
        assert tracing.enabled
        with tracing.invoke_agent("assistant", "turn-1", "conv-1", None):
            pass
        tracing.shutdown()  # flushes the batch
    finally:
        server.shutdown()
        server.server_close()
    ((path, content_type, body),) = received
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    request = ExportTraceServiceRequest.FromString(body)
    (resource_spans,) = request.resource_spans
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert service["service.name"] == "agentserver"
    (span,) = resource_spans.scope_spans[0].spans
    assert span.name == "invoke_agent assistant"
    attributes = {a.key: a.value.string_value for a in span.attributes}
    assert attributes["gen_ai.conversation.id"] == "conv-1"


def test_log_format_is_text_on_a_terminal_and_json_otherwise(restore_logging):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, pipe = Terminal(), io.StringIO()
    assert configure_logging("warning", None, terminal) == "text"
    logging.getLogger("tests.fmt").warning("disk %s is full", "sda")
    logging.getLogger("tests.fmt").info("not shown below warning")
    (line,) = terminal.getvalue().splitlines()
    assert "disk sda is full" in line and "warning" in line
    assert not line.startswith("{")
    assert configure_logging("warning", None, pipe) == "json"
    logging.getLogger("tests.fmt").warning("disk %s is full", "sdb")
    (record,) = [json.loads(line) for line in pipe.getvalue().splitlines()]
    assert record["event"] == "disk sdb is full" and record["logger"] == "tests.fmt"
    with pytest.raises(ValueError):
        configure_logging("info", "xml", pipe)


# -- agent figures: a snapshot of the store, and step retries ---------------------------------


class AgentMetrics:
    """A registry with the agent metrics bound to harness ``h``'s runtime and store;
    :meth:`scrape` refreshes the store figures' snapshot first (as the server's task
    does every few seconds)."""

    def __init__(self, h) -> None:
        from agentserver.agents.store.figures import StoreFigures
        from agentserver.observability import Metrics

        self.registry = CollectorRegistry()
        self.figures = StoreFigures(h.rt.store, h.clock)
        h.rt.events.observe(
            counting(Metrics(self.registry).bind_agents(self.figures, ("assistant", "idle")))
        )

    async def scrape(self) -> dict:
        await self.figures.refresh()
        return samples(self.registry)


async def test_inbox_lag_is_the_age_of_the_oldest_waiting_task(tmp_path):
    from agents.agents_fakes import make_harness, task

    h = make_harness(tmp_path, lambda request: "done")
    metrics = AgentMetrics(h)
    registry = metrics.registry
    lag = "agentserver_agent_inbox_lag_seconds"
    try:
        assert lag not in family_names(registry)  # no snapshot yet: left out
        assert value(await metrics.scrape(), lag, agent="assistant") == 0
        await h.rt.enqueue("assistant", task("first"), {"r": 1})
        h.clock.advance(3)
        await h.rt.enqueue("assistant", task("second"), {"r": 2})
        h.clock.advance(4)
        got = await metrics.scrape()
        assert value(got, lag, agent="assistant") == 7  # the first, leased but not started
        assert got[(lag, (("agent", "idle"),))] == 0  # every agent has a sample
        (first,) = await h.rt.store.run1(inbox.claim_due, "assistant", 1)
        await h.rt.store.run(turns.start_turn, first)
        h.clock.advance(1)
        # between refreshes the snapshot's oldest task ages with the clock
        assert value(samples(registry), lag, agent="assistant") == 8
        assert value(await metrics.scrape(), lag, agent="assistant") == 5  # the second, queued
        h.clock.advance(1)
        assert value(samples(registry), lag, agent="assistant") == 6
    finally:
        await h.rt.aclose()
    # a closed store leaves the agent figures out of the scrape, and the rest of it whole
    assert not await metrics.figures.refresh()
    names = family_names(registry)
    assert lag not in names and "agentserver_agent_turns" in names


async def test_step_retries_are_counted_by_agent_and_error_kind(tmp_path):
    from agents.agents_fakes import make_harness, task

    from agentserver.agents.errors import LLMUnavailable

    h = make_harness(tmp_path, lambda request: "done")
    registry = AgentMetrics(h).registry
    failures = ["OVERLOADED", "RATE_LIMIT", "OVERLOADED"]
    complete = h.llm.complete

    async def flaky(request):
        if failures:
            kind = failures.pop(0)
            raise LLMUnavailable(f"{kind} from the fake", kind=kind, retry_after=1)
        return await complete(request)

    h.llm.complete = flaky
    try:
        await h.rt.enqueue("assistant", task("x"), {"r": 1})
        await h.pump()
        retries = "agentserver_agent_step_retries_total"
        assert value(samples(registry), retries, agent="assistant", kind="OVERLOADED") == 1
        for _ in range(2):
            h.clock.advance(1)
            await h.pump()
        got = samples(registry)
        assert value(got, retries, agent="assistant", kind="OVERLOADED") == 2
        assert value(got, retries, agent="assistant", kind="RATE_LIMIT") == 1
        h.clock.advance(1)
        await h.pump()
        assert [(r[1], r[2]) for r in h.replies.sent] == [("done", False)]
        got = samples(registry)
        assert value(got, retries, agent="assistant", kind="OVERLOADED") == 2
        assert value(got, "agentserver_agent_steps_total", agent="assistant") == 4
    finally:
        await h.rt.aclose()


async def test_pending_approvals_are_counted_until_decided(tmp_path):
    import dataclasses

    from agents.agents_fakes import make_harness, profile, task
    from lxml import etree

    from agentserver.agents.policy.evaluate import parse_policy
    from agentserver.core.namespaces import BOOT_NS

    rule = etree.fromstring(
        f'<policy xmlns="{BOOT_NS}" default="allow">'
        '<rule priority="1" id="ask" decision="require-approval" target="calculator" '
        'approver="alice" timeout="5m"/></policy>'
    )
    assistant = dataclasses.replace(profile(), policy=parse_policy(rule))
    add = '<add xmlns="urn:calc"><a>1</a><b>2</b></add>'
    h = make_harness(tmp_path, lambda request: add, profiles={"assistant": assistant})
    metrics = AgentMetrics(h)
    pending = "agentserver_agent_approvals_pending"
    try:
        assert value(await metrics.scrape(), pending, agent="assistant") == 0
        await h.rt.enqueue("assistant", task("add"), {"r": 1})
        await h.pump()
        (request_id,) = h.sql("SELECT request_id FROM approvals WHERE status = 'pending'")[0]
        assert value(await metrics.scrape(), pending, agent="assistant") == 1
        assert await h.rt.approvals.decide(request_id, False, "no", "alice") == "applied"
        assert value(samples(metrics.registry), pending, agent="assistant") == 1  # the snapshot
        assert value(await metrics.scrape(), pending, agent="assistant") == 0
    finally:
        await h.rt.aclose()
