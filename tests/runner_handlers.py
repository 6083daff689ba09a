"""Payloads and runner handlers of the remote-listener tests (tests/test_runners*.py).

Imported by the server (for the payload types) and by runner subprocesses (the handler).
"""

from __future__ import annotations

import os
import pathlib

import trio
from lxml import etree
from pydantic_xml import BaseXmlModel, element

from agentserver.core.listener import HandlerMetadata, HandlerResponse

NS = "urn:test:runner"
_NSMAP = {"": NS}


class Query(BaseXmlModel, tag="query", nsmap=_NSMAP):
    text: str = element()
    seconds: float = element(default=0.0)


class Result(BaseXmlModel, tag="result", nsmap=_NSMAP):
    text: str = element()
    runner: str = element()


async def handle(payload: etree._Element, meta: HandlerMetadata) -> HandlerResponse:
    """Answer ``<result>`` with the query's text after ``seconds``. With
    ``$RUNNER_MARKS`` set, first leave a file named after this process in that
    directory, so a test can tell which runner holds a job. With ``$RUNNER_EFFECTS`` set,
    record the job's effect there once per idempotency key (tests/idem_support.py). With
    ``$RUNNER_CANCELLED`` set, a job cancelled while it waits leaves a file there."""
    text = payload.findtext(f"{{{NS}}}text") or ""
    seconds = float(payload.findtext(f"{{{NS}}}seconds") or 0)
    effects = os.environ.get("RUNNER_EFFECTS")
    if effects:
        # Deduped by the step's key (issue 26): a retried step writes no second effect.
        from idem_support import record

        record(pathlib.Path(effects), meta.idempotency_key, text)
    marks = os.environ.get("RUNNER_MARKS")
    if marks:
        (pathlib.Path(marks) / str(os.getpid())).write_text(text)
    if seconds:
        try:
            await trio.sleep(seconds)
        except trio.Cancelled:
            # The server's <cancel> (a stopped caller, a step-timeout): say so for a test.
            cancelled = os.environ.get("RUNNER_CANCELLED")
            if cancelled:
                (pathlib.Path(cancelled) / str(os.getpid())).write_text(text)
            raise
    return HandlerResponse.respond(Result(text=text, runner=str(os.getpid())))
