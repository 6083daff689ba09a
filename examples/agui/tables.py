"""The tool: a restaurant's booking listener. ``<book><what>W</what></book>`` answers
``<booked><text>…</text></booked>``. The agent's policy (boot.xml) makes every call to it
wait for an approval."""

from pydantic_xml import BaseXmlModel, element

from agentserver.listener import HandlerMetadata, HandlerResponse

NSMAP = {"": "urn:example:tables"}


class Book(BaseXmlModel, tag="book", nsmap=NSMAP):
    what: str = element()


class Booked(BaseXmlModel, tag="booked", nsmap=NSMAP):
    text: str = element()


async def book(payload: Book, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Booked(text=f"booked {payload.what.strip()} (ref T-42)"))
