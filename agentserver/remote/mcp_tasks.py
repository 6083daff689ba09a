"""The client side of the MCP Tasks extension (``io.modelcontextprotocol/tasks``,
2026-07-28; docs/mcp.md, "Tasks and approvals"), built on the SDK's client extension
hooks: a ``ClientExtension`` whose ``ResultClaim`` takes a ``CreateTaskResult``
(``resultType: "task"``) and finishes it by polling ``tasks/get`` until the task ends,
answering its input requests with ``tasks/update`` when it has an answerer, and
``tasks/cancel`` when the caller gives up (a call past its ``timeout``).

``<mcp>`` declares it on every call to a 2026-07-28 server, so a server that answers a
tool call with a task is followed to the task's result; the typed requests are also what
the tests drive a task with by hand. (The SDK ships the extension's hooks, not the
extension: SEP-2663's methods and shapes are written here.) Its waits are trio's, as
everywhere here: a client using it runs the SDK under trio (anyio's trio backend).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar, Literal

import trio
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp_types import CallToolResult, Request, RequestParams, Result, TextContent
from pydantic import ConfigDict

log = logging.getLogger("agentserver.mcp")

#: The extension's identifier (SEP-2663).
TASKS = "io.modelcontextprotocol/tasks"
#: Seconds between two ``tasks/get`` at least and at most (the server's
#: ``pollIntervalMs`` is honoured within these).
POLL_MIN = 0.05
POLL_MAX = 5.0
#: Seconds a ``tasks/cancel`` sent on the way out may take.
CANCEL_WAIT = 5.0
ENDED = frozenset({"completed", "failed", "cancelled"})

#: Answers a task's input requests (key -> request, as the wire has them): the
#: responses by key (the keys it answers; an empty map answers none yet).
InputAnswerer = Callable[[Mapping[str, Any]], Awaitable[Mapping[str, Any]]]


class TaskFields(Result):
    """A task's fields (the extension's ``Task``), extra ones kept."""

    model_config = ConfigDict(extra="allow")

    task_id: str
    status: str
    status_message: str | None = None
    created_at: str | None = None
    last_updated_at: str | None = None
    ttl_ms: int | None = None
    poll_interval_ms: int | None = None


class CreateTaskResult(TaskFields):
    """A ``tools/call`` answered with a task handle."""

    result_type: Literal["task"] = "task"


class DetailedTask(TaskFields):
    """``tasks/get``'s answer: the task, with its ``result``, ``error`` or
    ``inputRequests`` as its status has them."""

    result_type: str | None = "complete"
    input_requests: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class TaskIdParams(RequestParams):
    task_id: str


class UpdateTaskParams(TaskIdParams):
    input_responses: dict[str, Any]


class GetTaskRequest(Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: TaskIdParams
    #: Over streamable HTTP the task's id goes in ``Mcp-Name`` too (the extension's rule).
    name_param: ClassVar[str | None] = "taskId"


class UpdateTaskRequest(Request[UpdateTaskParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    params: UpdateTaskParams
    name_param: ClassVar[str | None] = "taskId"


class CancelTaskRequest(Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: TaskIdParams
    name_param: ClassVar[str | None] = "taskId"


async def get_task(session: Any, task_id: str) -> DetailedTask:
    """``tasks/get`` on a connected ``ClientSession``."""
    return await session.send_request(
        GetTaskRequest(params=TaskIdParams(task_id=task_id)), DetailedTask
    )


async def update_task(session: Any, task_id: str, responses: Mapping[str, Any]) -> None:
    """``tasks/update``: answers to the task's input requests, by key."""
    answers = {
        key: value.model_dump(by_alias=True, mode="json", exclude_none=True)
        if hasattr(value, "model_dump")
        else value
        for key, value in responses.items()
    }
    await session.send_request(
        UpdateTaskRequest(params=UpdateTaskParams(task_id=task_id, input_responses=answers)),
        Result,
    )


async def cancel_task(session: Any, task_id: str) -> None:
    """``tasks/cancel``."""
    await session.send_request(CancelTaskRequest(params=TaskIdParams(task_id=task_id)), Result)


def ended_result(task: DetailedTask) -> CallToolResult:
    """The ``CallToolResult`` an ended task stands for."""
    if task.status == "completed" and task.result is not None:
        return CallToolResult.model_validate(task.result)
    if task.status == "failed":
        error = task.error or {}
        text = f"the task failed: {error.get('message') or task.status_message or 'no reason'}"
    else:
        text = f"the task was cancelled: {task.status_message or 'no reason'}"
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)


class TasksExtension(ClientExtension):
    """The extension for an SDK ``Client`` (``extensions=[TasksExtension()]``)."""

    identifier = TASKS

    def __init__(self, answer: InputAnswerer | None = None) -> None:
        self.answer = answer

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreateTaskResult, resolve=self.resolve)]

    async def resolve(self, handle: CreateTaskResult, ctx: ClaimContext) -> CallToolResult:
        """Follow the task to its end (cancelling it if the caller gives up first)."""
        session = ctx.session
        task_id = handle.task_id
        answered: set[str] = set()
        interval = handle.poll_interval_ms
        log.info("MCP tool %s: task %s", ctx.tool_name, task_id)
        try:
            while True:
                await trio.sleep(_interval(interval))
                task = await get_task(session, task_id)
                interval = task.poll_interval_ms or interval
                if task.status in ENDED:
                    return ended_result(task)
                if task.status != "input_required" or not task.input_requests:
                    continue
                fresh = {k: v for k, v in task.input_requests.items() if k not in answered}
                if not fresh:
                    continue
                if self.answer is None:
                    # No one here to answer: the task waits for its server's other doors.
                    log.warning(
                        "MCP task %s waits for input nobody here answers: %s",
                        task_id,
                        task.status_message or sorted(fresh),
                    )
                    answered.update(fresh)
                    continue
                responses = await self.answer(fresh)
                if responses:
                    await update_task(session, task_id, responses)
                    answered.update(responses)
        except trio.Cancelled:
            with trio.move_on_after(CANCEL_WAIT) as bound:
                bound.shield = True
                try:
                    await cancel_task(session, task_id)
                except Exception as exc:  # the call is over either way
                    log.warning("MCP task %s: tasks/cancel failed: %s", task_id, exc)
            raise


def _interval(ms: int | None) -> float:
    if not ms:
        return POLL_MIN * 4
    return min(max(ms / 1000, POLL_MIN), POLL_MAX)
