"""``POST /v1/messages`` (a message through the gateway, answered when it is) and
``GET /v1/threads/{thread}`` (the replies kept for a thread)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserver.core.envelope import MULTITASK_MODES
from agentserver.core.errors import HuhReason
from agentserver.core.threads import is_uuid4
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import huh_problem, problem, refusal_problem, reply_problem, unread

XML = "application/xml"
THREAD_HEADER = "Agentserver-Thread"


class MessageRoutes:
    """The message routes of one app."""

    def __init__(self, ctx: HttpContext, gate: Gate) -> None:
        self.ctx = ctx
        self.gate = gate

    async def post_message(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return unread(identity)
        gateway = self.ctx.gateway
        limit = gateway.max_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            # Refused before the body is read, as an oversize frame is on the socket.
            return unread(huh_problem(HuhReason.TOO_LARGE))
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return unread(huh_problem(HuhReason.TOO_LARGE))
            chunks.append(chunk)
        params = request.query_params
        wait = params.get("wait", "true").lower() not in ("false", "0", "no")
        thread = params.get("thread")
        if thread is not None and not is_uuid4(thread):
            return problem(400, "bad-thread", "A thread must be a uuid4.")
        multitask = params.get("multitask")
        if multitask is not None and multitask not in MULTITASK_MODES:
            return problem(
                400, "bad-multitask", f"multitask must be one of {', '.join(MULTITASK_MODES)}."
            )
        outcome = await gateway.send(
            identity,
            params.get("to"),
            b"".join(chunks),
            wait=wait,
            thread=thread,
            multitask=multitask,
        )
        extra = {"thread": outcome.thread} if outcome.thread else {}
        headers = {THREAD_HEADER: outcome.thread} if outcome.thread else None
        if outcome.kind == "refused":
            assert outcome.refusal is not None
            return refusal_problem(outcome.refusal)
        if outcome.kind == "accepted":
            return JSONResponse(
                {"thread": outcome.thread, "replies": f"/v1/threads/{outcome.thread}"},
                202,
                headers={**(headers or {}), "Location": f"/v1/threads/{outcome.thread}"},
            )
        if outcome.kind == "unanswered":
            return Response(status_code=204, headers=headers)
        if outcome.kind == "timeout":
            return problem(
                504,
                "system-error/timeout",
                "The request did not complete in time.",
                headers,
                replies=f"/v1/threads/{outcome.thread}",
                **extra,
            )
        refused = reply_problem(outcome.reply, **extra)
        if refused is not None:
            return refused
        return Response(outcome.reply, 200, headers=headers, media_type=XML)

    async def thread(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        thread = request.path_params["thread"]
        view = self.gate.kept_thread(identity, thread, request)
        if view is None:
            return problem(404, "not-found", "Not found.")
        return JSONResponse(
            {
                "thread": view.thread,
                "replies": [r.decode("utf-8") for r in view.replies],
                "unanswered": view.unanswered,
                "dropped": view.dropped,
                "expires_in": round(view.expires_in, 3),
            }
        )
