"""The pump's routing rules, end to end in one process (no sockets)."""

from __future__ import annotations

import base64

import pytest
import trio
import trio.testing
from conftest import (
    NS,
    Add,
    Note,
    Ping,
    Pong,
    Sum,
    buffered,
    drain,
    envelope_bytes,
    huh_text,
    is_huh,
    is_system_error,
    local,
    parse_reply,
    receive,
)
from lxml import etree

from agentserver.core.errors import ConfigurationError, HuhReason
from agentserver.core.listener import HandlerMetadata, HandlerResponse, Listener
from agentserver.core.threads import is_uuid4
from agentserver.core.usage import RESPOND_WARNING
from agentserver.pump.pump import PumpConfig, open_pump


async def echo(p: Ping, meta: HandlerMetadata):
    return HandlerResponse.respond(Pong(text=p.text))


def echo_listener(**kw) -> Listener:
    return Listener("echo", (Ping,), kw.pop("handler", echo), responses=(Pong,), **kw)


def echo_after(release: trio.Event):
    """An echo handler that answers once ``release`` is set."""

    async def blocked(p: Ping, meta: HandlerMetadata):
        await release.wait()
        return HandlerResponse.respond(Pong(text=p.text))

    return blocked


async def test_echo_round_trip_sets_from_to_and_thread():
    async with open_pump([echo_listener()]) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="hi"), to="echo", sender="mallory"))
        meta, payload = await receive(ep)
        assert local(payload) == "pong" and payload[0].text == "hi"
        assert meta["from"] == "echo" and meta["to"] == "alice"
        assert is_uuid4(meta["thread"])  # "not-a-uuid" was replaced


async def test_routing_by_root_tag_without_to_and_client_uuid_thread_kept():
    async with open_pump([echo_listener()]) as pump:
        ep = pump.open_endpoint()
        thread = "0b6d2f4e-8c51-4b7a-9d3e-2f1a6c5b4e3d"
        await ep.send(envelope_bytes(Ping(text="x"), thread=thread))
        meta, payload = await receive(ep)
        assert meta["thread"] == thread and local(payload) == "pong"


async def test_handler_sees_sender_identity_not_claimed_from():
    seen = []

    async def handler(p, meta):
        seen.append(meta)
        return HandlerResponse.respond(Pong(text=p.text))

    async with open_pump([echo_listener(handler=handler)]) as pump:
        ep = pump.open_endpoint("bob")
        await ep.send(envelope_bytes(Ping(text="x"), to="echo", sender="echo"))
        await receive(ep)
    (meta,) = seen
    assert meta.from_id == "bob" and meta.own_name == "echo" and not meta.is_self_call
    assert meta.chain == ("bob", "echo")
    assert meta.usage_instructions.endswith(RESPOND_WARNING)


async def test_three_hop_forward_respond_chain():
    """client → a → b → c, then c responds to b, b to a, a to the client."""
    trace: list[tuple[str, str, tuple[str, ...]]] = []

    async def a(p, meta):
        trace.append(("a", type(p).__name__, meta.chain))
        if isinstance(p, Ping):
            return HandlerResponse(Add(a=int(p.text), b=1), to="b")
        return HandlerResponse.respond(Pong(text=str(p.value)))

    async def b(p, meta):
        trace.append(("b", type(p).__name__, meta.chain))
        if isinstance(p, Add):
            return HandlerResponse(Note(text=str(p.a + p.b)), to="c")
        return HandlerResponse.respond(Sum(value=int(p.text) * 10))

    async def c(p, meta):
        trace.append(("c", type(p).__name__, meta.chain))
        return HandlerResponse.respond(Note(text=str(int(p.text) + 100)))

    listeners = [
        Listener("a", (Ping,), a, peers=("b",), responses=(Pong,)),
        Listener("b", (Add,), b, peers=("c",), responses=(Sum,)),
        Listener("c", (Note,), c),
    ]
    async with open_pump(listeners) as pump:
        ep = pump.open_endpoint("client")
        await ep.send(envelope_bytes(Ping(text="4"), to="a"))
        meta, payload = await receive(ep)
        assert payload[0].text == "1050"  # ((4+1)+100)*10
        assert meta["from"] == "a"
        await trio.testing.wait_all_tasks_blocked()
        # Every hop thread is gone, and with them the client's finished conversation: only
        # the root thread stays.
        assert len(pump.threads) == 1
    assert [t[:2] for t in trace] == [
        ("a", "Ping"),
        ("b", "Add"),
        ("c", "Note"),
        ("b", "Note"),
        ("a", "Sum"),
    ]
    assert trace[2][2] == ("client", "a", "b", "c")
    assert trace[3][2] == ("client", "a", "b")  # pruned back to the caller


async def test_none_ends_chain_and_cleans_thread():
    async def sink(p, meta):
        return None

    async with open_pump([Listener("sink", (Note,), sink)]) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Note(text="x"), to="sink"))
        assert await drain(ep) == []
        assert len(pump.threads) == 1  # the hop and the finished conversation are gone


async def test_the_endpoint_is_told_once_per_request_that_ends_without_an_answer():
    held: list[str] = []
    pump_ref = []

    async def sink(p, meta):
        return None

    async def relay(p, meta):
        return HandlerResponse(Note(text=p.text), to="sink")

    async def keep(p, meta):
        held.append(meta.thread_id)
        pump_ref[0].hold(meta.thread_id)
        return None

    listeners = [
        Listener("sink", (Note,), sink),
        Listener("relay", (Ping,), relay, peers=("sink",)),
        Listener("keep", (Add,), keep),
    ]
    async with open_pump(listeners) as pump:
        pump_ref.append(pump)
        ended = []
        ep = pump.open_endpoint(on_chain_end=lambda: ended.append(ep.unanswered))
        await ep.send(envelope_bytes(Note(text="x"), to="sink"))  # None
        await ep.send(envelope_bytes(Ping(text="x"), to="relay"))  # the last hop's None
        await ep.send(envelope_bytes(Add(a=1, b=2), to="keep"))  # held: not ended
        assert await drain(ep) == []
        assert ended == [1, 2] and ep.unanswered == 2
        assert len(pump.threads) == 3  # the root, and the held request's conversation
        pump.release(held[0])  # given up without an answer: it ends now
        assert ended == [1, 2, 3] and len(pump.threads) == 1


async def test_concurrent_conversations_on_same_path_each_get_their_reply():
    """Two conversations client→relay→echo at once: the reference implementation keyed
    threads by chain and lost one reply. Each must arrive, on its own thread."""
    gate = trio.Event()
    arrived = 0

    async def slow_echo(p, meta):
        nonlocal arrived
        arrived += 1
        if arrived == 2:
            gate.set()
        await gate.wait()  # both conversations are in flight on the same path
        return HandlerResponse.respond(Pong(text=p.text))

    async def relay(p, meta):
        if isinstance(p, Note):
            return HandlerResponse(Ping(text=p.text), to="echo")
        return HandlerResponse.respond(Note(text="relayed " + p.text))

    listeners = [
        Listener("relay", (Note,), relay, peers=("echo",)),
        echo_listener(handler=slow_echo, concurrency=2),
    ]
    async with open_pump(listeners) as pump:
        ep = pump.open_endpoint("client")
        t1 = "11111111-1111-4111-8111-111111111111"
        t2 = "22222222-2222-4222-8222-222222222222"
        await ep.send(envelope_bytes(Note(text="one"), to="relay", thread=t1))
        await ep.send(envelope_bytes(Note(text="two"), to="relay", thread=t2))
        replies = {}
        for _ in range(2):
            meta, payload = await receive(ep)
            replies[meta["thread"]] = payload[0].text
        assert replies == {t1: "relayed one", t2: "relayed two"}
        assert await drain(ep) == []


async def test_parallel_calls_tell_answers_apart_by_response_thread():
    calls: dict[str, str] = {}
    answers: list[tuple[str, str]] = []

    async def fan(p, meta):
        if isinstance(p, Note):
            return [
                HandlerResponse(Add(a=1, b=2), to="calc"),
                HandlerResponse(Ping(text="p"), to="echo"),
            ]
        answers.append((meta.response_thread, type(p).__name__))
        if len(answers) == 2:
            return HandlerResponse.respond(Note(text="done"))
        return None  # still waiting for the other peer

    async def calc(p, meta):
        calls[meta.thread_id] = "calc"
        return HandlerResponse.respond(Sum(value=p.a + p.b))

    async def echo_rec(p, meta):
        calls[meta.thread_id] = "echo"
        return HandlerResponse.respond(Pong(text=p.text))

    listeners = [
        Listener("fan", (Note,), fan, peers=("calc", "echo")),
        Listener("calc", (Add,), calc, responses=(Sum,)),
        echo_listener(handler=echo_rec),
    ]
    async with open_pump(listeners) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Note(text="go"), to="fan"))
        _, payload = await receive(ep)
        assert payload[0].text == "done"
    assert {calls[t]: kind for t, kind in answers} == {"calc": "Sum", "echo": "Pong"}


async def test_broadcast_reaches_every_listener_concurrently():
    started = []
    both = trio.Event()

    def make(name):
        async def handler(p, meta):
            started.append(name)
            if len(started) == 3:
                both.set()
            with trio.fail_after(5):
                await both.wait()  # would deadlock if deliveries were sequential
            return HandlerResponse.respond(Pong(text=name))

        return Listener(name, (Ping,), handler, responses=(Pong,), broadcast=True)

    async with open_pump([make("b1"), make("b2"), make("b3")]) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Ping(text="all")))
        texts = sorted([(await receive(ep))[1][0].text for _ in range(3)])
        assert texts == ["b1", "b2", "b3"]


def test_shared_root_tag_requires_broadcast():
    from agentserver.pump.pump import Pump

    pump = Pump([Listener("x1", (Ping,), echo), Listener("x2", (Ping,), echo)])
    with pytest.raises(ConfigurationError, match="broadcast"):
        pump.roster.freeze()


def test_unknown_peer_is_a_configuration_error():
    from agentserver.pump.pump import Pump

    with pytest.raises(ConfigurationError, match="unknown peers"):
        Pump([Listener("x1", (Ping,), echo, peers=("ghost",))]).roster.freeze()


async def test_checks_and_system_payloads_before_the_pump_runs_are_refused_as_closed():
    """Nothing routes before run() builds the table: a call checked then, or a system
    payload injected then, gets PumpClosed (not an error from the missing table)."""
    from agentserver.core.errors import PumpClosed
    from agentserver.pump.pump import Pump

    pump = Pump([echo_listener()])
    with pytest.raises(PumpClosed):
        pump.check_call("echo", Ping(text="x"), "echo")
    with pytest.raises(PumpClosed):
        pump.check_self_call("echo", Ping(text="x"))
    with pytest.raises(PumpClosed):
        await pump.inject_system(Ping(text="x"), to="echo")


async def test_forward_to_non_peer_gets_system_error_and_thread_stays_alive():
    seen = []

    async def rogue(p, meta):
        seen.append((type(p).__name__, meta.thread_id, meta.from_id))
        if isinstance(p, Note):
            return HandlerResponse(Ping(text="sneaky"), to="echo")  # echo is not a peer
        # The SystemError arrives on the same, still-live thread: retry is possible.
        assert p.code == "routing" and p.retry_allowed
        return HandlerResponse.respond(Note(text="gave up"))

    async with open_pump([Listener("rogue", (Note,), rogue), echo_listener()]) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Note(text="x"), to="rogue"))
        _, payload = await receive(ep)
        assert payload[0].text == "gave up"
        assert pump.stats()["handled"]["echo"] == 0
    assert seen[1][0] == "SystemErrorPayload" and seen[1][2] == "system"
    assert seen[0][1] == seen[1][1]


async def test_forward_by_tag_to_non_peer_is_a_peer_violation_too():
    async def rogue(p, meta):
        if isinstance(p, Note):
            return HandlerResponse(Ping(text="sneaky"))
        return HandlerResponse.respond(Note(text=p.code))

    async with open_pump([Listener("rogue", (Note,), rogue), echo_listener()]) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Note(text="x"), to="rogue"))
        _, payload = await receive(ep)
        assert payload[0].text == "routing"


async def test_self_iteration_routes_back_with_is_self_call():
    seen = []

    async def counter(p, meta):
        seen.append((p.text, meta.is_self_call, meta.thread_id))
        n = int(p.text)
        if n < 3:
            # Own root tag, no to and no peers: self-iteration, never a peer violation.
            return HandlerResponse(Note(text=str(n + 1)))
        return HandlerResponse.respond(Note(text=f"counted {n}"))

    async with open_pump([Listener("counter", (Note,), counter)]) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Note(text="0"), to="counter"))
        _, payload = await receive(ep)
        assert payload[0].text == "counted 3"
    assert [s[1] for s in seen] == [False, True, True, True]
    assert len({s[2] for s in seen}) == 1  # the same thread throughout


async def test_self_iteration_with_explicit_to_own_name():
    seen = []

    async def it(p, meta):
        seen.append(meta.is_self_call)
        if not meta.is_self_call:
            return HandlerResponse(Note(text="again"), to=meta.own_name)
        return HandlerResponse.respond(Note(text="ok"))

    async with open_pump([Listener("it", (Note,), it)]) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Note(text="x"), to="it"))
        await receive(ep)
    assert seen == [False, True]


async def test_client_cannot_claim_is_self_call():
    seen = []

    async def it(p, meta):
        seen.append(meta.is_self_call)

    async with open_pump([Listener("it", (Note,), it)]) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Note(text="x"), to="it", sender="it"))
        await drain(ep)
    assert seen == [False]


# -- errors: exactly one answer, nothing revealed ------------------------------------------


async def _one_answer(pump, data: bytes, name: str | None = None):
    ep = pump.open_endpoint(name)
    await ep.send(data)
    replies = await drain(ep)
    assert len(replies) == 1, replies
    return parse_reply(replies[0])


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(envelope_bytes(Add(a=1, b=2), to="echo"), id="to-does-not-take-tag"),
        pytest.param(envelope_bytes(Ping(text="x"), to="ghost"), id="unknown-to"),
        pytest.param(
            envelope_bytes(etree.fromstring(b'<mystery xmlns="urn:x"><a/></mystery>')),
            id="unknown-tag",
        ),
        pytest.param(
            envelope_bytes(
                etree.fromstring(f'<ping xmlns="{NS}"><txt>x</txt></ping>'.encode()), to="echo"
            ),
            id="fails-xsd",
        ),
    ],
)
async def test_same_canned_huh_for_unknown_tag_bad_payload_and_bad_to(data):
    async with open_pump([echo_listener(), Listener("calc", (Add,), echo)]) as pump:
        meta, payload = await _one_answer(pump, data)
    assert is_huh(payload)
    assert huh_text(payload) == HuhReason.INVALID_PAYLOAD.value
    assert meta["from"] == "system"
    original = payload.findtext("{https://xml-pipeline.org/ns/core/v1}original-attempt")
    assert base64.b64decode(original) == data


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x00\xff garbage", HuhReason.MALFORMED),
        (b"<message", HuhReason.MALFORMED),
        (b"\xff\xfe<\x00m\x00", HuhReason.MALFORMED),
        (b'<?xml version="1.0"?><!DOCTYPE m [<!ENTITY a "b">]><m>&a;</m>', HuhReason.MALFORMED),
        (b"<message xmlns='https://xml-pipeline.org/ns/envelope/v1'/>", HuhReason.INVALID_ENVELOPE),
        (b"<ping xmlns='urn:test:pump'><text>x</text></ping>", HuhReason.INVALID_ENVELOPE),
    ],
)
async def test_malformed_input_gets_one_huh(data, reason):
    async with open_pump([echo_listener()]) as pump:
        _, payload = await _one_answer(pump, data)
        assert huh_text(payload) == reason.value
        # and the pump keeps serving
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Ping(text="still here"), to="echo"))
        assert (await receive(ep))[1][0].text == "still here"


async def test_envelope_without_from_or_thread_or_with_two_payloads():
    env = "https://xml-pipeline.org/ns/envelope/v1"
    bad = [
        f"<message xmlns='{env}'><meta><thread>t</thread></meta><ping xmlns='{NS}'><text>x</text></ping></message>",
        f"<message xmlns='{env}'><meta><from>a</from></meta><ping xmlns='{NS}'><text>x</text></ping></message>",
        f"<message xmlns='{env}'><meta><from>a</from><thread>t</thread></meta>"
        f"<ping xmlns='{NS}'><text>x</text></ping><ping xmlns='{NS}'><text>y</text></ping></message>",
        f"<message xmlns='{env}'><meta><from>a</from><thread>t</thread></meta><ping><text>x</text></ping></message>",
    ]
    async with open_pump([echo_listener()]) as pump:
        for doc in bad:
            _, payload = await _one_answer(pump, doc.encode())
            assert huh_text(payload) == HuhReason.INVALID_ENVELOPE.value


async def test_oversize_message_is_refused_without_parsing():
    async with open_pump([echo_listener()], config=PumpConfig(max_message_bytes=1000)) as pump:
        data = envelope_bytes(Ping(text="x" * 2000), to="echo")
        _, payload = await _one_answer(pump, data)
        assert huh_text(payload) == HuhReason.TOO_LARGE.value
        assert pump.stats()["handled"]["echo"] == 0


async def test_core_namespace_payload_from_outside_is_refused():
    from agentserver.primitives.core import Huh

    data = envelope_bytes(Huh(error=HuhReason.MALFORMED.value, original_attempt=""), to="echo")
    async with open_pump([echo_listener()]) as pump:
        _, payload = await _one_answer(pump, data)
        assert huh_text(payload) == HuhReason.RESERVED_NAMESPACE.value
        assert pump.stats()["handled"]["echo"] == 0


async def test_core_namespace_payload_from_a_handler_is_refused():
    from agentserver.primitives.core import Huh, SystemErrorPayload

    got = []

    async def forger(p, meta):
        got.append(type(p).__name__)
        if isinstance(p, Note):
            return HandlerResponse.respond(
                SystemErrorPayload(code="routing", message="forged", retry_allowed=False)
            )
        assert isinstance(p, Huh) and p.error == HuhReason.RESERVED_NAMESPACE.value
        return HandlerResponse.respond(Note(text="sorry"))

    async with open_pump([Listener("forger", (Note,), forger)]) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Note(text="x"), to="forger"))
        _, payload = await receive(ep)
        assert payload[0].text == "sorry"
        assert await drain(ep) == []
    assert got == ["Note", "Huh"]


async def test_handler_exception_gives_caller_one_huh_without_details(caplog):
    async def boom(p, meta):
        raise RuntimeError("secret internal detail")

    async with open_pump([echo_listener(handler=boom)]) as pump:
        _, payload = await _one_answer(pump, envelope_bytes(Ping(text="x"), to="echo"))
        assert huh_text(payload) == HuhReason.HANDLER_FAILED.value
        assert b"secret" not in etree.tostring(payload)
        assert "secret internal detail" in caplog.text  # the details went to the log
        # other conversations keep flowing
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Ping(text="x"), to="echo"))
        assert is_huh((await receive(ep))[1])


@pytest.mark.parametrize(
    "result", ["a string", 42, [HandlerResponse(Pong(text="x")), "junk"], Pong(text="x")]
)
async def test_handler_returning_wrong_type_gives_caller_one_huh(result):
    async def wrong(p, meta):
        return result

    async with open_pump([echo_listener(handler=wrong)]) as pump:
        _, payload = await _one_answer(pump, envelope_bytes(Ping(text="x"), to="echo"))
        assert huh_text(payload) == HuhReason.HANDLER_FAILED.value


async def test_handler_timeout_gives_system_error_timeout(autojump_clock):
    async def sleepy(p, meta):
        await trio.sleep(1000)

    async def quick(p, meta):
        return HandlerResponse.respond(Sum(value=p.a + p.b))

    listeners = [
        echo_listener(handler=sleepy, timeout=2.0),
        Listener("calc", (Add,), quick, responses=(Sum,)),
    ]
    async with open_pump(listeners) as pump:
        ep = pump.open_endpoint()
        start = trio.current_time()
        await ep.send(envelope_bytes(Ping(text="x"), to="echo"))
        await ep.send(envelope_bytes(Add(a=1, b=1), to="calc"))
        first = await receive(ep, seconds=100)
        assert local(first[1]) == "sum"  # not held up by the sleeper
        _, payload = await receive(ep, seconds=100)
        elapsed = trio.current_time() - start
        assert is_system_error(payload, "timeout")
        assert 2.0 <= elapsed <= 2.0 + 2 * 0.2 + 1e-9  # within timeout + two monitor ticks
        assert await drain(ep) == []
        # the slot serves again after a timeout
        await ep.send(envelope_bytes(Add(a=2, b=2), to="calc"))
        assert (await receive(ep))[1][0].text == "4"


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_invalid_output_bounces_to_sender_then_caller_after_strikes():
    count = 0

    async def stubborn(p, meta):
        nonlocal count
        count += 1
        # Always produce an element that fails its XSD.
        return HandlerResponse.respond(
            etree.fromstring(f'<pong xmlns="{NS}"><bad/></pong>'.encode())
        )

    async with open_pump([echo_listener(handler=stubborn)]) as pump:
        _, payload = await _one_answer(pump, envelope_bytes(Ping(text="x"), to="echo"))
        assert huh_text(payload) == HuhReason.HANDLER_FAILED.value
    assert count == 4  # the original + MAX_STRIKES bounces of <huh>


def original_attempt(payload: etree._Element) -> bytes:
    return base64.b64decode(
        payload.findtext("{https://xml-pipeline.org/ns/core/v1}original-attempt")
    )


async def test_refused_output_never_reaches_the_caller_in_its_huh():
    """After MAX_STRIKES refused outputs the caller gets a <huh>: it echoes nothing of
    the listener's output (which may hold internal data), only what the caller sent."""

    async def leaky(p, meta):
        return HandlerResponse.respond(
            etree.fromstring(f'<pong xmlns="{NS}"><bad>INTERNAL-SECRET</bad></pong>'.encode())
        )

    data = envelope_bytes(Ping(text="mine"), to="echo")
    async with open_pump([echo_listener(handler=leaky)]) as pump:
        _, payload = await _one_answer(pump, data)
    assert huh_text(payload) == HuhReason.HANDLER_FAILED.value
    echoed = original_attempt(payload)
    assert b"INTERNAL-SECRET" not in echoed
    assert echoed in (b"", data)


async def test_a_peers_answer_never_reaches_the_caller_in_its_huh():
    """A handler that fails on a peer's answer: its caller's <huh> does not carry that
    answer (the caller never sent it)."""

    async def ask(p, meta):
        if isinstance(p, Ping):
            return HandlerResponse(Add(a=1, b=2), to="calc")
        raise RuntimeError("cannot use the answer")

    async def calc(p, meta):
        return HandlerResponse.respond(Sum(value=-424242))

    listeners = [
        Listener("asker", (Ping,), ask, peers=("calc",), responses=(Pong,)),
        Listener("calc", (Add,), calc, responses=(Sum,)),
    ]
    data = envelope_bytes(Ping(text="mine"), to="asker")
    async with open_pump(listeners) as pump:
        _, payload = await _one_answer(pump, data)
    assert huh_text(payload) == HuhReason.HANDLER_FAILED.value
    echoed = original_attempt(payload)
    assert b"424242" not in echoed
    assert echoed in (b"", data)


async def test_a_failure_on_the_callers_own_message_echoes_it():
    async def boom(p, meta):
        raise RuntimeError("no")

    data = envelope_bytes(Ping(text="mine"), to="echo")
    async with open_pump([echo_listener(handler=boom)]) as pump:
        _, payload = await _one_answer(pump, data)
    assert original_attempt(payload) == data


async def test_full_queue_pushes_back_on_sender():
    release = trio.Event()
    blocked = echo_after(release)

    async with open_pump([echo_listener(handler=blocked, concurrency=1, queue_size=2)]) as pump:
        ep = pump.open_endpoint()
        sent = 0

        async def sender():
            nonlocal sent
            for i in range(6):
                await ep.send(envelope_bytes(Ping(text=str(i)), to="echo"))
                sent += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            await trio.testing.wait_all_tasks_blocked()
            # one in the handler, two queued, the fourth send waits
            assert sent == 3
            assert pump.stats()["queues"]["echo"] == 2
            release.set()
        texts = [parse_reply(r)[1][0].text for r in await drain(ep)]
        assert sorted(texts) == [str(i) for i in range(6)]


async def test_waiting_senders_are_served_first_come_first_served():
    """Senders waiting for room get it in arrival order; a sender arriving later (even
    one that finds the line moving) never overtakes them."""
    order: list[str] = []
    gate = trio.Semaphore(0)

    async def gated(p, meta):
        await gate.acquire()
        order.append(p.text)
        return HandlerResponse.respond(Pong(text=p.text))

    async with open_pump([echo_listener(handler=gated, concurrency=1, queue_size=1)]) as pump:
        eps = [pump.open_endpoint() for _ in range(5)]
        async with trio.open_nursery() as nursery:
            # "0" runs, "1" is queued, "2".."4" wait in this order.
            for i, ep in enumerate(eps):
                nursery.start_soon(ep.send, envelope_bytes(Ping(text=str(i)), to="echo"))
                await trio.testing.wait_all_tasks_blocked()
            assert pump.stats()["queues"]["echo"] == 1
            assert pump.stats()["waiting"]["echo"] == 3
            gate.release()  # "0" done: "1" runs, "2" takes the freed slot
            await trio.testing.wait_all_tasks_blocked()
            late = pump.open_endpoint()
            nursery.start_soon(late.send, envelope_bytes(Ping(text="late"), to="echo"))
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(5):
                gate.release()
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["0", "1", "2", "3", "4", "late"]
        assert pump.stats()["inflight"] == 0


async def test_waiting_sender_times_out_within_a_tick_and_queues_nothing(autojump_clock):
    handled: list[str] = []

    async def blocked(p, meta):
        handled.append(p.text)
        await trio.sleep_forever()

    config = PumpConfig(delivery_timeout=2.0)
    listener = echo_listener(handler=blocked, concurrency=1, queue_size=1, timeout=1e6)
    async with open_pump([listener], config=config) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Ping(text="running"), to="echo"))
        await ep.send(envelope_bytes(Ping(text="queued"), to="echo"))
        start = trio.current_time()
        await ep.send(envelope_bytes(Ping(text="waits"), to="echo"))
        waited = trio.current_time() - start
        assert 2.0 <= waited <= 2.0 + 0.2 + 1e-9  # the tick is delivery_timeout / 10
        _, payload = await receive(ep)
        assert is_system_error(payload, "timeout")
        stats = pump.stats()
        assert stats["queues"]["echo"] == 1 and stats["inflight"] == 2
        assert handled == ["running"]
        pump.close()


async def test_cancelled_waiting_sender_leaves_nothing_behind():
    release = trio.Event()
    blocked = echo_after(release)

    async with open_pump([echo_listener(handler=blocked, concurrency=1, queue_size=1)]) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Ping(text="0"), to="echo"))
        await ep.send(envelope_bytes(Ping(text="1"), to="echo"))
        with trio.move_on_after(0.05) as scope:
            await ep.send(envelope_bytes(Ping(text="2"), to="echo"))
        assert scope.cancelled_caught
        assert pump.stats()["inflight"] == 2
        # The line is empty again: the next sender only waits for a slot.
        release.set()
        await ep.send(envelope_bytes(Ping(text="3"), to="echo"))
        texts = [parse_reply(await ep.receive())[1][0].text for _ in range(3)]
        assert sorted(texts) == ["0", "1", "3"]
        assert await drain(ep) == []


async def test_shutdown_refuses_senders_still_waiting(autojump_clock):
    async def stuck(p, meta):
        await trio.sleep_forever()

    config = PumpConfig(delivery_timeout=1e6, drain_timeout=1.0)
    listener = echo_listener(handler=stuck, concurrency=1, queue_size=1, timeout=1e6)
    outcomes: list[str] = []
    async with trio.open_nursery() as outside:
        async with open_pump([listener], config=config) as pump:
            ep = pump.open_endpoint()
            await ep.send(envelope_bytes(Ping(text="0"), to="echo"))
            await ep.send(envelope_bytes(Ping(text="1"), to="echo"))

            async def waiting_sender():
                await ep.send(envelope_bytes(Ping(text="2"), to="echo"))
                outcomes.append("returned")

            outside.start_soon(waiting_sender)
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == []
        # The pump stopped: the waiting sender was let go, not left parked forever.
        await trio.testing.wait_all_tasks_blocked()
        assert outcomes == ["returned"]


async def test_full_queue_times_out_with_system_error(autojump_clock):
    async def blocked(p, meta):
        await trio.sleep_forever()

    config = PumpConfig(delivery_timeout=1.0)
    async with open_pump(
        [echo_listener(handler=blocked, concurrency=1, queue_size=1, timeout=1e6)], config=config
    ) as pump:
        ep = pump.open_endpoint()
        for i in range(3):
            await ep.send(envelope_bytes(Ping(text=str(i)), to="echo"))
        _, payload = await receive(ep)
        assert is_system_error(payload, "timeout")
        pump.close()


async def test_slow_endpoint_is_closed_not_buffered_forever():
    async with open_pump([echo_listener()], config=PumpConfig(endpoint_buffer=2)) as pump:
        from agentserver.core.errors import EndpointClosed

        ep = pump.open_endpoint()
        sent = 0
        with pytest.raises(EndpointClosed):
            for i in range(5):
                await ep.send(envelope_bytes(Ping(text=str(i)), to="echo"))
                sent += 1
                await trio.testing.wait_all_tasks_blocked()
        assert sent == 3  # two buffered, the third reply overflowed the buffer
        assert ep.closed and ep.overflowed
        assert pump.stats()["endpoints"] == 0


async def test_endpoint_closed_keeps_what_it_buffered_and_then_ends():
    # The outgoing channel is made lazily: an endpoint closed before anything was
    # buffered ends at once; one closed with replies waiting still hands them out.
    from agentserver.core.errors import EndpointClosed

    async with open_pump([echo_listener()]) as pump:
        idle = pump.open_endpoint()
        idle.close()
        with pytest.raises(EndpointClosed):
            await idle.receive()
        assert not idle.push(b"<late/>") and idle.dropped == 1

        busy = pump.open_endpoint()
        await busy.send(envelope_bytes(Ping(text="kept"), to="echo"))
        await trio.testing.wait_all_tasks_blocked()
        busy.close()
        _, payload = await receive(busy)
        assert payload.findtext("{urn:test:pump}text") == "kept"
        with pytest.raises(EndpointClosed):
            busy.receive_nowait()

        waiting = pump.open_endpoint()
        async with trio.open_nursery() as nursery:

            async def reader() -> None:
                with pytest.raises(EndpointClosed):
                    await waiting.receive()

            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            waiting.close()  # wakes the task waiting on the channel it made


async def test_shutdown_drains_queued_work():
    async def slowish(p, meta):
        await trio.sleep(0.01)
        return HandlerResponse.respond(Pong(text=p.text))

    async with open_pump([echo_listener(handler=slowish, concurrency=1)]) as pump:
        ep = pump.open_endpoint()
        for i in range(5):
            await ep.send(envelope_bytes(Ping(text=str(i)), to="echo"))
    # the block exited: close() drained the queue before the pump stopped
    replies = [parse_reply(data) for data in buffered(ep)]
    assert sorted(p[0].text for _, p in replies) == ["0", "1", "2", "3", "4"]


async def test_shutdown_refuses_what_cannot_drain(autojump_clock):
    async def stuck(p, meta):
        await trio.sleep_forever()

    config = PumpConfig(drain_timeout=1.0)
    async with open_pump(
        [echo_listener(handler=stuck, concurrency=1, timeout=1e6)], config=config
    ) as pump:
        ep = pump.open_endpoint()
        for i in range(3):
            await ep.send(envelope_bytes(Ping(text=str(i)), to="echo"))
        await trio.testing.wait_all_tasks_blocked()
    replies = [parse_reply(data) for data in buffered(ep)]
    assert len(replies) == 3
    assert all(is_system_error(p, "timeout") for _, p in replies)


async def test_pump_refuses_injection_after_close():
    from agentserver.core.errors import PumpClosed

    async with open_pump([echo_listener()]) as pump:
        ep = pump.open_endpoint()
    with pytest.raises((PumpClosed, Exception)):
        await ep.send(envelope_bytes(Ping(text="late"), to="echo"))


async def test_raw_listener_gets_validated_element():
    got = []

    async def raw(el, meta):
        got.append(el)
        return HandlerResponse.respond(Pong(text=el[0].text))

    async with open_pump([echo_listener(handler=raw, raw=True)]) as pump:
        ep = pump.open_endpoint()
        await ep.send(envelope_bytes(Ping(text="raw"), to="echo"))
        assert (await receive(ep))[1][0].text == "raw"
    assert isinstance(got[0], etree._Element)


async def test_root_thread_exists_and_system_payload_reaches_boot_listener():
    from agentserver.primitives.core import Boot

    seen = []

    async def on_boot(p, meta):
        seen.append((p.organism, meta.chain, meta.from_id))

    config = PumpConfig(organism="testorg")
    async with open_pump([Listener("boot", (Boot,), on_boot)], config=config) as pump:
        assert pump.root_thread.chain == ("system", "testorg")
        await pump.inject_system(
            Boot(organism="testorg", timestamp="2026-01-01T00:00:00Z", listener_count=1), "boot"
        )
        await trio.testing.wait_all_tasks_blocked()
        assert pump.root_thread.id in pump.threads  # pinned: never cleaned up
    assert seen == [("testorg", ("system", "testorg"), "system")]


async def test_client_cannot_hijack_another_partys_thread():
    seen = []
    release = trio.Event()

    async def relay(p, meta):
        seen.append(meta.thread_id)
        await release.wait()  # keeps the conversations live
        return None

    async with open_pump([Listener("relay", (Note,), relay, concurrency=2)]) as pump:
        a = pump.open_endpoint("a")
        b = pump.open_endpoint("b")
        thread = "33333333-3333-4333-8333-333333333333"
        await a.send(envelope_bytes(Note(text="x"), to="relay", thread=thread))
        await drain(a)
        await b.send(envelope_bytes(Note(text="x"), to="relay", thread=thread))
        await drain(b)
        roots = [r for r in pump.threads._threads.values() if r.parent is None]
        assert {r.chain for r in roots} >= {("a",), ("b",)}
        b_root = next(r for r in roots if r.chain == ("b",))
        assert b_root.id != thread
        release.set()


async def test_endpoint_restricted_to_allowed_listeners():
    async with open_pump([echo_listener(), Listener("calc", (Add,), echo)]) as pump:
        ep = pump.open_endpoint("limited", allowed=["calc"])
        await ep.send(envelope_bytes(Ping(text="x"), to="echo"))
        (reply,) = await drain(ep)
        assert huh_text(parse_reply(reply)[1]) == HuhReason.INVALID_PAYLOAD.value
