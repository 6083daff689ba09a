"""Payloads and handlers of the agent versions tests (tests/data/versions-v1.xml and
versions-v2.xml; tests/test_agent_versions_e2e.py).

Imported by the server subprocesses (tests/ is on their PYTHONPATH) and by the tests.
``waiter`` answers after ``seconds`` (far longer than a test: a call to it is still out
when a server stops); ``typer`` takes ``TypedTask`` on v1 and ``TypedTaskV2`` on v2, which
adds a required ``priority``: a task queued on v1 no longer validates on v2. ``payer``'s
calls to ``waiter`` need alice's approval; v2 removes that tool.
"""

from __future__ import annotations

import trio
from pydantic_xml import BaseXmlModel, element

from agentserver.core.listener import HandlerMetadata, HandlerResponse

TOOL_NS = "urn:test:versions"
TYPER_NS = "urn:test:versions:typer"
PINNER_NS = "urn:test:versions:pinner"
PINNER2_NS = "urn:test:versions:pinner2"
KEEPER_NS = "urn:test:versions:keeper"
PAYER_NS = "urn:test:versions:payer"


class Wait(BaseXmlModel, tag="wait", nsmap={"": TOOL_NS}):
    text: str = element()
    seconds: float = element()


class Waited(BaseXmlModel, tag="waited", nsmap={"": TOOL_NS}):
    text: str = element()


class Retry(BaseXmlModel, tag="retry", nsmap={"": TOOL_NS}):
    """``waiter``'s call to ``retrier``, an idempotent tool: a restart sends it again."""

    text: str = element()
    seconds: float = element()


class KeeperTask(BaseXmlModel, tag="task", nsmap={"": KEEPER_NS}):
    text: str = element()


class KeeperAnswer(BaseXmlModel, tag="answer", nsmap={"": KEEPER_NS}):
    text: str = element()


class PinnerTask(BaseXmlModel, tag="task", nsmap={"": PINNER_NS}):
    text: str = element()


class PinnerAnswer(BaseXmlModel, tag="answer", nsmap={"": PINNER_NS}):
    text: str = element()


class Pinner2Task(BaseXmlModel, tag="task", nsmap={"": PINNER2_NS}):
    text: str = element()


class Pinner2Answer(BaseXmlModel, tag="answer", nsmap={"": PINNER2_NS}):
    text: str = element()


class PayerTask(BaseXmlModel, tag="task", nsmap={"": PAYER_NS}):
    text: str = element()


class PayerAnswer(BaseXmlModel, tag="answer", nsmap={"": PAYER_NS}):
    text: str = element()


class TypedTask(BaseXmlModel, tag="task", nsmap={"": TYPER_NS}):
    text: str = element()


class TypedTaskV2(BaseXmlModel, tag="task", nsmap={"": TYPER_NS}):
    text: str = element()
    priority: int = element()


class TypedAnswer(BaseXmlModel, tag="answer", nsmap={"": TYPER_NS}):
    text: str = element()


async def wait(payload: Wait, meta: HandlerMetadata) -> HandlerResponse:
    """Answers after ``seconds``."""
    await trio.sleep(payload.seconds)
    return HandlerResponse.respond(Waited(text=payload.text))


async def retry(payload: Retry, meta: HandlerMetadata) -> HandlerResponse:
    """Answers after ``seconds`` (idempotent: a call a restart cut off is sent again)."""
    await trio.sleep(payload.seconds)
    return HandlerResponse.respond(Waited(text=payload.text))


async def agent_placeholder(payload: object, meta: HandlerMetadata) -> None:
    """Never called: an agent listener's handler is replaced by the agent runtime."""
    raise AssertionError("agent listeners are run by the agent runtime")
