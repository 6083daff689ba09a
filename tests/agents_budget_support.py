"""A tool with a huge result, for tests/test_agents_budget_e2e.py (imported by the server
subprocess through tests/ on its PYTHONPATH, and by the test)."""

from __future__ import annotations

from pydantic_xml import BaseXmlModel, element

from agentserver.core.listener import HandlerMetadata, HandlerResponse

TOOL_NS = "urn:test:budget"
#: Characters of one result: 400 KB, far over a 32k-token window.
RESULT_CHARS = 400_000


class Fetch(BaseXmlModel, tag="fetch", nsmap={"": TOOL_NS}):
    page: int = element()


class Page(BaseXmlModel, tag="page", nsmap={"": TOOL_NS}):
    text: str = element()


async def fetch(payload: Fetch, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Page(text=f"page {payload.page}: " + "x" * RESULT_CHARS))
