"""A handler is never called with a primitive its payload annotation does not admit:
the failure goes to its caller instead (docs/protocol.md, "Handlers")."""

from __future__ import annotations

from typing import Any

from conftest import Note, Ping, Pong, envelope_bytes, huh_text, is_huh, is_system_error, receive
from lxml import etree
from pydantic_xml import BaseXmlModel

from agentserver.core.errors import HuhReason
from agentserver.core.handler_types import unreadable
from agentserver.core.listener import HandlerMetadata, HandlerResponse, Listener
from agentserver.primitives.core import CORE_MODELS, Boot, Huh, SystemErrorPayload
from agentserver.pump.pump import open_pump

PRIMITIVES = (Huh, SystemErrorPayload)


async def typed(payload: Ping, meta: HandlerMetadata) -> None: ...


async def typed_or_huh(payload: Ping | Huh, meta: HandlerMetadata) -> None: ...


async def general(payload: BaseXmlModel, meta: HandlerMetadata) -> None: ...


async def anything(payload: Any, meta: HandlerMetadata) -> None: ...


async def bare(payload, meta): ...


async def unresolvable(payload: NoSuchName, meta) -> None: ...  # type: ignore[name-defined]  # noqa: F821


class CallableHandler:
    async def __call__(self, payload: Ping, meta: HandlerMetadata) -> None: ...


def test_what_an_annotation_admits():
    assert unreadable(typed, PRIMITIVES) == {Huh, SystemErrorPayload}
    assert unreadable(typed_or_huh, PRIMITIVES) == {SystemErrorPayload}
    assert unreadable(general, PRIMITIVES) == set()
    assert unreadable(anything, PRIMITIVES) == set()
    assert unreadable(bare, PRIMITIVES) == set()
    assert unreadable(unresolvable, PRIMITIVES) == set()  # trusted, as before
    assert unreadable(CallableHandler(), PRIMITIVES) == {Huh, SystemErrorPayload}
    assert unreadable(typed, PRIMITIVES, raw=True) == set()
    assert Boot in unreadable(typed, CORE_MODELS)


async def test_a_refused_answer_is_not_handed_back_to_a_handler_that_cannot_read_it():
    seen = []

    async def forgot_responds(payload: Ping, meta: HandlerMetadata) -> HandlerResponse:
        seen.append(type(payload).__name__)
        return HandlerResponse.respond(Pong(text=payload.text))  # Pong is not registered

    async with open_pump([Listener("fg", (Ping,), forgot_responds)]) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="hi"), to="fg"))
        _, payload = await receive(ep)
        assert is_huh(payload) and huh_text(payload) == HuhReason.HANDLER_FAILED.value
        # One huh, no huh inside it: the refused output is the listener's, not alice's.
        assert payload.findtext("{*}original-attempt") in (None, "")
        assert pump.counters["handler_errors"] == 0
    assert seen == ["Ping"]


async def test_a_handler_that_admits_huh_receives_it():
    seen = []

    async def careful(payload: Ping | Huh, meta: HandlerMetadata):
        seen.append(type(payload).__name__)
        if isinstance(payload, Huh):
            return HandlerResponse.respond(Note(text=f"refused: {payload.error}"))
        return HandlerResponse.respond(Pong(text=payload.text))

    async with open_pump([Listener("c", (Ping,), careful, responses=(Note,))]) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="hi"), to="c"))
        _, payload = await receive(ep)
        assert etree.QName(payload).localname == "note"
        assert payload[0].text == f"refused: {HuhReason.INVALID_PAYLOAD.value}"
    assert seen == ["Ping", "Huh"]


async def test_a_system_error_goes_up_to_the_caller_unchanged():
    async def stray(payload: Ping, meta: HandlerMetadata) -> HandlerResponse:
        return HandlerResponse(Note(text="x"), to="notes")  # not a peer

    async def notes(payload: Note, meta: HandlerMetadata) -> None:
        return None

    listeners = [Listener("stray", (Ping,), stray), Listener("notes", (Note,), notes)]
    async with open_pump(listeners) as pump:
        ep = pump.open_endpoint("alice")
        await ep.send(envelope_bytes(Ping(text="hi"), to="stray"))
        _, payload = await receive(ep)
        assert is_system_error(payload, "routing")
