"""The HTTP API's parts in process: the gateway over a real pump (MockClock for its
timeouts and TTLs), kept threads' bounds, bearer auth, problem mapping, the SSE stream's
overflow, and boot.xml's <http>."""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing
from conftest import Ping, Pong, parse_reply
from prometheus_client import CollectorRegistry

from agentserver.agents.events import ChunkEvent, EventBus
from agentserver.config import loader as boot
from agentserver.config.topology import HttpSpec, Limits
from agentserver.core.errors import DeliveryRefused, HuhReason, InputRefused, SystemErrorCode
from agentserver.core.handshake import Credential, Identity, Unauthenticated
from agentserver.core.listener import HandlerMetadata, HandlerResponse, Listener
from agentserver.http.api import SSE_BUFFER, HttpContext
from agentserver.http.auth import AnonymousRefused, HttpAuth, is_loopback_peer
from agentserver.http.gate import Gate
from agentserver.http.gateway import HttpGateway
from agentserver.http.problems import refusal_problem, reply_problem
from agentserver.http.replies import Exchange, PendingThreads
from agentserver.http.routes.events import EventRoutes
from agentserver.pump.pump import PumpConfig, open_pump

NS = "urn:test:pump"
PING = f'<ping xmlns="{NS}"><text>hi</text></ping>'.encode()


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


def listeners(delay: float = 0.0):
    async def echo(p: Ping, meta: HandlerMetadata):
        await trio.sleep(delay)
        return HandlerResponse.respond(Pong(text=p.text))

    return [Listener("echo", (Ping,), echo, responses=(Pong,))]


def spec(**kw) -> HttpSpec:
    return HttpSpec(**{"max_pending": 4, "reply_ttl": 10.0, "wait_timeout": 5.0, **kw})


async def test_a_waiting_message_gets_its_reply_and_frees_its_endpoint():
    async with open_pump(listeners()) as pump:
        gateway = HttpGateway(pump, Limits(), spec())
        out = await gateway.send(Identity(None), "echo", PING, wait=True)
        assert out.kind == "reply"
        meta, payload = parse_reply(out.reply)
        assert meta["thread"] == out.thread and payload.tag == f"{{{NS}}}pong"
        assert gateway.active == 0 and pump.stats()["endpoints"] == 0


async def test_a_named_client_gets_a_suffixed_endpoint_and_may_address(autojump_clock):
    async with open_pump(listeners()) as pump:
        gateway = HttpGateway(pump, Limits(), spec())
        out = await gateway.send(Identity("alice"), "echo", PING, wait=True)
        assert parse_reply(out.reply)[0]["to"].startswith("alice-")
        # may-address is the pump's: refused with the canned text
        out = await gateway.send(Identity("bob", frozenset({"other"})), "echo", PING, wait=True)
        assert out.kind == "reply"
        assert reply_problem(out.reply).status_code == 422


async def test_no_reply_in_time_keeps_the_thread_until_its_ttl(autojump_clock):
    async with trio.open_nursery() as nursery, open_pump(listeners(delay=8.0)) as pump:
        gateway = HttpGateway(pump, Limits(), spec())
        await nursery.start(gateway.run)
        out = await gateway.send(Identity(None), "echo", PING, wait=True)
        assert out.kind == "timeout" and gateway.active == 1
        view = gateway.thread(out.thread, None)
        assert view is not None and view.replies == []
        await trio.sleep(4.0)  # the reply comes at 8 s
        view = gateway.thread(out.thread, None)
        assert len(view.replies) == 1
        assert gateway.thread(out.thread, "alice") is None  # not hers
        await trio.sleep(20.0)  # 10 s after the reply: forgotten, endpoint closed
        assert gateway.thread(out.thread, None) is None
        assert gateway.active == 0 and pump.stats()["endpoints"] == 0
        assert gateway.counters["expired"] == 1
        nursery.cancel_scope.cancel()


async def test_max_pending_refuses_with_the_busy_system_error(autojump_clock):
    async with trio.open_nursery() as nursery, open_pump(listeners(delay=100.0)) as pump:
        gateway = HttpGateway(pump, Limits(), spec(max_pending=2, reply_ttl=1000.0))
        await nursery.start(gateway.run)
        for _ in range(2):
            assert (await gateway.send(Identity(None), "echo", PING, wait=False)).kind == "accepted"
        out = await gateway.send(Identity(None), "echo", PING, wait=False)
        assert out.kind == "refused"
        assert isinstance(out.refusal, DeliveryRefused) and out.refusal.retry_allowed
        assert refusal_problem(out.refusal).status_code == 503
        nursery.cancel_scope.cancel()


async def test_malformed_and_oversize_bodies_never_reach_the_pump():
    async with open_pump(listeners(), config=PumpConfig(max_message_bytes=1000)) as pump:
        gateway = HttpGateway(pump, Limits(max_message_bytes=1000), spec())
        out = await gateway.send(Identity(None), "echo", b"<ping", wait=True)
        assert out.refusal.reason is HuhReason.MALFORMED
        big = f'<ping xmlns="{NS}"><text>{"x" * 2000}</text></ping>'.encode()
        out = await gateway.send(Identity(None), "echo", big, wait=True)
        assert out.refusal.reason is HuhReason.TOO_LARGE
        assert pump.stats()["injected"] == 0


async def test_a_to_that_xml_cannot_carry_is_an_invalid_envelope():
    async with open_pump(listeners()) as pump:
        gateway = HttpGateway(pump, Limits(), spec())
        out = await gateway.send(Identity(None), "ec\x00ho", PING, wait=True)
        assert out.refusal.reason is HuhReason.INVALID_ENVELOPE
        assert gateway.active == 0


def test_kept_threads_are_bounded_per_thread_and_in_time():
    class FakeEndpoint:
        pass

    def open_endpoint(sink: object, on_chain_end: object) -> FakeEndpoint:
        return FakeEndpoint()

    kept = PendingThreads(max_threads=2, ttl=5.0)
    a = Exchange("a", None, open_endpoint, max_replies=2)
    for data in (b"1", b"2", b"3"):
        assert a.take(data)  # never refused: the third is dropped and counted
    assert a.replies == [b"1", b"2"] and a.dropped == 1
    assert kept.keep(a, now=0.0) is None
    first_b = Exchange("b", "bob", open_endpoint, 2)
    assert kept.keep(first_b, now=1.0) is None
    assert kept.full
    assert kept.view("b", None, now=2.0) is None and kept.view("b", "bob", now=2.0) is not None
    a.fresh = False
    kept.touch(now=4.0)  # nothing new on a: its deadline stays at 5
    assert [e.thread for e in kept.expire(now=5.0)] == ["a"]
    b = kept.view("b", "bob", now=5.5)
    assert b is not None and b.expires_in == pytest.approx(0.5)
    again = Exchange("b", "bob", open_endpoint, 2)
    # Nothing came back to the first b yet: it is held (its message may still be queued),
    # and counts; once it settles (or its time, 6.0, is up), expiry gives it back to close.
    assert kept.keep(again, now=5.6) is None and len(kept) == 2
    assert kept.expire(now=5.7) == []
    first_b.chain_ended()
    assert kept.expire(now=5.7) == [first_b] and len(kept) == 1
    # A replaced one that had its answer is given back at once.
    again.take(b"r")
    assert kept.keep(Exchange("b", "bob", open_endpoint, 2), now=5.8) is again


def test_bearer_auth():
    auth = HttpAuth(
        {
            "alice": Credential("a-token"),
            "bob": Credential("b-token", frozenset({"echo"})),
            "carol": Credential(None),  # variable unset: cannot authenticate
        }
    )
    assert auth.identify("Bearer a-token", "10.0.0.1") == Identity("alice")
    assert auth.identify("bearer  b-token ", "10.0.0.1") == Identity("bob", frozenset({"echo"}))
    for header in (None, "", "Bearer", "Basic a-token", "Bearer x", "a-token", "Bearer None"):
        with pytest.raises(Unauthenticated):
            auth.identify(header, "127.0.0.1")
    anonymous = HttpAuth({})
    assert anonymous.identify(None, "127.0.0.1") == Identity(None)
    assert anonymous.identify("Bearer whatever", "::1") == Identity(None)
    assert anonymous.identify(None, "::ffff:127.0.0.1") == Identity(None)
    for peer in ("10.1.2.3", "192.0.2.2", "::ffff:10.0.0.1", "localhost", None, "?"):
        with pytest.raises(AnonymousRefused):
            anonymous.identify(None, peer)
    assert not is_loopback_peer("fd00::2")


def test_problem_statuses_follow_the_canned_refusals():
    statuses = {
        reason: json.loads(refusal_problem(InputRefused(reason)).body)["status"]
        for reason in HuhReason
    }
    assert statuses[HuhReason.TOO_LARGE] == 413
    assert statuses[HuhReason.INVALID_PAYLOAD] == 422
    assert statuses[HuhReason.MALFORMED] == 400
    for reason in HuhReason:
        body = json.loads(refusal_problem(InputRefused(reason, "a detail")).body)
        assert body["title"] == reason.value and "detail" not in json.dumps(body)
    timeout = refusal_problem(DeliveryRefused(SystemErrorCode.TIMEOUT, retry_allowed=False))
    assert timeout.status_code == 504 and "retry-after" not in timeout.headers
    busy = refusal_problem(DeliveryRefused(SystemErrorCode.ROUTING, retry_allowed=True))
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert reply_problem(b"<message xmlns='https://xml-pipeline.org/ns/envelope/v1'/>") is None


async def test_a_slow_event_subscriber_is_dropped_not_waited_on():
    async with open_pump(listeners()) as pump:
        bus = EventBus()
        ctx = HttpContext(
            pump=pump,
            gateway=HttpGateway(pump, Limits(), spec()),
            auth=HttpAuth({}),
            registry=CollectorRegistry(),
            events=bus,
        )
        api = EventRoutes(ctx, Gate(ctx))
        sub = bus.subscribe(SSE_BUFFER)
        stream = api.stream(sub, Identity(None), None, None)
        assert (await stream.__anext__()).startswith(":")
        for i in range(SSE_BUFFER + 10):  # never blocks the publisher
            bus.publish(ChunkEvent("a", "t", "s", str(i)))
        out = [chunk async for chunk in stream]
        assert out[-1].startswith("event: overflow")
        assert "event: chunk" not in "".join(out)
        assert ctx.counters["sse_dropped"] == 1 and api.streams == 0
        bus.publish(ChunkEvent("a", "t", "s", "after"))  # its subscription is gone
        assert sub.dropped == 10


def _boot(http: str) -> boot.LoadResult:
    return boot.load_bytes(
        (
            '<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="h">'
            f"{http}<listeners><listener name='echo' handler='echo'/></listeners></organism>"
        ).encode(),
        name="boot.xml",
    )


def test_boot_http_element():
    assert _boot("").topology.http is None
    assert _boot("<http/>").topology.http == HttpSpec(line=1)
    spec_ = _boot(
        '<http host="::1" port="8080" max-pending="10" reply-ttl="2.5" max-replies="3" '
        'wait-timeout="7"/>'
    ).topology.http
    assert (spec_.host, spec_.port, spec_.max_pending, spec_.max_replies) == ("::1", 8080, 10, 3)
    assert (spec_.reply_ttl, spec_.wait_timeout) == (2.5, 7.0)
    for bad in ('<http port="70000"/>', '<http reply-ttl="0"/>', '<http colour="red"/>'):
        assert _boot(bad).topology is None, bad
    public = _boot('<http host="0.0.0.0"/>')
    assert public.topology is not None
    assert any("HTTP callers" in str(w) for w in public.warnings)


async def test_a_second_message_on_a_kept_thread_loses_neither(autojump_clock):
    """Two ``?wait=false`` messages on one thread the client chose, the first not handled
    yet (its listener busy): both are handled and answered; the second's kept exchange
    replaces the first's only for reading, the first's endpoint stays open until its
    answer (or its time) comes."""
    handled: list[str] = []

    async def slow(p: Ping, meta: HandlerMetadata):
        handled.append(p.text)
        await trio.sleep(1.0)
        return HandlerResponse.respond(Pong(text=p.text))

    one = [Listener("echo", (Ping,), slow, responses=(Pong,), concurrency=1)]
    async with trio.open_nursery() as nursery, open_pump(one) as pump:
        gateway = HttpGateway(pump, Limits(), spec(max_pending=8))
        await nursery.start(gateway.run)
        busy = await gateway.send(Identity(None), "echo", ping("busy"), wait=False)
        await trio.testing.wait_all_tasks_blocked()
        thread = "0f3a4a1e-8f0d-4c1e-9b7a-2d3c4e5f6a7b"
        first = await gateway.send(Identity(None), "echo", ping("first"), wait=False, thread=thread)
        second = await gateway.send(
            Identity(None), "echo", ping("second"), wait=False, thread=thread
        )
        assert {busy.kind, first.kind, second.kind} == {"accepted"}
        await trio.sleep(5.0)
        assert sorted(handled) == ["busy", "first", "second"]
        await trio.sleep(30.0)  # every kept thread's time is up
        assert gateway.active == 0 and pump.stats()["endpoints"] == 0
        nursery.cancel_scope.cancel()


def ping(text: str) -> bytes:
    return f'<ping xmlns="{NS}"><text>{text}</text></ping>'.encode()
