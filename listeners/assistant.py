"""The ``assistant`` entry of the bundled topology: the default agent of the console.

The payloads are fixed (``<task>`` in, ``<answer>`` out, namespace
``urn:agentserver:assistant``). Declared with ``agent="true"`` (as in the bundled
boot.xml) the listener is run by the agent runtime (``agentserver.agents``), which uses
only these payload types. The handler below serves a topology that declares the built-in
without ``agent="true"``: it answers every task with a clear notice instead.
"""

from __future__ import annotations

from pydantic_xml import BaseXmlModel, element

from agentserver.listener import HandlerMetadata, HandlerResponse

NS = "urn:agentserver:assistant"
_NSMAP = {"": NS}

NOT_CONFIGURED = (
    "The agent runtime is not configured in this server, so the assistant cannot answer "
    "yet. Address a listener directly instead, e.g. "
    '@echo <ping xmlns="urn:agentserver:echo"><text>hi</text></ping>'
)


class Task(BaseXmlModel, tag="task", nsmap=_NSMAP):
    text: str = element()


class Answer(BaseXmlModel, tag="answer", nsmap=_NSMAP):
    text: str = element()


async def handle(payload: Task, meta: HandlerMetadata) -> HandlerResponse:
    """Answer with the "not configured" notice (used only when not run as an agent)."""
    return HandlerResponse.respond(Answer(text=NOT_CONFIGURED))
