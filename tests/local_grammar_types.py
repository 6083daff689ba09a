"""A listener whose payload's XSD has a pattern: what the local backend's reply grammar
cannot express (tests/llm/test_llm_local_config.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic_xml import BaseXmlModel, element

from agentserver.core.listener import HandlerMetadata, HandlerResponse
from agentserver.listeners.echo import Pong


class Lookup(BaseXmlModel, tag="lookup", nsmap={"": "urn:test:lookup"}):
    code: Annotated[str, Field(pattern=r"^[A-Z]{3}$")] = element()


async def lookup(payload: Lookup, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Pong(text=payload.code))
