"""The A2A methods on our agents (docs/a2a.md): the SDK's ``RequestHandler``, called by
the SDK's own JSON-RPC dispatcher (which parses the requests into the SDK's types, checks
``A2A-Version`` and writes the answers and the SSE streams), carried out with our
gateway, our store and our operator commands.

A task is recorded in the store (``a2a_tasks``) before its payload is sent through the
HTTP gateway, on a new thread that is the task's id; from then on every answer is read
from the durable state (:mod:`agentserver.agents.store.sql.a2a`), so any process on the
store answers ``GetTask``, ``ListTasks`` and ``SubscribeToTask`` for a task sent to any
other. A task recorded and never sent (its process killed between the two) is sent by
its message's resend, once (docs/a2a.md, "A task recorded, never sent"). Waiting (a blocking ``SendMessage``, a stream) polls that state, every
:data:`POLL_MIN` seconds at first, backing off to :data:`POLL_MAX` while nothing changes:
bounded work per waiting request, none on a Turn's path. Cancelling a request (the client
gone) ends the wait; the task runs on (it is durable), and ``CancelTask`` is how a client
ends it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio
from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.types import (
    AgentCard,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskArtifactUpdateEvent,
    TaskPushNotificationConfig,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import (
    ContentTypeNotSupportedError,
    ExtendedAgentCardNotConfiguredError,
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf.json_format import MessageToDict, MessageToJson, Parse
from lxml import etree

from agentserver.agents.errors import TurnPruned
from agentserver.agents.store.base import StoreCalls
from agentserver.agents.store.sql import a2a, a2a_push
from agentserver.core.access import AccessRule
from agentserver.core.envelope import build_envelope
from agentserver.core.handshake import Identity
from agentserver.core.namespaces import CORE_NS
from agentserver.core.payloads import model_xml
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser
from agentserver.http.a2a.card import CardFacts, server_card
from agentserver.http.a2a.push import PushRefused, check_push_url, read_config, stored_config
from agentserver.http.a2a.scope import AGENT, BASE_URL, IDENTITY
from agentserver.http.a2a.skills import SKILL_KEY, A2aSkill, MessageRefused
from agentserver.http.a2a.tasks import (
    INTERRUPTED,
    TERMINAL,
    answer_artifact,
    page_token,
    read_page_token,
    state_filter,
    state_of,
    to_task,
)
from agentserver.http.a2a.versions import protocol_of
from agentserver.http.sendonce import SendOnce
from agentserver.net.roles import OperatorCommands
from agentserver.primitives.approval import NS as APPROVAL_NS
from agentserver.primitives.approval import ApprovalDecision

log = logging.getLogger("agentserver.a2a")

#: Seconds between two reads of a waited-on task's state, at first and at most.
POLL_MIN = 0.05
POLL_MAX = 1.0
#: ``ListTasks`` page sizes: the default and the most.
PAGE_DEFAULT = 50
PAGE_MAX = 100
#: The longest context id and message id taken (they name durable rows).
MAX_ID = 128
#: Seconds ``CancelTask`` waits for the task to be seen ended before answering.
CANCEL_WAIT = 10.0
_ACK = f"{{{APPROVAL_NS}}}approval-ack"


class Sender(Protocol):
    """The HTTP gateway (:class:`agentserver.http.gateway.HttpGateway`)."""

    async def send(
        self,
        identity: Identity,
        to: str | None,
        body: bytes,
        *,
        wait: bool,
        thread: str | None = None,
    ) -> Any: ...


class Conversations(Protocol):
    """Which conversation the next task on a thread continues (``AgentRuntime.expect_fork``)."""

    def expect_fork(self, agent_id: str, thread: str, conversation: str) -> None: ...


@dataclass(frozen=True, slots=True)
class A2aDeps:
    """What the handler works with, passed in by the composition root."""

    store: StoreCalls
    gateway: Sender
    skills: tuple[A2aSkill, ...]
    facts: CardFacts
    may_see: Callable[[Identity, str], bool]
    #: Seconds a blocking ``SendMessage`` waits (the HTTP API's ``wait-timeout``).
    wait_timeout: float
    conversations: Conversations | None = None
    operator: OperatorCommands | None = None
    #: boot.xml's ``public-url``: the cards' base URL (None: the request's).
    public_url: str | None = None
    #: ``<expose-a2a allow-private-push>``: push URLs on loopback and private ranges.
    allow_private_push: bool = False
    #: The authorization rule (agentserver/core/access.py): an operator sees and acts on
    #: every task; None: only the task's sender (a test's handler).
    access: AccessRule | None = None


class A2aHandler(RequestHandler):
    """Every A2A method on the exposed agents."""

    def __init__(self, deps: A2aDeps) -> None:
        self.deps = deps
        self.by_name = {s.name: s for s in deps.skills}
        self._parser = SafeParser()
        # One send of a task at a time in this process (http/sendonce.py): resends of
        # one message at once would otherwise each send it, on one thread.
        self._sending = SendOnce()

    # -- who and what ------------------------------------------------------------------------
    @staticmethod
    def identity(context: ServerCallContext | None) -> Identity:
        identity = context.state.get(IDENTITY) if context is not None else None
        if not isinstance(identity, Identity):  # the route authenticates every request
            raise InvalidParamsError("unauthenticated")
        return identity

    @staticmethod
    def owner(identity: Identity) -> str:
        return identity.name or ""

    @staticmethod
    def protocol(context: ServerCallContext | None) -> str:
        """The A2A version the request speaks (``0.3`` for 0.3's method names, which
        the SDK's adapter puts in the context as it converts them)."""
        return protocol_of(context.state.get("method") if context is not None else None)

    def visible(self, identity: Identity, context: ServerCallContext | None) -> list[A2aSkill]:
        """The skills ``identity`` may address through this endpoint."""
        only = context.state.get(AGENT) if context is not None else None
        return [
            s
            for s in self.deps.skills
            if (only is None or s.name == only) and self.deps.may_see(identity, s.name)
        ]

    def _skill(
        self, params: SendMessageRequest, identity: Identity, context: ServerCallContext | None
    ) -> A2aSkill:
        skills = {s.name: s for s in self.visible(identity, context)}
        named = None
        for metadata in (params.message.metadata, params.metadata):
            value = MessageToDict(metadata).get(SKILL_KEY) if metadata.fields else None
            if value is not None:
                named = value
                break
        if named is None:
            if len(skills) == 1:
                return next(iter(skills.values()))
            raise InvalidParamsError(
                f"name the skill in the message's metadata ({SKILL_KEY!r}): one of "
                + ", ".join(sorted(skills))
            )
        if not isinstance(named, str) or named not in skills:
            raise InvalidParamsError(f"unknown skill {named!r}")
        return skills[named]

    def _owns(self, identity: Identity, owner: str, method: str) -> bool:
        """The authorization rule on a task of ``owner`` ("" for an anonymous caller's);
        a refusal is counted and logged with ``method``."""
        rule = self.deps.access
        if rule is None:
            return owner == self.owner(identity)
        return rule.allows(identity.name, owner or None, door="a2a", route=method)

    async def _task_row(
        self, task_id: str, identity: Identity, method: str = "GetTask"
    ) -> dict[str, Any]:
        """The task's row, if ``identity`` sent it (or is an operator) and may still see
        its agent; another's answers TaskNotFound, as a missing one."""
        try:
            row = await self.deps.store.read(a2a.task, task_id) if len(task_id) <= MAX_ID else None
        except TurnPruned as exc:
            # Its record outlives it while its tombstone lasts (the message's idempotency
            # key): the task itself is gone, which its sender (only) is told as such.
            owner = exc.owner or ""
            if not self.deps.may_see(identity, exc.agent) or not self._owns(
                identity, owner, method
            ):
                raise TaskNotFoundError(f"no task {task_id!r}") from None
            raise TaskNotFoundError(
                f"task {task_id!r} was pruned by the store's retention"
            ) from None
        if (
            row is None
            or not self.deps.may_see(identity, row["agent"])
            or not self._owns(identity, row["owner"], method)
        ):
            raise TaskNotFoundError(f"no task {task_id!r}")
        return row

    # -- intake ----------------------------------------------------------------------------------
    async def _intake(
        self, params: SendMessageRequest, context: ServerCallContext | None
    ) -> dict[str, Any]:
        """Record the task and send its payload (once per message id); its row."""
        identity = self.identity(context)
        message = params.message
        if not message.message_id or len(message.message_id) > MAX_ID:
            raise InvalidParamsError(f"a message needs a messageId of at most {MAX_ID} characters")
        if message.task_id:
            return await self._continue(message, identity)
        skill = self._skill(params, identity, context)
        try:
            payload = skill.payload(message)
        except MessageRefused as exc:
            if exc.content:
                raise ContentTypeNotSupportedError(str(exc)) from None
            raise InvalidParamsError(str(exc)) from None
        context_id = message.context_id or new_thread_id()
        if len(context_id) > MAX_ID or not context_id.isprintable():
            raise InvalidParamsError(f"a contextId is at most {MAX_ID} printable characters")
        task_id = new_thread_id()
        kept = Message()
        kept.CopyFrom(message)
        kept.task_id, kept.context_id = task_id, context_id
        owner = self.owner(identity)
        found, new = await self.deps.store.run(
            a2a.record,
            task_id,
            skill.name,
            context_id,
            owner,
            message.message_id,
            MessageToJson(kept),
        )
        if new and params.configuration.HasField("task_push_notification_config"):
            # Before the task is sent: no state change goes unnoticed.
            await self._set_push(
                task_id,
                params.configuration.task_push_notification_config,
                self.protocol(context),
            )
        if new:
            async with self._sending.hold(task_id):
                await self._send(identity, skill, payload, owner, context_id, task_id)
        row = await self._recorded(found, message.message_id)
        if not new and row["view"] is None and row["refusal"] is None:
            # The same message again, its task recorded and never enqueued (the process
            # that recorded it was killed before sending it, or its send is still in
            # flight): send it again, from its record, unless this process's own send
            # of it (first or again) got it queued meanwhile. Across processes, the
            # agent's Enqueue of a task already enqueued is dropped
            # (agents/store/sql/a2a.py, earlier_send), so the task reaches its agent once.
            async with self._sending.hold(found):
                await self._sending.settle(found, lambda: self._stored(found))
                row = await self._recorded(found, message.message_id)
                if row["view"] is None and row["refusal"] is None:
                    row = await self._send_again(identity, row, found, message.message_id)
        return row

    async def _send_again(
        self, identity: Identity, row: dict[str, Any], task_id: str, message_id: str
    ) -> dict[str, Any]:
        """Send the recorded, never queued task ``task_id`` from its record; its row."""
        recorded = self.by_name.get(row["agent"])
        if recorded is None:
            return row
        try:
            resent = recorded.payload(Parse(row["message"], Message()))
        except MessageRefused as exc:
            # Recorded under another configuration (the skill's payload changed): it
            # cannot be sent as recorded, and says so as its end.
            await self.deps.store.run1(a2a.reject, task_id, f"refused: {exc}")
            return await self._recorded(task_id, message_id)
        await self._send(identity, recorded, resent, row["owner"], row["context_id"], task_id)
        return await self._recorded(task_id, message_id)

    async def _send(
        self,
        identity: Identity,
        skill: A2aSkill,
        payload: etree._Element,
        owner: str,
        context_id: str,
        task_id: str,
    ) -> None:
        """Send the recorded task ``task_id``'s payload to its agent, on its thread; a
        refusal is recorded as its end (``rejected``). Called holding the task's key;
        the next holder settles it first (:meth:`SendOnce.settle`), so it sees the task
        in the store."""
        if skill.memory and self.deps.conversations is not None:
            # Each context is its own conversation with the agent.
            self.deps.conversations.expect_fork(skill.name, task_id, f"a2a:{owner}:{context_id}")
        outcome = await self.deps.gateway.send(
            identity, skill.name, etree.tostring(payload), wait=False, thread=task_id
        )
        if outcome.kind == "refused":
            await self.deps.store.run1(a2a.reject, task_id, f"refused: {outcome.refusal}")
            return
        self._sending.sent(task_id)

    async def _stored(self, task_id: str) -> bool:
        """Whether the store holds task ``task_id``'s send (queued, refused or gone)."""
        try:
            row = await self.deps.store.read(a2a.task, task_id)
        except TurnPruned:
            return True
        return row is None or row["view"] is not None or row["refusal"] is not None

    async def _recorded(self, task_id: str, message_id: str) -> dict[str, Any]:
        """The row of the task ``task_id`` recorded for ``message_id``."""
        try:
            row = await self.deps.store.read(a2a.task, task_id)
        except TurnPruned:
            # The same message again, after retention removed its task.
            raise TaskNotFoundError(
                f"message {message_id!r} was task {task_id!r}, pruned by the store's "
                "retention: send a new message (a new messageId)"
            ) from None
        assert row is not None
        return row

    async def _continue(self, message: Message, identity: Identity) -> dict[str, Any]:
        """A message on an existing task: the answer to its approval (a data part with
        ``grant``, sent by the approval's approver); nothing else continues a task."""
        row = await self._task_row(message.task_id, identity, "SendMessage")
        state, _ = state_of(row)
        if state != TaskState.TASK_STATE_INPUT_REQUIRED:
            raise UnsupportedOperationError(
                "a task takes no further messages: send a new message in its context"
            )
        fields: dict[str, Any] = {}
        for part in message.parts:
            if part.WhichOneof("content") == "data":
                data = MessageToDict(part.data)
                fields.update(data if isinstance(data, dict) else {})
        grant = fields.get("grant")
        if not isinstance(grant, bool):
            raise InvalidParamsError(
                'answer an approval with a data part {"grant": true|false, "reason": "..."}'
            )
        asks = row["asks"]
        decision = ApprovalDecision(
            request=asks["request"], grant=grant, reason=str(fields.get("reason", ""))[:2000]
        )
        outcome = await self.deps.gateway.send(
            identity, row["agent"], model_xml(decision), wait=True
        )
        status = None
        if outcome.kind == "reply":
            root = self._parser.parse(outcome.reply)
            if len(root) > 1 and root[1].tag == _ACK:
                status = root[1].get("status")
        if status not in ("applied", "duplicate"):
            raise InvalidParamsError(
                f"the decision on approval request {asks['request']} was not applied: "
                f"{status or 'no answer'}"
            )
        fresh = await self.deps.store.read(a2a.task, row["task_id"])
        assert fresh is not None
        return fresh

    # -- waiting ---------------------------------------------------------------------------------
    async def _changes(
        self, row: dict[str, Any], *, stop_interrupted: bool
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The task's row each time its state changes, until a terminal state (or an
        interrupted one newly reached, with ``stop_interrupted``)."""
        last = state_of(row)
        delay = POLL_MIN
        while last[0] not in TERMINAL:
            await trio.sleep(delay)
            try:
                fresh = await self.deps.store.read(a2a.task, row["task_id"])
            except TurnPruned:
                return  # ended and pruned meanwhile: nothing more will change
            if fresh is None:
                return
            now = state_of(fresh)
            if now == last:
                delay = min(delay * 2, POLL_MAX)
                continue
            delay = POLL_MIN
            last = now
            yield fresh
            if stop_interrupted and now[0] in INTERRUPTED:
                return

    async def _events(
        self, row: dict[str, Any], first: Task, *, stop_interrupted: bool
    ) -> AsyncGenerator[Any, None]:
        """The task, then a status update per change (``working`` always among them, once
        the Turn has started); the answer as an artifact before the final status."""
        yield first
        if state_of(row)[0] in TERMINAL:
            return
        working = False  # a status update said working
        async for fresh in self._changes(row, stop_interrupted=stop_interrupted):
            task = to_task(fresh, 0)
            if not working and task.status.state != TaskState.TASK_STATE_SUBMITTED:
                # The Turn ran, however briefly: a poll may have missed its running state.
                working = True
                if task.status.state != TaskState.TASK_STATE_WORKING:
                    yield TaskStatusUpdateEvent(
                        task_id=task.id,
                        context_id=task.context_id,
                        status=TaskStatus(state=TaskState.TASK_STATE_WORKING),
                    )
            if task.status.state == TaskState.TASK_STATE_COMPLETED:
                yield TaskArtifactUpdateEvent(
                    task_id=task.id,
                    context_id=task.context_id,
                    artifact=answer_artifact(fresh),
                    last_chunk=True,
                )
            yield TaskStatusUpdateEvent(
                task_id=task.id, context_id=task.context_id, status=task.status
            )

    # -- the methods -----------------------------------------------------------------------------
    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext | None = None
    ) -> Task | Message:
        row = await self._intake(params, context)
        config = params.configuration
        history = config.history_length if config.HasField("history_length") else None
        if not config.return_immediately and state_of(row)[0] not in TERMINAL | INTERRUPTED:
            # Blocking: until the task ends or waits for input, at most wait-timeout.
            with trio.move_on_after(self.deps.wait_timeout):
                async for fresh in self._changes(row, stop_interrupted=True):
                    row = fresh
        return to_task(row, history)

    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext | None = None
    ) -> AsyncGenerator[Any, None]:
        row = await self._intake(params, context)
        async for event in self._events(row, to_task(row), stop_interrupted=True):
            yield event

    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext | None = None
    ) -> AsyncGenerator[Any, None]:
        row = await self._task_row(params.id, self.identity(context), "SubscribeToTask")
        if state_of(row)[0] in TERMINAL:
            raise UnsupportedOperationError("the task has ended: GetTask reads it")
        async for event in self._events(row, to_task(row), stop_interrupted=False):
            yield event

    async def on_get_task(
        self, params: GetTaskRequest, context: ServerCallContext | None = None
    ) -> Task | None:
        row = await self._task_row(params.id, self.identity(context))
        return to_task(row, params.history_length if params.HasField("history_length") else None)

    async def on_list_tasks(
        self, params: ListTasksRequest, context: ServerCallContext | None = None
    ) -> ListTasksResponse:
        identity = self.identity(context)
        size = params.page_size if params.HasField("page_size") else PAGE_DEFAULT
        if not 1 <= size <= PAGE_MAX:
            raise InvalidParamsError(f"pageSize is 1 to {PAGE_MAX}")
        after = read_page_token(params.page_token)
        agents = [s.name for s in self.visible(identity, context)]
        rule = self.deps.access
        # An operator lists every sender's tasks (the authorization rule); a client its own.
        owner = self.owner(identity) if rule is None or not rule.sees_all(identity.name) else None
        rows, total, more = await self.deps.store.read(
            a2a.tasks,
            owner,
            params.context_id or None,
            agents,
            size,
            after,
            state_filter(params),
        )
        history = params.history_length if params.HasField("history_length") else 0
        tasks = [to_task(r, history) for r in rows]
        if not params.include_artifacts:  # the spec's default: listings without them
            for task in tasks:
                task.ClearField("artifacts")
        return ListTasksResponse(
            tasks=tasks,
            next_page_token=page_token(rows[-1]) if more and rows else "",
            page_size=size,
            total_size=total,
        )

    async def on_cancel_task(
        self, params: CancelTaskRequest, context: ServerCallContext | None = None
    ) -> Task | None:
        identity = self.identity(context)
        row = await self._task_row(params.id, identity, "CancelTask")
        if state_of(row)[0] in TERMINAL:
            raise TaskNotCancelableError(f"the task has ended ({to_task(row).status.state})")
        operator = self.deps.operator
        if operator is None:
            raise UnsupportedOperationError("no operator commands on this server")
        # Our operator's cancel: a queued task is skipped with its failed answer, a
        # running one stopped (on whichever process runs it).
        command = etree.Element(f"{{{CORE_NS}}}cancel", nsmap={None: CORE_NS})
        command.set("agent", row["agent"])
        command.set("thread", row["task_id"])
        sender = identity.name or "a2a"
        frame = etree.tostring(build_envelope(sender, None, new_thread_id(), command))
        await operator.handle(frame, sender)
        with trio.move_on_after(CANCEL_WAIT):
            async for fresh in self._changes(row, stop_interrupted=False):
                row = fresh
        state = state_of(row)[0]
        if state not in TERMINAL:
            raise TaskNotCancelableError("the task did not end when cancelled")
        return to_task(row)

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext | None = None
    ) -> AgentCard:
        identity = self.identity(context)
        if identity.name is None or not self.deps.facts.secured:
            raise ExtendedAgentCardNotConfiguredError("no extended card for anonymous callers")
        base = self.deps.public_url or (context.state.get(BASE_URL, "") if context else "")
        return server_card(self.deps.facts, base, self.visible(identity, None))

    # -- push notifications ------------------------------------------------------------------
    async def _set_push(
        self, task_id: str, config: TaskPushNotificationConfig, protocol: str
    ) -> TaskPushNotificationConfig:
        """Keep ``config`` on the task; its notifications are in ``protocol``'s shape
        (the version of the request that set it)."""
        try:
            await check_push_url(config.url, allow_private=self.deps.allow_private_push)
        except PushRefused as exc:
            raise InvalidParamsError(str(exc)) from None
        kept = TaskPushNotificationConfig()
        kept.CopyFrom(config)
        kept.task_id = task_id
        kept.id = config.id or new_thread_id()
        if len(kept.id) > MAX_ID:
            raise InvalidParamsError(f"a config id is at most {MAX_ID} characters")
        await self.deps.store.run1(
            a2a_push.put_config, task_id, kept.id, stored_config(kept, protocol)
        )
        return kept

    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext | None = None
    ) -> TaskPushNotificationConfig:
        row = await self._task_row(params.task_id, self.identity(context), "CreateTaskPushConfig")
        return await self._set_push(row["task_id"], params, self.protocol(context))

    async def _configs(self, task_id: str) -> list[TaskPushNotificationConfig]:
        return [
            read_config(text)[0]
            for _, text in await self.deps.store.read(a2a_push.configs, task_id)
        ]

    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext | None = None
    ) -> TaskPushNotificationConfig:
        row = await self._task_row(params.task_id, self.identity(context), "GetTaskPushConfig")
        for config in await self._configs(row["task_id"]):
            if config.id == params.id:
                return config
        raise TaskNotFoundError(f"no push config {params.id!r} on task {params.task_id!r}")

    async def on_list_task_push_notification_configs(
        self,
        params: ListTaskPushNotificationConfigsRequest,
        context: ServerCallContext | None = None,
    ) -> ListTaskPushNotificationConfigsResponse:
        row = await self._task_row(params.task_id, self.identity(context), "ListTaskPushConfigs")
        return ListTaskPushNotificationConfigsResponse(configs=await self._configs(row["task_id"]))

    async def on_delete_task_push_notification_config(
        self,
        params: DeleteTaskPushNotificationConfigRequest,
        context: ServerCallContext | None = None,
    ) -> None:
        row = await self._task_row(params.task_id, self.identity(context), "DeleteTaskPushConfig")
        if not await self.deps.store.run1(a2a_push.delete_config, row["task_id"], params.id):
            raise TaskNotFoundError(f"no push config {params.id!r} on task {params.task_id!r}")
