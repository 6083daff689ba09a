"""The agents AG-UI runs reach, and a run's input made into an agent's task payload
(docs/ag-ui.md, "Mapping"). Sans I/O; no import of the ``ag-ui-protocol`` package (the
composition root builds these without the ``agui`` extra)."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

from lxml import etree

from agentserver.core.payloads import PayloadType
from agentserver.core.xsd_jsonschema import XML_PROPERTY, ArgumentsRefused, ToolInput

#: The task payload's field a user message's text fills.
TEXT_FIELD = "text"


class RunRefused(Exception):
    """A run's input that cannot become the agent's task (the caller is told why)."""


@dataclass(frozen=True, slots=True)
class AguiAgent:
    """An agent AG-UI runs reach: its task payload's input and whether it remembers a
    conversation per AG-UI thread (``memory="client"``)."""

    name: str
    input: ToolInput
    ptype: PayloadType | None = None
    memory: bool = False

    def payload(self, text: str) -> etree._Element:
        """The task payload carrying ``text`` (the run's last user message). Raises
        :class:`RunRefused` when it does not fit the agent's task type."""
        key = XML_PROPERTY if self.input.fields is None else TEXT_FIELD
        try:
            payload = self.input.element({key: text})
        except ArgumentsRefused as exc:
            raise RunRefused(str(exc)) from None
        if self.ptype is not None and not self.ptype.schema.validate(payload):
            error = self.ptype.schema.error_log.last_error
            raise RunRefused(
                f"the message does not fit {self.name}'s task: {error.message if error else ''}"
            )
        return payload


def message_text(message: Any) -> str:
    """The text of one AG-UI message as a decoded JSON object: its ``content`` string, or
    its text parts joined (other parts are refused: the agent's task is text)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise RunRefused(f"a user message's parts must be text, not {kind!r}")
            texts.append(str(part.get("text", "")))
        return "\n\n".join(t for t in texts if t)
    return ""


def last_user_text(messages: list[Any]) -> str:
    """The text of the last user message of a run's input: the agent's task (earlier
    messages are the conversation the agent remembers itself)."""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            text = message_text(message).strip()
            if text:
                return text
            break
    raise RunRefused("a run needs a user message with text (the agent's task) as its last")


def run_thread(owner: str, agent: str, thread_id: str, run_id: str) -> str:
    """The thread our task of an AG-UI run is sent on: derived from the caller, the agent
    and the run's ``threadId`` and ``runId``, so the same run posted again (a client
    reconnecting) finds its task, and no other caller can name it (uuid4-shaped, as the
    rest of the API expects a thread)."""
    digest = hashlib.sha256("\0".join(("agui", owner, agent, thread_id, run_id)).encode())
    return str(uuid.UUID(bytes=digest.digest()[:16], version=4))
