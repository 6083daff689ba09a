"""Property tests: whatever bytes arrive, the pump never crashes and answers at most once."""

from __future__ import annotations

import trio
from conftest import NS, Ping, Pong, drain, envelope_bytes, parse_reply
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from agentserver.core.envelope import build_envelope
from agentserver.core.listener import HandlerResponse, Listener
from agentserver.core.namespaces import CORE_NS, ENVELOPE_NS
from agentserver.pump.pump import open_pump

NAMESPACES = [None, ENVELOPE_NS, CORE_NS, NS, "urn:other"]
NAMES = ["message", "meta", "from", "to", "thread", "ping", "text", "pong", "huh", "x"]
SAFE_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12)


@st.composite
def trees(draw, depth=0):
    ns = draw(st.sampled_from(NAMESPACES))
    name = draw(st.sampled_from(NAMES))
    el = etree.Element(f"{{{ns}}}{name}" if ns else name)
    if draw(st.booleans()):
        el.text = draw(SAFE_TEXT)
    if depth < 4:
        for child in draw(st.lists(trees(depth=depth + 1), max_size=3)):
            el.append(child)
    return el


@st.composite
def documents(draw):
    payload = draw(trees())
    if draw(st.booleans()):
        to = draw(st.sampled_from([None, "echo", "ghost", "x" * 200]))
        thread = draw(st.sampled_from(["t", "0b6d2f4e-8c51-4b7a-9d3e-2f1a6c5b4e3d", ""]))
        return etree.tostring(build_envelope("c", to, thread or "t", payload))
    return etree.tostring(payload)


async def echo(p, meta):
    return HandlerResponse.respond(Pong(text=p.text))


async def _check(data: bytes) -> None:
    async with open_pump([Listener("echo", (Ping,), echo, responses=(Pong,))]) as pump:
        ep = pump.open_endpoint()
        await ep.send(data)
        replies = await drain(ep)
        assert len(replies) <= 1
        for reply in replies:
            parse_reply(reply)  # every answer is a well-formed envelope
        # the pump still serves a good message
        await ep.send(envelope_bytes(Ping(text="ok"), to="echo"))
        with trio.fail_after(5):
            _, payload = parse_reply(await ep.receive())
        assert payload[0].text == "ok"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
async def test_arbitrary_bytes_never_crash_and_get_at_most_one_answer(data):
    await _check(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
async def test_arbitrary_wellformed_xml_gets_at_most_one_answer(data):
    await _check(data)
