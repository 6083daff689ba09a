"""The tool of the double-texting topology (tests/data/multitask-boot.xml): ``marker``
records each call it gets (its effect) in the file ``$MT_EFFECTS`` names, then holds the
call until a file ``release`` appears next to it. Imported by the server subprocesses
(tests/ is on their PYTHONPATH) and by the test, which counts the effects: a call done
once must never be made again, whichever process ran it."""

from __future__ import annotations

import os

import trio
from pydantic_xml import BaseXmlModel, element

from agentserver.core.listener import HandlerMetadata, HandlerResponse

NS = "urn:test:multitask"
EFFECTS_ENV = "MT_EFFECTS"
#: How often a held call looks for the release file.
POLL = 0.05


class Mark(BaseXmlModel, tag="mark", nsmap={"": NS}):
    text: str = element()


class Marked(BaseXmlModel, tag="marked", nsmap={"": NS}):
    text: str = element()


def mark_call(text: str) -> str:
    """The tool call a model writes to call ``marker``."""
    return f'<mark xmlns="{NS}"><text>{text}</text></mark>'


async def mark(payload: Mark, meta: HandlerMetadata) -> HandlerResponse:
    effects = trio.Path(os.environ[EFFECTS_ENV])
    # One line per call, appended: two processes may both write the file.
    async with await trio.open_file(effects, "a") as out:
        await out.write(f"{payload.text} {meta.idempotency_key}\n")
    release = effects.with_name("release")
    # Another process (the test) makes the file: there is no event to wait on.
    while not await release.exists():  # noqa: ASYNC110
        await trio.sleep(POLL)
    return HandlerResponse.respond(Marked(text=payload.text))
