"""Handlers and payloads of the end-to-end test topology (tests/data/e2e-boot.xml).

Imported by the server subprocess (tests/ is on its PYTHONPATH) and by the tests.
"""

from __future__ import annotations

import os

import trio
from pydantic_xml import BaseXmlModel, element

from agentserver.core.listener import HandlerMetadata, HandlerResponse
from agentserver.listeners.echo import Ping
from agentserver.primitives.core import SystemErrorPayload

NS = "urn:test:e2e"
_NSMAP = {"": NS}


class Job(BaseXmlModel, tag="job", nsmap=_NSMAP):
    text: str = element()
    seconds: float = element(default=0.0)


class LongJob(BaseXmlModel, tag="long-job", nsmap=_NSMAP):
    text: str = element()
    seconds: float = element()


class Crash(BaseXmlModel, tag="crash", nsmap=_NSMAP):
    text: str = element()


class Wrong(BaseXmlModel, tag="wrong", nsmap=_NSMAP):
    text: str = element()


class Relay(BaseXmlModel, tag="relay", nsmap=_NSMAP):
    text: str = element()


class Record(BaseXmlModel, tag="record", nsmap=_NSMAP):
    text: str = element()


class Silent(BaseXmlModel, tag="silent", nsmap=_NSMAP):
    text: str = element()


class Note(BaseXmlModel, tag="note", nsmap=_NSMAP):
    text: str = element()


async def slow(payload: Job, meta: HandlerMetadata) -> HandlerResponse:
    """Answers after ``seconds`` (the listener's timeout may cut it short)."""
    await trio.sleep(payload.seconds)
    return HandlerResponse.respond(Note(text=payload.text))


async def slower(payload: LongJob, meta: HandlerMetadata) -> HandlerResponse:
    await trio.sleep(payload.seconds)
    return HandlerResponse.respond(Note(text=payload.text))


async def crash(payload: Crash, meta: HandlerMetadata) -> HandlerResponse:
    raise RuntimeError("secret detail that must not reach the client")


async def wrong(payload: Wrong, meta: HandlerMetadata):
    return "not a HandlerResponse"


async def relay(payload, meta: HandlerMetadata) -> HandlerResponse:
    """Forwards to echo, which is not its peer; reports the SystemError it gets back."""
    if isinstance(payload, SystemErrorPayload):
        return HandlerResponse.respond(
            Note(text=f"{payload.code}:{str(payload.retry_allowed).lower()}")
        )
    return HandlerResponse(Ping(text=payload.text), to="echo")


async def record(payload: Record, meta: HandlerMetadata) -> HandlerResponse:
    """Appends ``from text`` to the file named by $E2E_RECORD_FILE (if set)."""
    path = os.environ.get("E2E_RECORD_FILE")
    if path:
        async with await trio.open_file(path, "a", encoding="utf-8") as f:
            await f.write(f"{meta.from_id} {payload.text}\n")
    return HandlerResponse.respond(Note(text=meta.from_id))


async def silent(payload: Silent, meta: HandlerMetadata) -> None:
    """Ends the chain without answering."""
    return None
