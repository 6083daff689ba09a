"""The synchronous fast path: a client's request to a ``sync=True`` listener is handled in
the injecting task, and every outcome other than a valid answer gets the general path's
semantics (threads made then, refusals, bounces, forwards, failures)."""

from __future__ import annotations

import base64

import pytest
import trio
from conftest import (
    NS,
    Add,
    Ping,
    Pong,
    Sum,
    envelope_bytes,
    huh_text,
    is_huh,
    local,
    receive,
)
from lxml import etree

from agentserver.core.errors import ConfigurationError
from agentserver.core.listener import HandlerMetadata, HandlerResponse, Listener
from agentserver.core.threads import is_uuid4
from agentserver.pump.pump import PumpConfig, open_pump


def pong(text: str | None) -> etree._Element:
    el = etree.Element(f"{{{NS}}}pong", nsmap={None: NS})
    if text is not None:
        etree.SubElement(el, f"{{{NS}}}text").text = text
    return el


def sync_echo(p: etree._Element, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(pong(p[0].text))


def sync_listener(handler=sync_echo, **kw) -> Listener:
    return Listener("echo", (Ping,), handler, responses=(Pong,), raw=True, sync=True, **kw)


def test_sync_needs_raw_and_a_plain_function():
    with pytest.raises(ConfigurationError, match="raw"):
        Listener("echo", (Ping,), sync_echo, sync=True)

    async def coroutine_echo(p, meta):
        return None

    with pytest.raises(ConfigurationError, match="plain function"):
        Listener("echo", (Ping,), coroutine_echo, raw=True, sync=True)


async def test_answered_in_the_injecting_task_with_no_thread_or_queue():
    seen: list[HandlerMetadata] = []
    tasks: list[object] = []

    def handler(p, meta):
        seen.append(meta)
        tasks.append(trio.lowlevel.current_task())
        return sync_echo(p, meta)

    thread = "0b6d2f4e-8c51-4b7a-9d3e-2f1a6c5b4e3d"
    async with open_pump([sync_listener(handler)]) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="hi"), thread=thread, sender="mallory"))
        # Answered before send returned: nothing was queued for a worker.
        data = ep.receive_nowait()
        assert tasks == [trio.lowlevel.current_task()]
        assert len(pump.threads) == 1  # only the pump's root: no conversation, no hop
        stats = pump.stats()
        assert stats["delivered"] == 1 and stats["sent"] == 1 and stats["handled"]["echo"] == 1
    root = etree.fromstring(data)
    assert root[0][0].text == "echo" and root[0][1].text == "alice" and root[0][2].text == thread
    assert local(root[1]) == "pong" and root[1][0].text == "hi"
    (meta,) = seen
    assert is_uuid4(meta.thread_id) and meta.thread_id != thread
    assert meta.from_id == "alice" and meta.own_name == "echo" and not meta.is_self_call
    assert meta.chain == ("alice", "echo") and meta.response_thread is None
    # A plain-function listener has its step's idempotency key too: its hop (issue 26).
    assert meta.idempotency_key == meta.thread_id


async def test_a_thread_that_is_not_the_clients_own_uuid4_is_replaced():
    kept = "0b6d2f4e-8c51-4b7a-9d3e-2f1a6c5b4e3d"
    async with open_pump([sync_listener()]) as pump:
        ep = pump.open_endpoint("alice")
        for thread in (kept, kept, "not-a-uuid", kept, kept.upper()):
            await ep.send(envelope_bytes(Ping(text="x"), thread=thread))
            meta, _ = await receive(ep)
            assert is_uuid4(meta["thread"])
            assert (meta["thread"] == kept) == (thread == kept)
        # Another party's thread (the pump's root) is not the client's to attach to.
        await ep.send(envelope_bytes(Ping(text="x"), thread=pump.root_thread.id))
        meta, payload = await receive(ep)
        assert meta["thread"] != pump.root_thread.id and local(payload) == "pong"


async def test_a_raising_handler_gives_the_client_huh_with_its_own_message():
    def broken(p, meta):
        raise RuntimeError("boom")

    async with open_pump([sync_listener(broken)]) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="mine")))
        _, payload = await receive(ep)
        assert is_huh(payload) and "could not be completed" in huh_text(payload)
        original = payload.findtext("{*}original-attempt")
        assert b"<text>mine</text>" in base64.b64decode(original)
        assert pump.stats()["handler_errors"] == 1
        assert len(pump.threads) == 1


async def test_an_invalid_reply_is_bounced_to_the_listener_as_the_general_path_does():
    inputs: list[str] = []

    def handler(p, meta):
        inputs.append(etree.QName(p).localname)
        if etree.QName(p).localname == "ping":
            return HandlerResponse.respond(pong(None))  # <pong> without <text>: invalid
        return HandlerResponse.respond(pong("bounced"))  # the <huh> it earned

    async with open_pump([sync_listener(handler)]) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="x")))
        _, payload = await receive(ep)
        assert local(payload) == "pong" and payload[0].text == "bounced"
        assert inputs == ["ping", "huh"]
        await trio.testing.wait_all_tasks_blocked()
        assert len(pump.threads) == 1


async def test_a_forward_makes_the_hop_the_handler_saw_and_the_answer_comes_back():
    hops: list[str] = []

    def front(p, meta):
        if etree.QName(p).localname == "ping":
            hops.append(meta.thread_id)
            add = etree.Element(f"{{{NS}}}add", nsmap={None: NS})
            etree.SubElement(add, f"{{{NS}}}a").text = p[0].text
            etree.SubElement(add, f"{{{NS}}}b").text = "1"
            return HandlerResponse(add, to="adder")
        # The peer's answer, on the sub-thread of the hop it made.
        hops.append(meta.thread_id)
        return HandlerResponse.respond(pong(p[0].text))

    async def adder(p: Add, meta):
        return HandlerResponse.respond(Sum(value=p.a + p.b))

    listeners = [
        Listener("front", (Ping,), front, peers=("adder",), responses=(Pong,), raw=True, sync=True),
        Listener("adder", (Add,), adder, responses=(Sum,)),
    ]
    async with open_pump(listeners) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="41")))
        _, payload = await receive(ep)
        assert local(payload) == "pong" and payload[0].text == "42"
        assert hops[0] == hops[1]
        await trio.testing.wait_all_tasks_blocked()
        assert len(pump.threads) == 1


async def test_hooks_given_at_creation_until_release():
    async with open_pump([sync_listener()]) as pump:
        taken: list[bytes] = []
        ended: list[int] = []

        def sink(data: bytes) -> bool:
            taken.append(data)
            return True

        ep = pump.open_endpoint("alice", sink=sink, on_chain_end=lambda: ended.append(1))
        await ep.send(envelope_bytes(Ping(text="x")))
        assert len(taken) == 1 and b"pong" in taken[0]
        with pytest.raises(trio.WouldBlock):
            ep.receive_nowait()  # the sink took it: nothing buffered
        ep.release()
        assert ep.closed and ep.sink is None and ep.on_chain_end is None
        ep.chain_ended()  # a delivery still in flight no longer reaches the owner
        assert ended == [] and ep.unanswered == 1


async def test_no_answer_ends_the_request_for_the_endpoint():
    async with open_pump([sync_listener(lambda p, meta: None)]) as pump:
        ended: list[int] = []
        ep = pump.open_endpoint("alice", on_chain_end=lambda: ended.append(1))
        await ep.send(envelope_bytes(Ping(text="x")))
        assert ended == [1] and ep.unanswered == 1
        with pytest.raises(trio.WouldBlock):
            ep.receive_nowait()


async def test_deliveries_from_listeners_go_through_its_queue():
    """A sync listener forwarded to by another listener runs in its worker as usual."""

    listeners = [
        Listener("front", (Sum,), _forwarding_front, peers=("echo",), responses=(Pong,)),
        sync_listener(),
    ]
    async with open_pump(listeners) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Sum(value=7)))
        _, payload = await receive(ep)
        assert local(payload) == "pong" and payload[0].text == "7"
        assert pump.stats()["handled"] == {"front": 2, "echo": 1}


async def _forwarding_front(p, meta):
    if isinstance(p, Sum):
        return HandlerResponse(Ping(text=str(p.value)), to="echo")
    return HandlerResponse.respond(Pong(text=p.text))


async def test_tracing_on_gives_each_fast_path_call_its_handle_span():
    from agentserver.observability import Tracing

    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    async with open_pump([sync_listener()], tracing=tracing) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="x")))
        _, payload = await receive(ep)
        assert local(payload) == "pong"
        assert len(pump.threads) == 1  # still the fast path: no thread was made
    (span,) = exporter.get_finished_spans()
    assert span.name == "handle echo" and span.parent is None


async def test_registry_limits_do_not_refuse_what_holds_no_thread():
    """A fast-path request holds no thread, so a full registry does not refuse it."""
    config = PumpConfig(max_threads=1, max_threads_per_endpoint=1)
    async with open_pump([sync_listener()], config=config) as pump:
        ep = pump.open_endpoint("alice")
        for i in range(3):
            await ep.send(envelope_bytes(Ping(text=str(i))))
            _, payload = await receive(ep)
            assert local(payload) == "pong" and payload[0].text == str(i)


async def test_tracing_on_a_fallback_runs_in_the_calls_span():
    """A forward from the fast path: the peer's handle span is the sync call's child."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agentserver.observability import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    listeners = [
        Listener(
            "front", (Ping,), _sync_front, peers=("adder",), responses=(Pong,), raw=True, sync=True
        ),
        Listener("adder", (Add,), _adder, responses=(Sum,)),
    ]
    async with open_pump(listeners, tracing=Tracing(provider)) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="1")))
        _, payload = await receive(ep)
        assert payload[0].text == "2"
    spans = {s.name: s for s in exporter.get_finished_spans() if s.name.startswith("handle")}
    first = next(s for s in exporter.get_finished_spans() if s.name == "handle front")
    assert spans["handle adder"].parent.span_id == first.context.span_id


def _sync_front(p, meta):
    if etree.QName(p).localname == "ping":
        add = etree.Element(f"{{{NS}}}add", nsmap={None: NS})
        etree.SubElement(add, f"{{{NS}}}a").text = p[0].text
        etree.SubElement(add, f"{{{NS}}}b").text = "1"
        return HandlerResponse(add, to="adder")
    return HandlerResponse.respond(pong(p[0].text))


async def _adder(p: Add, meta):
    return HandlerResponse.respond(Sum(value=p.a + p.b))
