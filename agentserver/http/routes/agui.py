"""``POST /agui/agents/{name}``: an AG-UI 1.0 run on agent ``name`` (docs/ag-ui.md): the
body is AG-UI's ``RunAgentInput``, the answer the run's AG-UI events as Server-Sent
Events. Behind the same authentication and authorization as every route."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from agentserver.core.errors import HuhReason
from agentserver.core.handshake import Identity
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import huh_problem, problem, refusal_problem, unread

if TYPE_CHECKING:
    from agentserver.http.agui.stream import RunStream

#: What a caller without the ``agui`` extra installed on the server is told.
NOT_INSTALLED = (
    "AG-UI needs the ag-ui-protocol package on the server: pip install 'agentserver[agui]'"
)


class AguiRoutes:
    """The AG-UI route of one app."""

    def __init__(self, ctx: HttpContext, gate: Gate) -> None:
        self.ctx = ctx
        self.gate = gate

    async def run(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return unread(identity)
        runs = self.ctx.agui
        name = request.path_params["name"]
        agent = runs.agents.get(name) if runs is not None else None
        if agent is None or self.ctx.agents is None or not self.gate.may_see(identity, name):
            return unread(problem(404, "not-found", "Not found."))
        try:
            from ag_ui.core import RunAgentInput
            from pydantic import ValidationError

            from agentserver.http.agui.stream import RunStream
        except ImportError:
            return unread(problem(501, "agui-not-installed", NOT_INSTALLED))
        from agentserver.http.agui.runs import RunProblem, RunRefusedByPump

        limit = self.ctx.gateway.max_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return unread(huh_problem(HuhReason.TOO_LARGE))
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return unread(huh_problem(HuhReason.TOO_LARGE))
            chunks.append(chunk)
        try:
            parsed = RunAgentInput.model_validate_json(b"".join(chunks))
        except ValidationError as exc:
            wrong = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                for e in exc.errors()[:5]
            )
            return problem(
                422,
                "bad-run-input",
                "The body must be AG-UI's RunAgentInput (JSON with threadId, runId and "
                f"messages): {wrong}",
            )
        run_input = json.loads(parsed.model_dump_json(by_alias=True))

        async def visible(who: Identity, agent_name: str, thread: str) -> bool:
            return await self.gate.task_visible(who, agent_name, thread, request)

        try:
            run = await runs.start(identity, agent, run_input, visible)
        except RunProblem as exc:
            return problem(exc.status, exc.kind, exc.text)
        except RunRefusedByPump as exc:
            return refusal_problem(exc.refusal)
        stream = RunStream(
            views=self.ctx.agents,
            agent=name,
            thread=run.thread,
            thread_id=parsed.thread_id,
            run_id=parsed.run_id,
            sub=run.sub,
            closing=self.ctx.closing,
            fresh=run.fresh,
        )
        from agentserver.http.sse import EventStreamResponse

        return EventStreamResponse(self._body(stream))

    async def _body(self, stream: RunStream) -> AsyncGenerator[str, None]:
        """The run's events; its bus subscription closed however the stream ends (and
        closed by the server's shutdown, which ends the stream)."""
        sub = stream.sub
        subscriptions = self.ctx.subscriptions
        if sub is not None:
            subscriptions.add(sub)
        try:
            async for text in stream.events():
                yield text
        finally:
            if sub is not None:
                subscriptions.discard(sub)
                sub.close()
