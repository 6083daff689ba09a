"""One call of a remote A2A skill (docs/a2a.md, "Remote A2A agents as tools"): its
attempts, each continuing the remote task an earlier one (or an earlier process) started.

A call's message id is our idempotency key, the same on every attempt of the call, on
the resend after a restart, and on whichever process sends it. A fresh call (not the
answer to a remote question) also names its own context, :func:`call_context` of the key:
a context of its own, as the remote would have made, but one we can find again. Each
attempt first looks for the remote task the call already started:

- by its id, when an earlier attempt of this process saw it;
- else by ``ListTasks`` of the call's context (after a restart: nothing is kept here);
- else, on a remote without ``ListTasks`` (one that speaks A2A 0.3, which has none, or
  one that refused it once), by the id :class:`RemoteTasks` recorded when an attempt
  first saw the task: a step event (``a2a.task``) in the step log, durable in the
  agents' store, so the resend after a restart, on any process of a shared store, reads
  it. Nothing recorded (the process died between the remote's answer and the record):
  sent again with the same message id (a remote that dedupes by message id, as ours
  does, still continues the same task).

A task found is followed (``SubscribeToTask`` when the card offers streaming, else
``GetTask``) and never sent again; a task the remote no longer has (TaskNotFound, or none
listed) is sent again with the same message id. The answer to a remote question (a
continuation) is looked up by the remote task's id: found still waiting and without our
message in its history, the answer is sent again.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import trio

from agentserver.steps.log import MemoryStepLog, StepLog, StepRow

log = logging.getLogger("agentserver.a2a")

POLL_MIN = 0.1
POLL_MAX = 2.0
#: Messages of a found task's history read to see whether it holds our message.
HISTORY = 100
_STATE_NAMES = {
    "TASK_STATE_SUBMITTED": "submitted",
    "TASK_STATE_WORKING": "working",
    "TASK_STATE_COMPLETED": "completed",
    "TASK_STATE_FAILED": "failed",
    "TASK_STATE_CANCELED": "canceled",
    "TASK_STATE_INPUT_REQUIRED": "input-required",
    "TASK_STATE_REJECTED": "rejected",
    "TASK_STATE_AUTH_REQUIRED": "auth-required",
}
ENDED = frozenset({"completed", "failed", "canceled", "rejected"})
WAITING = frozenset({"input-required", "auth-required"})
#: The step event recording the remote task a call started (detail: the task's id).
TASK_EVENT = "a2a.task"
#: Seconds a record waits to be written before the call goes on (the writer still
#: writes it: the wait only narrows the window a kill could lose it in).
RECORD_WAIT = 2.0
#: Seconds a call waits for the durable log at start (then it goes on without it).
READY_WAIT = 30.0
#: The namespace of :func:`call_context`'s ids.
_CONTEXTS = uuid.UUID("5f0c2b8e-6a8d-4c1e-9d0a-a2a0c0de0a2a")


class DirectAnswer(Exception):
    """The remote answered a message, not a task: ``texts`` is its answer."""

    def __init__(self, texts: list[str]) -> None:
        super().__init__("a direct answer")
        self.texts = texts


def call_context(remote: str, key: str) -> str:
    """The context id a fresh call with idempotency key ``key`` names: the same for every
    attempt and process, and a context no other call shares."""
    return str(uuid.uuid5(_CONTEXTS, f"{remote}\n{key}"))


def state_name(task: Any) -> str:
    """``completed``, ``input-required``, ... of the SDK's ``Task``."""
    from a2a.types import TaskState

    return _STATE_NAMES.get(TaskState.Name(task.status.state), "working")


def settled(task: Any, resumed: bool) -> bool:
    """The call's answer is there: the task ended, or waits for input (again: not merely
    still, when the call answers its question)."""
    state = state_name(task)
    if state in WAITING and resumed:
        return False  # not yet seen at work on the answer: read on (the timeout bounds it)
    return state in ENDED | WAITING


class RemoteTasks:
    """Which remote task each call started, for remotes without ``ListTasks``: a step
    event :data:`TASK_EVENT` of the call's step (its idempotency key) in the step log,
    durable in the agents' store (:meth:`log_to`, by the composition root once the
    agents run, as the runner hub's log is); in memory without a store (``durable``
    false: no agents, so no Turn resends a call after a restart)."""

    def __init__(self, *, durable: bool = False) -> None:
        self.log: StepLog = MemoryStepLog()
        #: Set once the durable log is given (at once without a store): a Turn resumed
        #: at start may resend its call before the composition root gets there.
        self.ready = trio.Event()
        if not durable:
            self.ready.set()

    def log_to(self, log: StepLog) -> None:
        """Record in ``log`` from now on (the agents' store exists only once they run)."""
        self.log = log
        self.ready.set()

    async def _log(self) -> StepLog:
        if not self.ready.is_set():  # no checkpoint once ready (remember's append)
            with trio.move_on_after(READY_WAIT):
                await self.ready.wait()
        return self.log

    async def remember(self, call: RemoteCall, task_id: str) -> None:
        """Record that ``call`` started remote task ``task_id``, and wait (at most
        :data:`RECORD_WAIT` s) for the row to be written. Once the log is ready the row
        is appended before any checkpoint: an attempt cancelled here still leaves it."""
        log = await self._log()
        log.append(
            StepRow(call.key, call.listener, call.caller, 0, TASK_EVENT, task_id, time.time())
        )
        call.recorded = task_id
        with trio.move_on_after(RECORD_WAIT):
            await log.flush()

    async def recall(self, key: str) -> str | None:
        """The remote task the call of idempotency key ``key`` started, if recorded."""
        rows = await (await self._log()).rows(step=key)
        found = [r.detail for r in rows if r.event == TASK_EVENT and r.detail]
        return found[-1] if found else None


class RemoteCall:
    """The state one call keeps across its attempts: its message, and the remote task
    once known."""

    def __init__(
        self,
        remote: str,
        skill: str,
        text: str,
        data: Mapping[str, Any],
        key: str,
        waiting: tuple[str, str] | None,
        *,
        listener: str = "",
        caller: str = "",
    ) -> None:
        self.remote = remote
        #: The skill listener called, and who called it (the step log's columns).
        self.listener = listener
        self.caller = caller
        self.skill = skill
        self.text = text
        self.data = dict(data)
        self.key = key
        #: (context id, task id) of the remote task this call answers the question of.
        self.waiting = waiting
        self.context = waiting[0] if waiting else call_context(remote, key)
        #: The remote task's id, once an attempt saw it.
        self.task_id = waiting[1] if waiting else ""
        #: The last state seen (the task being followed).
        self.task: Any = None
        #: The remote task recorded in :class:`RemoteTasks` by this process.
        self.recorded = ""
        #: When the whole call times out (trio time; set as it starts).
        self.deadline = float("inf")

    def message(self) -> Any:
        """The SDK's ``Message`` of this call: the same on every attempt."""
        from a2a.types import Message, Part, Role
        from google.protobuf.json_format import ParseDict
        from google.protobuf.struct_pb2 import Struct, Value

        message = Message(message_id=self.key, role=Role.ROLE_USER, parts=[Part(text=self.text)])
        if self.data:
            message.parts.append(Part(data=ParseDict(self.data, Value())))
        metadata = Struct()
        metadata.update({"skill": self.skill})
        message.metadata.CopyFrom(metadata)
        message.context_id = self.context
        if self.waiting is not None:
            message.task_id = self.waiting[1]
        return message

    def holds_ours(self, task: Any) -> bool:
        """``task``'s history holds this call's message."""
        return any(m.message_id == self.key for m in task.history)


class Attempt:
    """One attempt of a :class:`RemoteCall` on an SDK client; raises what the client
    raises (the caller retries transport failures)."""

    def __init__(
        self,
        client: Any,
        call: RemoteCall,
        streaming: bool,
        lists: bool,
        tasks: RemoteTasks | None = None,
    ) -> None:
        self.client = client
        self.call = call
        self.streaming = streaming
        #: The remote serves ListTasks (as far as known).
        self.lists = lists
        #: Where a remote without ListTasks has its calls' tasks recorded.
        self.tasks = tasks

    async def run(self) -> Any:
        """The task settled (ended or asking). Raises DirectAnswer for a remote that
        answers without a task."""
        found = await self._find()
        if found is not None:
            task, resumed = found
            log.info(
                "a2a %s: continuing remote task %s (call %s)",
                self.call.remote,
                task.id,
                self.call.key,
            )
            return await self._resume(task, resumed)
        return await self._send()

    async def _find(self) -> tuple[Any, bool] | None:
        """The remote task this call started, and whether our message was delivered to
        it while it waited (a continuation); None: to be sent."""
        from a2a.types import GetTaskRequest, ListTasksRequest
        from a2a.utils.errors import A2AError, TaskNotFoundError

        call = self.call
        if call.task_id:
            try:
                task = await self.client.get_task(
                    GetTaskRequest(id=call.task_id, history_length=HISTORY)
                )
            except TaskNotFoundError:
                return None
            if call.waiting is None:
                return task, False
            delivered = call.holds_ours(task) or state_name(task) not in WAITING
            return (task, True) if delivered else None
        if not self.lists:
            return await self._recalled()
        try:
            page = await self.client.list_tasks(
                ListTasksRequest(
                    context_id=call.context,
                    history_length=HISTORY,
                    page_size=10,
                    include_artifacts=True,  # an ended task's answer
                )
            )
        except (A2AError, NotImplementedError) as exc:
            # Not served (or not as asked; the SDK's 0.3 transport has none): the record.
            log.info("a2a %s: ListTasks refused (%s): not asked again", call.remote, exc)
            self.lists = False
            return await self._recalled()
        tasks = [t for t in page.tasks if t.context_id == call.context]
        if not tasks:
            return None
        # Ours by message id when the history says; else the context's oldest (it is ours).
        mine = [t for t in tasks if call.holds_ours(t)] or tasks[-1:]
        return mine[0], False

    async def _recalled(self) -> tuple[Any, bool] | None:
        """The task :class:`RemoteTasks` recorded for this call (a fresh call's; an
        answer to a question is looked up by its task's id), if the remote still has
        it; None: to be sent."""
        from a2a.types import GetTaskRequest
        from a2a.utils.errors import TaskNotFoundError

        if self.tasks is None or self.call.waiting is not None:
            return None
        recorded = await self.tasks.recall(self.call.key)
        if recorded is None:
            return None
        self.call.recorded = recorded
        try:
            task = await self.client.get_task(GetTaskRequest(id=recorded, history_length=HISTORY))
        except TaskNotFoundError:
            return None
        return task, False

    async def _send(self) -> Any:
        from a2a.types import SendMessageConfiguration, SendMessageRequest

        request = SendMessageRequest(
            message=self.call.message(),
            configuration=SendMessageConfiguration(return_immediately=not self.streaming),
        )
        # Continuing a task that waits for input: its first reads may still show it waiting.
        resumed = self.call.waiting is not None
        events = self.client.send_message(request)
        if not self.lists:
            events = self._held_first(events)
        task = await self._consume(events, None, resumed)
        if task is None:
            raise DirectAnswer(["the remote agent answered no task"])
        if state_name(task) not in WAITING:
            resumed = False
        return await self._follow(task, resumed)

    async def _held_first(self, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``events`` with the first awaited past this attempt's step timeout (up to the
        call's deadline): on a remote without ListTasks the send's answer is the only
        way to learn the task it started; cut, the next attempt could not find it and
        would start another. Our stop lands once it is there (the cancel then names
        the task)."""
        iterator = aiter(events)
        first = None
        with trio.CancelScope(shield=True, deadline=self.call.deadline) as held:
            first = await anext(iterator, None)
        if held.cancelled_caught:
            await trio.lowlevel.checkpoint()  # the call's deadline passed: its timeout
        if first is None:
            return
        yield first
        async for event in iterator:
            yield event

    async def _resume(self, task: Any, resumed: bool) -> Any:
        from a2a.types import SubscribeToTaskRequest
        from a2a.utils.errors import UnsupportedOperationError

        self._seen(task)
        if settled(task, resumed) or not self.streaming:
            return await self._follow(task, resumed)
        try:
            events = self.client.subscribe(SubscribeToTaskRequest(id=task.id))
            task = await self._consume(events, task, resumed) or task
        except UnsupportedOperationError:
            pass  # it ended meanwhile: read it
        return await self._follow(task, resumed)

    async def _consume(self, events: AsyncIterator[Any], task: Any, resumed: bool) -> Any:
        """``task`` as a stream of events updates it, until it settles or the stream ends.
        Raises DirectAnswer for a message in place of a task."""
        from a2a.types import Task

        async for event in events:
            if event.HasField("task"):
                task = event.task
            elif event.HasField("message"):  # a direct answer, no task
                raise DirectAnswer(
                    [p.text for p in event.message.parts if p.WhichOneof("content") == "text"]
                )
            elif event.HasField("status_update"):
                update = event.status_update
                # A continued task's stream may start with its updates.
                task = task or Task(id=update.task_id, context_id=update.context_id)
                task.status.CopyFrom(update.status)
            elif event.HasField("artifact_update"):
                update = event.artifact_update
                task = task or Task(id=update.task_id, context_id=update.context_id)
                task.artifacts.append(update.artifact)
            if task is None:
                continue
            self._seen(task)
            await self._record(task)
            if settled(task, resumed):
                break
            if state_name(task) not in WAITING:
                resumed = False  # the answer is being worked on
        return task

    async def _follow(self, task: Any, resumed: bool) -> Any:
        """``task`` read again until it ends or waits for input (a stream that stopped
        early, a non-streaming remote)."""
        from a2a.types import GetTaskRequest

        delay = POLL_MIN
        while not settled(task, resumed):
            await trio.sleep(delay)
            delay = min(delay * 2, POLL_MAX)
            task = await self.client.get_task(GetTaskRequest(id=task.id))
            self._seen(task)
            await self._record(task)
            if state_name(task) not in WAITING:
                resumed = False
        return task

    async def _record(self, task: Any) -> None:
        """Record the task a remote without ListTasks started for this call, once."""
        if self.lists or self.tasks is None or not task.id or task.id == self.call.recorded:
            return
        await self.tasks.remember(self.call, task.id)

    def _seen(self, task: Any) -> None:
        self.call.task_id = task.id
        self.call.task = task
