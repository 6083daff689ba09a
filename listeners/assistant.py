"""The ``assistant`` entry of the bundled topology: the default agent of the console.

The payloads are fixed (``<task>`` in, ``<answer>`` out, namespace
``urn:agentserver:assistant``; ``<answer status="failed">`` for a task that failed). Declared with ``agent="true"`` (as in the bundled
boot.xml) the listener is run by the agent runtime (``agentserver.agents``), which uses
only these payload types. The handler below serves a topology that declares the built-in
without ``agent="true"``: it answers every task with a clear notice instead.
"""

from __future__ import annotations

from typing import Literal

from pydantic_xml import BaseXmlModel, attr, element

from agentserver.core.listener import HandlerMetadata, HandlerResponse

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
    """The deliverable. ``status="failed"`` marks a task that did not succeed (no model,
    timeout, step limit, stopped, ...): ``text`` then says why. A success carries no
    ``status`` (``ok`` is accepted as its explicit spelling)."""

    status: Literal["ok", "failed"] | None = attr(default=None)
    text: str = element()


async def handle(payload: Task, meta: HandlerMetadata) -> HandlerResponse:
    """Answer with the "not configured" notice (used only when not run as an agent)."""
    return HandlerResponse.respond(Answer(text=NOT_CONFIGURED))
