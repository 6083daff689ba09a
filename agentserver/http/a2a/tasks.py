"""Our task's durable state (:func:`agentserver.agents.store.sql.a2a.task`) as the SDK's
A2A ``Task`` (docs/a2a.md, "Mapping"). Sans I/O.

| ours | A2A |
|---|---|
| recorded, not yet in the agent's inbox; queued | submitted |
| running | working |
| running, a tool call waiting for a human approval | input-required (what is asked) |
| succeeded | completed (the answer as an artifact and as the agent's message) |
| failed, timed out | failed (our failure text) |
| stopped; a queued task cancelled | canceled |
| refused at intake | rejected (why) |
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from a2a.types import (
    Artifact,
    ListTasksRequest,
    Message,
    Part,
    Role,
    Task,
    TaskState,
    TaskStatus,
)
from a2a.utils.errors import InvalidParamsError
from google.protobuf.json_format import Parse

S = TaskState
TERMINAL = frozenset(
    {S.TASK_STATE_COMPLETED, S.TASK_STATE_FAILED, S.TASK_STATE_CANCELED, S.TASK_STATE_REJECTED}
)
#: States a task stops in until someone else acts (a stream ends there).
INTERRUPTED = frozenset({S.TASK_STATE_INPUT_REQUIRED, S.TASK_STATE_AUTH_REQUIRED})

_BY_STATUS = {
    "queued": S.TASK_STATE_SUBMITTED,
    "pending": S.TASK_STATE_SUBMITTED,
    "running": S.TASK_STATE_WORKING,
    "succeeded": S.TASK_STATE_COMPLETED,
    "finished": S.TASK_STATE_COMPLETED,
    "failed": S.TASK_STATE_FAILED,
    "timed_out": S.TASK_STATE_FAILED,
    "error": S.TASK_STATE_FAILED,
    "stopped": S.TASK_STATE_CANCELED,
    "skipped": S.TASK_STATE_CANCELED,
}


def state_of(row: dict[str, Any]) -> tuple[TaskState, str | None]:
    """The A2A state of a task's row and the text its status message carries."""
    if row.get("refusal"):
        return S.TASK_STATE_REJECTED, row["refusal"]
    view = row.get("view")
    if view is None:
        return S.TASK_STATE_SUBMITTED, None
    state = _BY_STATUS.get(view.get("status", ""), S.TASK_STATE_WORKING)
    if state == S.TASK_STATE_WORKING and row.get("asks"):
        return S.TASK_STATE_INPUT_REQUIRED, asks_text(row["agent"], row["asks"])
    if state == S.TASK_STATE_COMPLETED:
        return state, row.get("answer") or ""
    if state in (S.TASK_STATE_FAILED, S.TASK_STATE_CANCELED):
        return state, row.get("answer") or view.get("error") or ""
    return state, None


def asks_text(agent: str, asks: dict[str, Any]) -> str:
    """What an approval waits for, in a sentence."""
    return (
        f"{agent} waits for {asks['approver']} to approve a call to {asks['target']} "
        f"(rule {asks['rule']}, approval request {asks['request']}): {asks['payload']}"
    )


def _agent_message(row: dict[str, Any], text: str) -> Message:
    return Message(
        message_id=f"{row['task_id']}-status",
        context_id=row["context_id"],
        task_id=row["task_id"],
        role=Role.ROLE_AGENT,
        parts=[Part(text=text)],
    )


def answer_artifact(row: dict[str, Any]) -> Artifact:
    """The answer of a completed task as its one artifact."""
    return Artifact(
        artifact_id=f"{row['task_id']}-answer",
        name="answer",
        parts=[Part(text=row.get("answer") or "")],
    )


def to_task(row: dict[str, Any], history_length: int | None = None) -> Task:
    """The SDK's ``Task`` for a row; ``history_length``: the newest messages kept (None:
    all, 0: none)."""
    state, text = state_of(row)
    status = TaskStatus(state=state)
    stamp = (row.get("view") or {}).get("finished_at") or row.get("created_at")
    if isinstance(stamp, int | float):
        status.timestamp.FromNanoseconds(int(stamp * 1e9))
    if text is not None:
        status.message.CopyFrom(_agent_message(row, text))
    task = Task(id=row["task_id"], context_id=row["context_id"], status=status)
    if state == S.TASK_STATE_COMPLETED:
        task.artifacts.append(answer_artifact(row))
    history = [Parse(row["message"], Message())]
    if text is not None and state != S.TASK_STATE_SUBMITTED:
        history.append(_agent_message(row, text))
    if history_length is not None:
        history = history[-history_length:] if history_length > 0 else []
    task.history.extend(history)
    return task


def page_token(row: dict[str, Any]) -> str:
    """The ``ListTasks`` page token after ``row``: a cursor (its time and id), so that a
    task arriving meanwhile shifts no later page."""
    return f"{float(row['created_at'])!r} {row['task_id']}"


def read_page_token(token: str) -> tuple[float, str] | None:
    """The cursor of a :func:`page_token` (None for the first page). Raises
    InvalidParamsError for a token not of ours."""
    if not token:
        return None
    stamp, _, task_id = token.partition(" ")
    try:
        if not task_id:
            raise ValueError(token)
        return float(stamp), task_id
    except ValueError:
        raise InvalidParamsError("not a page token of ours") from None


def state_filter(params: ListTasksRequest) -> Callable[[dict[str, Any]], bool] | None:
    """The ``ListTasks`` filters on a task's state (``status``, ``statusTimestampAfter``)
    as a predicate on its row, applied before the page is cut; None: no such filter."""
    status = params.status
    after = (
        params.status_timestamp_after.ToNanoseconds()
        if params.HasField("status_timestamp_after")
        else None
    )
    if not status and after is None:
        return None

    def keep(row: dict[str, Any]) -> bool:
        task = to_task(row, 0)
        if status and task.status.state != status:
            return False
        return after is None or task.status.timestamp.ToNanoseconds() >= after

    return keep
