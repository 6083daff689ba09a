"""The tool: a glossary listener. ``<lookup><term>T</term></lookup>`` answers
``<definition><term>T</term><text>…</text></definition>`` (an empty text if unknown)."""

from pydantic_xml import BaseXmlModel, element

from agentserver.listener import HandlerMetadata, HandlerResponse

NSMAP = {"": "urn:example:glossary"}

GLOSSARY = {
    "pump": "the router that validates every message and hands it to its listener",
    "listener": "a named async handler for one or more payload types",
    "huh": "the primitive the pump answers a message it refuses with",
}


class Lookup(BaseXmlModel, tag="lookup", nsmap=NSMAP):
    term: str = element()


class Definition(BaseXmlModel, tag="definition", nsmap=NSMAP):
    term: str = element()
    text: str = element()


async def lookup(payload: Lookup, meta: HandlerMetadata) -> HandlerResponse:
    term = payload.term.strip().lower()
    return HandlerResponse.respond(Definition(term=term, text=GLOSSARY.get(term, "")))
