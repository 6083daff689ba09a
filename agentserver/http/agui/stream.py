"""One AG-UI run's events, read from our Turn (docs/ag-ui.md, "The stream").

The store is the source of truth: the Turn's cards (model messages, tool calls and their
results, the deliverable) and its approvals are read through the agent store's views, the
same on SQLite and PostgreSQL, and each new card becomes its AG-UI events. The event bus
only adds what the store does not keep, and wakes the reader: the model's text as it
streams (``TEXT_MESSAGE_CONTENT`` per chunk), steps, and the agent's activity (state
deltas). A Turn run by another process (PostgreSQL) publishes nothing here: it is read by
polling, every :data:`POLL_MIN` seconds backing off to :data:`POLL_MAX`, its text then
arriving as whole messages.

A stream that starts on a Turn already under way (a client reconnecting, a run resuming
after an interrupt) begins with a ``MESSAGES_SNAPSHOT`` of the conversation so far, then
goes on with the rest of the run as it happens.

Imports the ``ag-ui-protocol`` package (the ``agui`` extra): imported by the route only.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from ag_ui.core import (
    PROTOCOL_VERSION,
    AssistantMessage,
    BaseEvent,
    FunctionCall,
    Interrupt,
    MessagesSnapshotEvent,
    RunErrorEvent,
    RunFinishedEvent,
    RunStartedEvent,
    StateDeltaEvent,
    StateSnapshotEvent,
    StepFinishedEvent,
    StepStartedEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    TokenUsage,
    ToolCall,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
    ToolMessage,
    UserMessage,
)
from ag_ui.core.events import (
    RunFinishedCancelledOutcome,
    RunFinishedInterruptOutcome,
)

from agentserver.agents.errors import StoreError, TurnPruned
from agentserver.agents.events import (
    ChunkEvent,
    Event,
    StateEvent,
    StepEvent,
    Subscription,
)
from agentserver.core.xmlsafe import SafeParser

log = logging.getLogger("agentserver.agui")

#: Seconds between two reads of a quiet Turn, at first and at most.
POLL_MIN = 0.05
POLL_MAX = 1.0
#: Seconds of silence before a keep-alive comment.
KEEPALIVE = 15.0
#: What an approval interrupt's answer (a resume entry's ``payload``) looks like.
APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "grant": {"type": "boolean", "description": "true approves the call, false denies it"},
        "reason": {"type": "string", "description": "why (the agent is told on a denial)"},
    },
    "required": ["grant"],
}
#: An interrupt's reason when a tool call waits for an approval.
APPROVAL_REASON = "approval"

_SHOWN = ("llm.message", "tool.call", "tool.refused", "tool.result", "task.deliverable")


class TurnViews(Protocol):
    """The store's views a stream reads (:class:`agentserver.http.agents_view.AgentsView`)."""

    async def task(
        self, name: str, thread: str, sender: str | None = None
    ) -> dict[str, Any] | None: ...

    async def turn_log(self, turn: str) -> dict[str, Any]: ...

    async def turn_task(self, turn: str) -> tuple[str | None, str | None, str | None]: ...


def interrupt_id(thread: str, request: str) -> str:
    """An approval's interrupt id: the run's thread and the approval request (a resume
    entry names both, so it finds the Turn and decides the request)."""
    return f"{thread}/{request}"


def read_interrupt_id(value: str) -> tuple[str, str] | None:
    """(thread, request) of an interrupt id, or None when it is not one of ours."""
    thread, sep, request = value.partition("/")
    if not sep or not thread or not request or "/" in request:
        return None
    return thread, request


def encode(event: BaseEvent) -> str:
    """One event as an SSE message (AG-UI's own encoding: ``data:`` and its JSON)."""
    return f"data: {event.model_dump_json(by_alias=True)}\n\n"


def _payload_text(xml: str, parser: SafeParser) -> str:
    """What a person reads of a task payload: its text (the XML when it is not XML)."""
    try:
        root = parser.parse(xml.encode("utf-8"))
    except Exception:
        return xml
    return " ".join("".join(root.itertext()).split()) or xml


def _args(card: dict[str, Any]) -> str:
    """A tool call's arguments as AG-UI carries them (a JSON text): the payload sent."""
    return json.dumps({"payload": card["text"]})


@dataclass
class RunStream:
    """The events of one run: the Turn of agent ``agent``'s task on ``thread``."""

    views: TurnViews
    agent: str
    thread: str
    thread_id: str
    run_id: str
    #: The bus subscription (None: no bus; polled only).
    sub: Subscription | None
    #: Set when the server shuts down: the stream ends (the client may reconnect).
    closing: trio.Event
    #: The run is fresh (its task was just sent): no snapshot of what came before.
    fresh: bool = True
    turn: str | None = None
    #: Cards already turned into events (by seq).
    seen: set[int] = field(default_factory=set)
    #: The assistant message streamed now (its id), and the steps whose start was seen
    #: live (their chunks stream; a step begun before the stream shows as a whole).
    open_message: str | None = None
    live_steps: set[str] = field(default_factory=set)
    ended_messages: set[str] = field(default_factory=set)
    retried: dict[str, int] = field(default_factory=dict)
    last_message: str | None = None
    #: Our tool call ids -> the ids the stream shows them by (:meth:`_call_id`).
    calls: dict[str, str] = field(default_factory=dict)
    #: The step begun (``STEP_STARTED`` sent) and not yet finished.
    open_step: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    _parser: SafeParser = field(default_factory=SafeParser)
    _turns: dict[str, bool] = field(default_factory=dict)

    def message_id(self, step: str) -> str:
        attempt = self.retried.get(step)
        return step if attempt is None else f"{step}.retry{attempt}"

    # -- the whole stream ---------------------------------------------------------------

    async def events(self) -> AsyncIterator[str]:
        """The run's SSE text: ``RUN_STARTED``, a state snapshot, the Turn's events, and
        ``RUN_FINISHED`` (success, interrupt or cancelled) or ``RUN_ERROR``."""
        yield encode(
            RunStartedEvent(
                thread_id=self.thread_id, run_id=self.run_id, protocol_version=PROTOCOL_VERSION
            )
        )
        self.state = {
            "agent": self.agent,
            "thread": self.thread,
            "status": "queued",
            "activity": "",
            "tool": "",
            "steps": 0,
        }
        yield encode(StateSnapshotEvent(snapshot=dict(self.state)))
        delay = POLL_MIN
        quiet_since = trio.current_time()
        while not self.closing.is_set():
            try:
                out, end = await self.read_store()
            except (StoreError, sqlite3.Error) as exc:
                # Mid-stream: no response to fail; the next poll reads it again.
                log.warning("AG-UI stream: the agent store could not be read: %s", exc)
                out, end = [], False
            for stored in out:
                yield encode(stored)
            if end:
                return
            changed = bool(out)
            deadline = trio.current_time() + delay
            while True:
                event = await self._next(deadline)
                if event is None:
                    break
                live = await self.live(event)
                for item in live:
                    yield encode(item)
                if live:
                    changed = True
                if not isinstance(event, ChunkEvent) and await self._ours(event):
                    break  # something the store shows may have changed: read it now
            if self.closing.is_set():
                return
            now = trio.current_time()
            if changed:
                delay, quiet_since = POLL_MIN, now
            else:
                delay = min(delay * 2, POLL_MAX)
                if now - quiet_since >= KEEPALIVE:
                    quiet_since = now
                    yield ": keep-alive\n\n"

    async def _next(self, deadline: float) -> Event | None:
        """The next bus event before ``deadline`` (None: none, or no bus)."""
        if self.sub is None:
            with trio.move_on_at(deadline):
                await self.closing.wait()
            return None
        if self.sub.dropped:
            # Fallen behind (its buffer overflowed): polled from now on, as a Turn of
            # another process is (the store is the truth; only live text is lost).
            self.sub.close()
            self.sub = None
            return None
        with trio.move_on_at(deadline):
            try:
                return await self.sub.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                self.sub = None
        return None

    async def _ours(self, event: Event) -> bool:
        """Whether a bus event belongs to this run's Turn."""
        turn = getattr(event, "agent_turn_id", None)
        if getattr(event, "agent_id", None) != self.agent or not turn:
            return False
        if self.turn is not None:
            return turn == self.turn
        known = self._turns.get(turn)
        if known is None:
            try:
                caller, _hop, _sender = await self.views.turn_task(turn)
            except Exception as exc:  # the store unreachable: the poll reads it later
                log.warning("AG-UI stream: the agent store could not be read: %s", exc)
                return False
            known = self._turns[turn] = caller == self.thread
        if known:
            self.turn = turn
        return known

    # -- live events (the bus) ------------------------------------------------------------

    async def live(self, event: Event) -> list[BaseEvent]:
        """The events a bus event of this run's Turn adds (text as it streams, steps,
        activity); nothing for another Turn's."""
        if not isinstance(event, ChunkEvent | StepEvent | StateEvent):
            return []
        if not await self._ours(event):
            return []
        out: list[BaseEvent] = []
        if isinstance(event, ChunkEvent):
            if event.step_id not in self.live_steps or not event.text:
                return []
            message = self.message_id(event.step_id)
            if message in self.ended_messages:
                return []
            if self.open_message != message:
                out += self._close_message()
                out.append(TextMessageStartEvent(message_id=message, role="assistant"))
                self.open_message = message
            out.append(TextMessageContentEvent(message_id=message, delta=event.text))
        elif isinstance(event, StepEvent):
            if event.phase == "started":
                self.live_steps.add(event.step_id)
                out += self._finish_step()
                out.append(StepStartedEvent(step_name=event.step_id))
                self.open_step = event.step_id
                out += self._set(
                    steps=max(self.state["steps"], len(self.live_steps)), status="running"
                )
            elif event.phase == "retrying":
                # The chunks so far belonged to the failed attempt: that message ends
                # as it is; the retry's text is a message of its own.
                out += self._close_message()
                self.retried[event.step_id] = event.attempt
            elif event.phase == "completed" and event.step_id == self.open_step:
                out += self._finish_step()
        elif isinstance(event, StateEvent):
            out += self._set(activity=event.activity, tool=event.current_tool)
        return out

    def _set(self, **values: Any) -> list[BaseEvent]:
        """A state delta (JSON Patch ``replace``s) for the values that changed."""
        ops = [
            {"op": "replace", "path": f"/{key}", "value": value}
            for key, value in values.items()
            if self.state.get(key) != value
        ]
        if not ops:
            return []
        self.state.update(values)
        # JSON Patch as JSON: validated into the SDK's operation models (which it does not
        # export), as its constructor would.
        return [StateDeltaEvent.model_validate({"delta": ops})]

    def _finish_step(self) -> list[BaseEvent]:
        """``STEP_FINISHED`` of the step begun, if any: a step ends when the next one
        begins or the run ends (the worker says "completed" only for some)."""
        if self.open_step is None:
            return []
        step, self.open_step = self.open_step, None
        return [StepFinishedEvent(step_name=step)]

    def _close_message(self) -> list[BaseEvent]:
        if self.open_message is None:
            return []
        message, self.open_message = self.open_message, None
        self.ended_messages.add(message)
        return [TextMessageEndEvent(message_id=message)]

    # -- the store ----------------------------------------------------------------------

    async def read_store(self) -> tuple[list[BaseEvent], bool]:
        """The events of what the store shows that were not sent yet, and whether the
        run ended with them."""
        try:
            task = await self.views.task(self.agent, self.thread)
        except TurnPruned:
            return [RunErrorEvent(message="the run was removed by retention", code="pruned")], True
        if task is None:
            return [], False
        out: list[BaseEvent] = []
        if task.get("turn") and self.turn is None:
            self.turn = task["turn"]
        status = task["status"]
        if self.turn is None:
            if status == "queued":
                return [], False
            # Ended before it ran (cancelled while queued, refused).
            out += self._set(status=status)
            return [*out, self._ended(status, task.get("answer") or "", task)], True
        log_ = await self.views.turn_log(self.turn)
        cards = log_["cards"]
        for card in cards:
            if card["type"] == "tool.call":
                # Its id may have changed since it was shown (a call approved meanwhile
                # gets its own): the results it gets are named by its first id still.
                self._call_id(card)
        # The Turn's own cards begin at its task; those before it are the memory it
        # was given (the conversation's earlier runs).
        starts = [i for i, c in enumerate(cards) if c["type"] == "task.input"]
        own = cards[starts[-1] :] if starts else cards
        if not self.seen:
            if self.fresh:
                self.seen.update(c["seq"] for c in cards[: len(cards) - len(own) + 1])
            else:
                # A stream on a Turn under way: what came before, as one snapshot.
                self.seen.update(c["seq"] for c in cards)
                out.append(MessagesSnapshotEvent(messages=self.snapshot(cards)))
                for card in cards:
                    if card["type"] == "llm.message":
                        step = str(card["metadata"].get("step_id", card["seq"]))
                        self.ended_messages.add(self.message_id(step))
        deliverable = None
        for card in own:
            if card["type"] == "task.deliverable":
                deliverable = card
                break
            if card["seq"] in self.seen:
                continue
            self.seen.add(card["seq"])
            out += self._card(card)
        if deliverable is not None:
            # The task was read before the cards: read it again for its final figures
            # (two reads, not one transaction: on PostgreSQL the Turn may end between).
            ended = str(deliverable["metadata"].get("status") or "finished")
            task = await self.views.task(self.agent, self.thread) or task
            out += self._close_message() + self._finish_step()
            out += self._set(status=ended, activity="", tool="", steps=self._steps(task))
            return [*out, self._ended(ended, deliverable["text"], task)], True
        out += self._set(status="running", steps=self._steps(task))
        pending = [a for a in log_.get("approvals", []) if a["status"] == "pending"]
        # The approval is written with the step, its call's card with the suspend just
        # after: until that card is there too, the interrupt waits for the next read (it
        # names that call, which the stream must have shown first).
        if pending and all(f"approval:{a['request']}" in self.calls.values() for a in pending):
            out += self._close_message() + self._finish_step()
            out += self._set(status="waiting for approval", activity="", tool="")
            return [*out, self._interrupted(pending)], True
        return out, False

    def _steps(self, task: dict[str, Any]) -> int:
        """The steps begun: the store's count (a stream begun late learns the earlier
        ones), or the live one when the store has not caught up yet."""
        return max(len(self.live_steps), len(task.get("steps") or []))

    def _card(self, card: dict[str, Any]) -> list[BaseEvent]:
        """The events of one new card of the Turn."""
        kind, metadata = card["type"], card["metadata"]
        out: list[BaseEvent] = []
        if kind == "llm.message":
            message = self.message_id(str(metadata.get("step_id", card["seq"])))
            self.last_message = message
            if self.open_message == message:
                return self._close_message()  # streamed: its text is all there
            if message in self.ended_messages:
                return []
            out += self._close_message()
            self.ended_messages.add(message)
            out.append(TextMessageStartEvent(message_id=message, role="assistant"))
            if card["text"]:
                out.append(TextMessageContentEvent(message_id=message, delta=card["text"]))
            out.append(TextMessageEndEvent(message_id=message))
        elif kind in ("tool.call", "tool.refused"):
            out += self._close_message()
            call = self._call_id(card)
            out.append(
                ToolCallStartEvent(
                    tool_call_id=call,
                    tool_call_name=str(metadata.get("to", "?")),
                    parent_message_id=self.last_message,
                )
            )
            out.append(ToolCallArgsEvent(tool_call_id=call, delta=_args(card)))
            out.append(ToolCallEndEvent(tool_call_id=call))
            if kind == "tool.refused":
                out.append(
                    ToolCallResultEvent(
                        message_id=f"result-{call}",
                        tool_call_id=call,
                        content=f"refused: {card['text']}",
                        role="tool",
                    )
                )
        elif kind == "tool.result":
            call = self._result_id(card)
            text = card["text"]
            if metadata.get("failed"):
                text = f"failed: {text}"
            out.append(
                ToolCallResultEvent(
                    message_id=f"result-{call}", tool_call_id=call, content=text, role="tool"
                )
            )
        return out

    def _call_id(self, card: dict[str, Any]) -> str:
        """A tool call's id for AG-UI: one that holds for the call's life. A call that
        waits for an approval is ``approval:REQUEST`` (its interrupt names it too): the
        store gives it its own id only once approved, and a stream showing it before
        and one showing it after must name the same call."""
        metadata = card["metadata"]
        ours = str(metadata.get("tool_call_id") or f"refused-{card['seq']}")
        approval = metadata.get("approval")
        shown = f"approval:{approval}" if approval else ours
        self.calls.setdefault(ours, shown)
        return self.calls[ours]

    def _result_id(self, card: dict[str, Any]) -> str:
        """The AG-UI id of the call a tool result answers."""
        ours = str(card["metadata"].get("tool_call_id", card["seq"]))
        return self.calls.get(ours, ours)

    def snapshot(self, cards: list[dict[str, Any]]) -> list[Any]:
        """The conversation so far as AG-UI messages: each task as a user message, each
        model message (with the tool calls of its step) as an assistant one, each tool
        result as a tool message."""
        messages: list[Any] = []
        assistant: AssistantMessage | None = None
        for card in cards:
            kind, metadata = card["type"], card["metadata"]
            if kind == "task.input":
                assistant = None
                messages.append(
                    UserMessage(
                        id=f"task-{card['seq']}", content=_payload_text(card["text"], self._parser)
                    )
                )
            elif kind == "llm.message":
                step = str(metadata.get("step_id", card["seq"]))
                assistant = AssistantMessage(id=self.message_id(step), content=card["text"])
                self.last_message = assistant.id
                messages.append(assistant)
            elif kind in ("tool.call", "tool.refused"):
                call = self._call_id(card)
                tool = ToolCall(
                    id=call,
                    function=FunctionCall(name=str(metadata.get("to", "?")), arguments=_args(card)),
                )
                if assistant is None:
                    assistant = AssistantMessage(id=f"calls-{card['seq']}", tool_calls=[])
                    messages.append(assistant)
                assistant.tool_calls = [*(assistant.tool_calls or []), tool]
                if kind == "tool.refused":
                    messages.append(
                        ToolMessage(
                            id=f"result-{call}",
                            tool_call_id=call,
                            content=f"refused: {card['text']}",
                        )
                    )
            elif kind == "tool.result":
                call = self._result_id(card)
                messages.append(
                    ToolMessage(id=f"result-{call}", tool_call_id=call, content=card["text"])
                )
        return messages

    def _ended(self, status: str, text: str, task: dict[str, Any]) -> BaseEvent:
        """The run's last event for a Turn (or task) that ended with ``status``."""
        usage = self._usage(task)
        if status == "succeeded":
            return RunFinishedEvent(
                thread_id=self.thread_id,
                run_id=self.run_id,
                result={"answer": text, "thread": self.thread},
                usage=usage,
            )
        if status == "stopped":
            return RunFinishedEvent(
                thread_id=self.thread_id,
                run_id=self.run_id,
                outcome=RunFinishedCancelledOutcome(),
                usage=usage,
            )
        return RunErrorEvent(message=text or f"the run {status}", code=status, usage=usage)

    @staticmethod
    def _usage(task: dict[str, Any]) -> list[TokenUsage] | None:
        by_model: dict[str, list[int]] = {}
        for step in task.get("steps") or []:
            counts = by_model.setdefault(str(step.get("model") or ""), [0, 0])
            counts[0] += step.get("prompt_tokens") or 0
            counts[1] += step.get("completion_tokens") or 0
        return [
            TokenUsage(
                model=model or None,
                input_tokens=counts[0],
                output_tokens=counts[1],
                total_tokens=counts[0] + counts[1],
            )
            for model, counts in by_model.items()
        ] or None

    def _interrupted(self, pending: list[dict[str, Any]]) -> BaseEvent:
        return RunFinishedEvent(
            thread_id=self.thread_id,
            run_id=self.run_id,
            outcome=RunFinishedInterruptOutcome(
                interrupts=[
                    Interrupt(
                        id=interrupt_id(self.thread, a["request"]),
                        reason=APPROVAL_REASON,
                        message=f"The call to {a['target']} needs an approval (rule {a['rule']}).",
                        tool_call_id=f"approval:{a['request']}",
                        response_schema=APPROVAL_SCHEMA,
                        metadata={
                            "target": a["target"],
                            "rule": a["rule"],
                            "approver": a["approver"],
                        },
                    )
                    for a in pending
                ]
            ),
        )
