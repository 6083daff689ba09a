"""The chaos bench's A2A client (issue 43; docs/a2a.md): tasks sent over A2A under kills.

The organism exposes ``beta`` and ``gamma`` (``<expose-a2a>``; the agents without memory)
on each server's HTTP API. The named client ``a2a`` keeps up to :data:`MAX_OPEN` tasks
open, each sent one way, drawn from the seed:

- ``send``: ``SendMessage``, blocking (the task comes back when it ends or needs input);
- ``send-async``: ``SendMessage`` with ``returnImmediately``, then followed with
  ``SubscribeToTask``;
- ``stream``: ``SendStreamingMessage``, read to its end; now and then the client drops
  the stream early, on purpose, and resumes with ``SubscribeToTask`` on any live server.

A server killed under a call breaks it: with the task's id known the client resubscribes
(an ended task answers UnsupportedOperation: ``GetTask`` reads it), without it the client
sends the same message again (the same ``messageId``: the server must answer with the
same task, nothing sent twice). Some tasks are cancelled (``CancelTask``) a few seconds
in. A task waiting for an approval (``input-required``) is followed until it ends: the
bench's approver decides it over her socket.

:func:`check_a2a`, after the drain (each task read once more with ``GetTask``): every
message became exactly one task (``a2a_twice``), every task ended (``a2a_unended``), in
one terminal state however often and wherever it was seen (``a2a_ended_differently``),
and a completed task's answer carries its nonce and the proofs its plan needs
(``a2a_wrong_content``). Raw JSON-RPC over httpx (under trio), header ``A2A-Version: 1.0``;
:data:`V03_SHARE` of the tasks (issue 47) are sent and followed with A2A 0.3's wire
instead (docs/a2a.md, "Versions": ``message/send``, ``message/stream``,
``tasks/resubscribe``, ``tasks/get``, ``tasks/cancel``, 0.3's shapes), half of them with
``A2A-Version: 0.3`` and half with no header; the same checks, counted by wire
(``a2a_by_wire``).

A library module of bench/chaos.py (not a bench).
"""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio
from chaos_check import content_proves

#: The client's name in boot.xml, and the agents it talks to (no memory: a task is whole).
CLIENT = "a2a"
AGENTS = ("beta", "gamma")
MAX_OPEN = 3
TERMINAL = {
    "TASK_STATE_COMPLETED": "completed",
    "TASK_STATE_FAILED": "failed",
    "TASK_STATE_CANCELED": "canceled",
    "TASK_STATE_REJECTED": "rejected",
    # 0.3's states, in lower case.
    "completed": "completed",
    "failed": "failed",
    "canceled": "canceled",
    "rejected": "rejected",
}
#: The share of tasks sent with A2A 0.3's wire (its method names and shapes; half of
#: them with ``A2A-Version: 0.3``, half with no header, which the spec reads as 0.3).
V03_SHARE = 0.3
#: 1.0's methods by their 0.3 names (docs/a2a.md, "Versions").
V03_METHODS = {
    "SendMessage": "message/send",
    "SendStreamingMessage": "message/stream",
    "SubscribeToTask": "tasks/resubscribe",
    "GetTask": "tasks/get",
    "CancelTask": "tasks/cancel",
}
#: The ways a task is sent (see the module docstring), and the chances of the extras.
OPS = ("send", "send-async", "stream")
DROP_STREAM_CHANCE = 0.3
CANCEL_CHANCE = 0.12
#: JSON-RPC error codes (docs/a2a.md).
UNSUPPORTED = -32004
NOT_CANCELABLE = -32002
TASK_NOT_FOUND = -32001


def expose_a2a_xml() -> str:
    """boot.xml's ``<expose-a2a>`` (loopback push URLs are never used here)."""
    agents = "".join(f'<agent name="{a}"/>' for a in AGENTS)
    return f"<expose-a2a>{agents}</expose-a2a>"


@dataclass
class A2aTask:
    """One message sent over A2A, and everything seen of its task."""

    message_id: str
    nonce: str
    agent: str
    op: str
    #: The wire it is sent and followed with: ``1.0`` or ``0.3`` (header or none).
    wire: str = "1.0"
    #: Task ids the server answered the message with (one, or a violation).
    task_ids: set[str] = field(default_factory=set)
    #: Every terminal state seen of it: (task id, state, text).
    ends: list[tuple[str, str, str]] = field(default_factory=list)
    #: The server said it had ended (SubscribeToTask: UnsupportedOperation), and
    #: retention pruned it before ``GetTask`` read its state (short windows here).
    pruned_unread: bool = False

    @property
    def ended(self) -> bool:
        return bool(self.ends) or self.pruned_unread


def _text(task_or_status: dict[str, Any]) -> str:
    """The texts of a task's artifacts and status message (or an update's)."""
    parts: list[str] = []
    for artifact in task_or_status.get("artifacts") or []:
        parts += [p.get("text", "") for p in artifact.get("parts") or []]
    if "artifact" in task_or_status:
        parts += [p.get("text", "") for p in task_or_status["artifact"].get("parts") or []]
    message = (task_or_status.get("status") or {}).get("message") or {}
    parts += [p.get("text", "") for p in message.get("parts") or []]
    return "\n".join(p for p in parts if p)


#: JSON-RPC's internal error: the server failed, which no call should ever see.
INTERNAL = -32603


class RpcError(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", ""))
        self.code = error.get("code")


class A2aClient:
    """The client ``a2a`` (see the module docstring). ``servers.pick(rng)``: a live slot
    (its ``http_url``); ``switches``: the bench's (sending, faults, stop, counts)."""

    def __init__(self, seed: int, servers: Any, switches: Any, token: str) -> None:
        self.rng = random.Random(f"{seed}:a2a")
        self.servers = servers
        self.switches = switches
        self.headers = {"Authorization": f"Bearer {token}", "A2A-Version": "1.0"}
        self.tasks: list[A2aTask] = []
        #: Every internal error (-32603) a call got: (method, message). A violation.
        self.internal_errors: list[tuple[str, str]] = []
        self.counts: Counter = Counter()
        self._ids = 0

    # -- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while not self.switches.stop:
                open_now = sum(1 for t in self.tasks if not t.ended)
                if self.switches.sending and open_now < MAX_OPEN:
                    task = A2aTask(
                        str(uuid.UUID(int=self.rng.getrandbits(128), version=4)),
                        f"{self.rng.getrandbits(64):016x}",
                        self.rng.choice(AGENTS),
                        self.rng.choice(OPS),
                    )
                    if self.rng.random() < V03_SHARE:
                        task.wire = self.rng.choice(("0.3", "0.3-no-header"))
                    self.tasks.append(task)
                    self.counts[f"a2a_sent_{task.op}"] += 1
                    self.counts[f"a2a_sent_wire_{task.wire}"] += 1
                    nursery.start_soon(self._one, task, random.Random(self.rng.random()))
                await trio.sleep(self.rng.uniform(0.3, 2.0))
            nursery.cancel_scope.cancel()

    def open(self) -> int:
        return sum(1 for t in self.tasks if not t.ended)

    async def _one(self, task: A2aTask, rng: random.Random) -> None:
        """Send ``task`` and follow it until a terminal state is seen."""
        async with trio.open_nursery() as nursery:
            if rng.random() < CANCEL_CHANCE:
                nursery.start_soon(self._cancel_later, task, rng.uniform(0.5, 6.0), rng)
            while not task.ended and not self.switches.stop:
                slot = await self.servers.pick(rng)
                if not slot.http_url:
                    await trio.sleep(0.2)
                    continue
                try:
                    async with httpx.AsyncClient(base_url=slot.http_url, timeout=90) as http:
                        if not task.task_ids:
                            await self._send(http, task, rng)
                        else:
                            await self._follow(http, task)
                except (httpx.HTTPError, OSError, json.JSONDecodeError):
                    self.counts["a2a_transport_errors"] += 1
                    await trio.sleep(rng.uniform(0.2, 1.0))
            nursery.cancel_scope.cancel()

    async def _send(self, http: httpx.AsyncClient, task: A2aTask, rng: random.Random) -> None:
        if self.counts.get(f"seen:{task.message_id}"):
            self.counts["a2a_resent_same_message_id"] += 1
        self.counts[f"seen:{task.message_id}"] = 1
        text = f"Please handle NONCE[{task.nonce}] with your tools."
        message: dict[str, Any] = {
            "messageId": task.message_id,
            "role": "ROLE_USER",
            "parts": [{"text": text}],
            "metadata": {"skill": task.agent},
        }
        if task.wire != "1.0":
            message.update(kind="message", role="user", parts=[{"kind": "text", "text": text}])
        if task.op == "stream":
            drop_after = rng.randint(1, 2) if rng.random() < DROP_STREAM_CHANCE else None
            await self._stream(http, task, "SendStreamingMessage", {"message": message}, drop_after)
            return
        params: dict[str, Any] = {"message": message}
        if task.op == "send-async":
            params["configuration"] = (
                {"returnImmediately": True} if task.wire == "1.0" else {"blocking": False}
            )
        result = await self._call(http, "SendMessage", params, task.wire)
        # 1.0 answers {"task": ...}; 0.3 the task itself (``kind: "task"``).
        self.saw(task, result.get("task") or (result if result.get("kind") == "task" else {}))

    async def _follow(self, http: httpx.AsyncClient, task: A2aTask) -> None:
        """Resume a task whose id is known: its stream, or, ended, ``GetTask``."""
        task_id = next(iter(task.task_ids))
        self.counts["a2a_resubscribes"] += 1
        try:
            await self._stream(http, task, "SubscribeToTask", {"id": task_id}, None)
        except RpcError as exc:
            if exc.code != UNSUPPORTED:
                raise
        else:
            return
        try:
            self.saw(task, await self._call(http, "GetTask", {"id": task_id}, task.wire))
        except RpcError as exc:
            if exc.code != TASK_NOT_FOUND:
                raise
            task.pruned_unread = True

    async def _stream(
        self,
        http: httpx.AsyncClient,
        task: A2aTask,
        method: str,
        params: dict[str, Any],
        drop_after: int | None,
    ) -> None:
        method, headers = self.wire_of(method, task.wire)
        body = {"jsonrpc": "2.0", "id": self._next_id(), "method": method, "params": params}
        events = 0
        artifact = ""
        async with http.stream("POST", "/a2a", json=body, headers=headers) as response:
            if "text/event-stream" not in response.headers.get("content-type", ""):
                answer = json.loads(await response.aread())
                if "error" in answer:
                    raise self._error(method, answer["error"])
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise self._error(method, event["error"])
                result = event.get("result") or {}
                kind = result.get("kind")  # 0.3: the event itself, named by its kind
                if "task" in result or kind == "task":
                    self.saw(task, result.get("task") or result)
                elif "statusUpdate" in result or kind == "status-update":
                    self.saw_update(task, result.get("statusUpdate") or result, artifact)
                elif "artifactUpdate" in result or kind == "artifact-update":
                    # The answer's artifact comes before its final status: kept with it.
                    artifact = _text(result.get("artifactUpdate") or result)
                events += 1
                if drop_after is not None and events >= drop_after and not task.ended:
                    self.counts["a2a_streams_dropped"] += 1
                    return  # the connection closes: the next round resubscribes

    async def _cancel_later(self, task: A2aTask, delay: float, rng: random.Random) -> None:
        await trio.sleep(delay)
        if task.ended or not task.task_ids or not self.switches.faults:
            return
        slot = await self.servers.pick(rng)
        try:
            async with httpx.AsyncClient(base_url=slot.http_url, timeout=30) as http:
                self.counts["a2a_cancels"] += 1
                got = await self._call(
                    http, "CancelTask", {"id": next(iter(task.task_ids))}, task.wire
                )
                self.saw(task, got)
        except RpcError as exc:
            if exc.code != NOT_CANCELABLE:
                self.counts["a2a_cancel_errors"] += 1
        except (httpx.HTTPError, OSError, json.JSONDecodeError):
            self.counts["a2a_transport_errors"] += 1

    # -- what was seen -------------------------------------------------------------------
    def saw(self, task: A2aTask, got: dict[str, Any]) -> None:
        """A task as a call answered it (1.0's or 0.3's shape): its id, and its end."""
        task_id = got.get("id")
        if not task_id:
            return
        task.task_ids.add(task_id)
        state = (got.get("status") or {}).get("state", "")
        if state in TERMINAL:
            task.ends.append((task_id, TERMINAL[state], _text(got)))

    def saw_update(self, task: A2aTask, update: dict[str, Any], artifact: str) -> None:
        """A stream's status update (``artifact``: the answer's text seen before it)."""
        task_id = update.get("taskId")
        if task_id:
            task.task_ids.add(task_id)
        state = (update.get("status") or {}).get("state", "")
        if state in TERMINAL and task_id:
            text = _text(update)
            if TERMINAL[state] == "completed":
                text = "\n".join(t for t in (artifact, text) if t)
            task.ends.append((task_id, TERMINAL[state], text))

    def wire_of(self, method: str, wire: str) -> tuple[str, dict[str, str]]:
        """The method's name and the request's headers on ``wire``."""
        if wire == "1.0":
            return method, self.headers
        headers = {k: v for k, v in self.headers.items() if k != "A2A-Version"}
        if wire == "0.3":
            headers["A2A-Version"] = "0.3"
        return V03_METHODS[method], headers

    async def _call(
        self, http: httpx.AsyncClient, method: str, params: dict[str, Any], wire: str = "1.0"
    ) -> dict:
        method, headers = self.wire_of(method, wire)
        body = {"jsonrpc": "2.0", "id": self._next_id(), "method": method, "params": params}
        answer = (await http.post("/a2a", json=body, headers=headers)).json()
        if "error" in answer:
            raise self._error(method, answer["error"])
        return answer.get("result") or {}

    def _error(self, method: str, error: dict[str, Any]) -> RpcError:
        if error.get("code") == INTERNAL:
            self.internal_errors.append((method, str(error.get("message", ""))[:200]))
        return RpcError(error)

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    # -- after the drain -----------------------------------------------------------------
    async def settle(self) -> None:
        """Read every task once more (``GetTask``, on a live server): its state now; and
        list them (``ListTasks``, which must answer however many retention pruned)."""
        slot = await self.servers.pick(self.rng)
        try:
            async with httpx.AsyncClient(base_url=slot.http_url, timeout=30) as http:
                listed = await self._call(http, "ListTasks", {"pageSize": 100})
            self.counts["a2a_listed"] = len(listed.get("tasks") or [])
        except RpcError as exc:
            self.counts[f"a2a_settle_error_{exc.code}"] += 1
        except (httpx.HTTPError, OSError, json.JSONDecodeError):
            self.counts["a2a_settle_errors"] += 1
        for task in self.tasks:
            for task_id in sorted(task.task_ids):
                slot = await self.servers.pick(self.rng)
                try:
                    async with httpx.AsyncClient(base_url=slot.http_url, timeout=30) as http:
                        got = await self._call(http, "GetTask", {"id": task_id}, task.wire)
                except RpcError as exc:
                    # TaskNotFound (-32001): retention pruned it (its end was seen before).
                    self.counts[f"a2a_settle_error_{exc.code}"] += 1
                    continue
                except (httpx.HTTPError, OSError, json.JSONDecodeError):
                    self.counts["a2a_settle_errors"] += 1
                    continue
                state = (got.get("status") or {}).get("state", "")
                if state in TERMINAL:
                    task.ends.append((task_id, TERMINAL[state], _text(got)))


def check_a2a(
    tasks: list[A2aTask],
    expected: Callable[[str, str], list[list[str]]],
    max_listed: int = 20,
    internal_errors: Sequence[tuple[str, str]] = (),
) -> tuple[dict[str, object], list[str]]:
    """Counts and violations (see the module docstring); ``internal_errors``: the
    (method, message) of every call the server answered with an internal error. Pure."""
    violations: list[str] = [
        f"A2A {m} got an internal error: {text}" for m, text in internal_errors
    ]
    states: Counter = Counter()
    #: Per wire, its tasks' first terminal states (unended: "unended").
    wires: dict[str, Counter] = {}
    twice = unended = differently = wrong = pruned_unread = 0
    for task in tasks:
        where = f"A2A {task.wire} {task.op} {task.agent} message {task.message_id} ({task.nonce})"
        if len(task.task_ids) > 1:
            twice += 1
            violations.append(f"{where} became {len(task.task_ids)} tasks: {sorted(task.task_ids)}")
        if not task.ends and task.pruned_unread:
            pruned_unread += 1  # ended (the server said so), its state pruned unread
            wires.setdefault(task.wire, Counter())["pruned_unread"] += 1
            continue
        wires.setdefault(task.wire, Counter())[task.ends[0][1] if task.ends else "unended"] += 1
        if not task.ends:
            unended += 1
            violations.append(f"{where} never ended (tasks {sorted(task.task_ids)})")
            continue
        seen = {state for _, state, _ in task.ends}
        if len(seen) > 1:
            differently += 1
            violations.append(f"{where} ended as {sorted(seen)}")
        _, state, _ = task.ends[0]
        states[state] += 1
        if state == "completed":
            texts = [text for _, s, text in task.ends if s == "completed" and text]
            proved = any(
                content_proves(text, task.nonce, alt)
                for text in texts
                for alt in expected(task.nonce, text)
            )
            if not proved:
                wrong += 1
                violations.append(f"{where} completed without its proofs: {texts[:1]}")
    counts: dict[str, object] = {
        "a2a_tasks": len(tasks),
        "a2a_by_state": dict(sorted(states.items())),
        "a2a_by_wire": {w: dict(sorted(c.items())) for w, c in sorted(wires.items())},
        "a2a_twice": twice,
        "a2a_unended": unended,
        "a2a_ended_pruned_unread": pruned_unread,
        "a2a_ended_differently": differently,
        "a2a_wrong_content": wrong,
        "a2a_internal_errors": len(internal_errors),
    }
    return counts, violations[:max_listed] + (
        [f"... {len(violations) - max_listed} more"] if len(violations) > max_listed else []
    )
