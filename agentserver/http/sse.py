"""Server-Sent Events: the response that carries them and their wire form."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator
from typing import Any

import trio
from starlette.responses import Response

from agentserver.agents.events import (
    BudgetEvent,
    ChunkEvent,
    Event,
    NoticeEvent,
    StateEvent,
    StepEvent,
    TaskEvent,
)

_EVENT_KIND = {
    StepEvent: "step",
    ChunkEvent: "chunk",
    TaskEvent: "task",
    StateEvent: "state",
    BudgetEvent: "budget",
}


class EventStreamResponse(Response):
    """A ``text/event-stream`` response that always ends properly.

    Not Starlette's StreamingResponse: when Hypercorn begins its graceful shutdown it tells
    the app the client disconnected, StreamingResponse then stops mid-body, and the
    unfinished response holds the connection (and the shutdown) until the client goes.
    Here the end of the body is sent whatever ended the stream (the client leaving, the
    server closing, an overflow), and the connection is closed after it."""

    def __init__(self, chunks: AsyncGenerator[str, None]) -> None:
        # No Response.__init__: it would declare a Content-Length for the empty body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            (b"connection", b"close"),
        ]
        self._chunks = chunks

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async with contextlib.aclosing(self._chunks) as chunks:
            async with trio.open_nursery() as nursery:

                async def disconnected() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(disconnected)
                async for chunk in chunks:
                    body = chunk.encode("utf-8")
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True), contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def sse(event: Event) -> str:
    """One event as an SSE message: ``event: KIND`` and its fields as JSON ``data``."""
    data = dataclasses.asdict(event)
    kind = event.event_type if isinstance(event, NoticeEvent) else _EVENT_KIND[type(event)]
    return f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n"
