"""One A2A skill per exposed agent (``<expose-a2a>``), and an A2A message made into the
agent's task payload: text parts are the task's text, data parts fill its other fields
(docs/a2a.md, "Mapping"). Sans I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lxml import etree

from agentserver.core.payloads import PayloadType
from agentserver.core.xsd_jsonschema import XML_PROPERTY, ArgumentsRefused, ToolInput

#: The message (or request) metadata key that names the skill, with several agents exposed.
SKILL_KEY = "skill"
#: The task payload's field text parts fill.
TEXT_FIELD = "text"


class MessageRefused(Exception):
    """The message cannot be this skill's task; ``content`` says a part's kind is what is
    refused (A2A's ContentTypeNotSupported), else its params are (InvalidParams)."""

    def __init__(self, text: str, *, content: bool = False) -> None:
        super().__init__(text)
        self.content = content


@dataclass(frozen=True, slots=True)
class A2aSkill:
    """An exposed agent: the card's skill and the input its messages fill."""

    name: str
    description: str
    examples: tuple[str, ...]
    tags: tuple[str, ...]
    input: ToolInput
    #: ``memory="client"``: each A2A context is a conversation the agent remembers.
    memory: bool = False
    #: The task payload's type: a payload is checked against it before it is sent (the
    #: pump would refuse it after the task was accepted, with no task to show it).
    ptype: PayloadType | None = None

    def payload(self, message: Any) -> etree._Element:
        """The task payload of ``message`` (the SDK's ``Message``). Raises
        :class:`MessageRefused`: a file or raw part, a data part that is not an object,
        no content, or fields the payload's schema does not take."""
        texts: list[str] = []
        arguments: dict[str, Any] = {}
        for part in message.parts:
            kind = part.WhichOneof("content")
            if kind == "text":
                texts.append(part.text)
            elif kind == "data":
                # Imported here: a message in hand means the SDK (the a2a extra) is
                # installed; loading boot.xml must not need it.
                from google.protobuf.json_format import MessageToDict

                data = MessageToDict(part.data)
                if not isinstance(data, dict):
                    raise MessageRefused("a data part must be a JSON object (the task's fields)")
                arguments.update(data)
            else:
                raise MessageRefused(
                    f"{self.name} takes text and data parts, not {kind or 'empty'} parts",
                    content=True,
                )
        text = "\n\n".join(t for t in texts if t)
        if text:
            key = XML_PROPERTY if self.input.fields is None else TEXT_FIELD
            arguments[key] = text
        if not arguments:
            raise MessageRefused("the message has no text and no data")
        try:
            payload = self.input.element(arguments)
        except ArgumentsRefused as exc:
            raise MessageRefused(str(exc)) from None
        if self.ptype is not None and not self.ptype.schema.validate(payload):
            error = self.ptype.schema.error_log.last_error
            raise MessageRefused(
                f"the message does not fit {self.name}'s task: {error.message if error else ''}"
            )
        return payload
