"""Payloads and handlers of the agent crash test topology (tests/data/agents-crash-boot.xml).

Imported by the server subprocess (tests/ is on its PYTHONPATH) and by the test. Besides
the bundled ``assistant`` the topology runs two more agents (an agent runs one Turn at a
time, so several Turns can only be open at once on several agents) and ``waiter``, a tool
that answers after ``seconds``: far longer than the test, so a call to it is still pending
when the server is killed.
"""

from __future__ import annotations

import trio
from pydantic_xml import BaseXmlModel, element

from agentserver.core.listener import HandlerMetadata, HandlerResponse

TOOL_NS = "urn:test:crash"
PLANNER_NS = "urn:test:crash:planner"
MIXER_NS = "urn:test:crash:mixer"


class Wait(BaseXmlModel, tag="wait", nsmap={"": TOOL_NS}):
    text: str = element()
    seconds: float = element()


class Waited(BaseXmlModel, tag="waited", nsmap={"": TOOL_NS}):
    text: str = element()


class PlanTask(BaseXmlModel, tag="task", nsmap={"": PLANNER_NS}):
    text: str = element()


class PlanAnswer(BaseXmlModel, tag="answer", nsmap={"": PLANNER_NS}):
    text: str = element()


class MixTask(BaseXmlModel, tag="task", nsmap={"": MIXER_NS}):
    text: str = element()


class MixAnswer(BaseXmlModel, tag="answer", nsmap={"": MIXER_NS}):
    text: str = element()


async def wait(payload: Wait, meta: HandlerMetadata) -> HandlerResponse:
    """Answers after ``seconds``."""
    await trio.sleep(payload.seconds)
    return HandlerResponse.respond(Waited(text=payload.text))


async def agent_placeholder(payload: object, meta: HandlerMetadata) -> None:
    """Never called: an agent listener's handler is replaced by the agent runtime."""
    raise AssertionError("agent listeners are run by the agent runtime")
