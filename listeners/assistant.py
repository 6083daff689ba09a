"""The ``assistant`` entry of the bundled topology: the default agent of the console.

The payloads are fixed (``<task>`` in, ``<answer>`` out, namespace
``urn:agentserver:assistant``). Until an agent runtime is configured the handler answers
every task with a clear notice instead of an LLM's answer, so the topology, the console's
plain-text short form and the peer wiring can be exercised now.
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
    """Answer with the "not configured" notice (replaced by the agent runtime later)."""
    return HandlerResponse.respond(Answer(text=NOT_CONFIGURED))
