"""The chaos bench's MCP client (issue 47; docs/mcp.md): agents called as MCP tools at
``/mcp`` under kills, at both protocol revisions.

The organism offers ``beta`` and ``gamma`` as tools (``<expose-mcp>``). The named client
``mcp`` keeps up to :data:`MAX_OPEN` calls open, each at a revision drawn from the seed:

- **2026-07-28 with the Tasks extension** (``io.modelcontextprotocol/tasks`` declared in
  the request's ``_meta`` client capabilities): ``tools/call`` answers a task handle
  (``resultType: "task"``) whose ``taskId`` is the Turn's thread, once the store holds
  it; the client then polls ``tasks/get`` on any live server (on PostgreSQL two
  processes: either) until the task is ``completed`` or ``cancelled``, and reads it
  again once or twice after that. Some tasks are cancelled (``tasks/cancel``) a few
  seconds in. A task ``input_required`` (its ``pay`` waits for an approval) is waited
  on: the bench's approver decides it over her socket.
- **2025-11-25** (no tasks there): ``tools/call`` waits for the agent's answer (the
  HTTP API's ``wait-timeout``, 60 s; past it the call ends with an error naming the
  thread, counted ``mcp_wait_timeouts``).

What the server promises about a ``tools/call`` whose answer a kill lost: nothing makes
a retried call the same task (no idempotency key; each call is a new thread,
agentserver/http/mcp_tasks.py ``send``), but a handle is answered only once the store
holds the task. So the client retries such a call (the same nonce) as a real client
would, and a second task for that nonce is then *unknown*, not a violation
(``mcp_second_task_after_loss``); a second task for a call that lost no answer is one.

:func:`check_mcp`, after the drain (every task read once more with ``tasks/get``) and
against the store (every turn row's payload searched for the calls' nonces,
:func:`nonce_threads`): each call became at most one task per ``tools/call`` it sent
and exactly one if none was lost (``mcp_twice``); a handle names a task the store holds
or pruned (``mcp_handle_not_stored``); every call ended (``mcp_unended``: a task never
seen ``completed``/``cancelled``, or a plain call never answered); a task's terminal
state is one however often and wherever it was read (``mcp_ended_differently``); a
``tasks/get`` never answers "no task" for a task the store still holds
(``mcp_get_not_found``); a completed, successful result carries its nonce and the
proofs its plan needs (``mcp_wrong_content``); the store answered each task's Turn at
most once (``mcp_answered_twice``: its reply rows). Raw JSON-RPC over httpx (under
trio): the 2026-07-28 headers (``MCP-Protocol-Version``, ``Mcp-Method``, ``Mcp-Name``)
and ``_meta`` envelope are written here; the SDK's client is not in the hot loop.

A library module of bench/chaos.py (not a bench).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio
from chaos_check import content_proves, failure_reason

#: The client's name in boot.xml, and the agents it calls (no memory: a task is whole).
CLIENT = "mcp"
AGENTS = ("beta", "gamma")
MAX_OPEN = 3
MODERN = "2026-07-28"
LEGACY = "2025-11-25"
REVISIONS = (MODERN, LEGACY)
TASKS = "io.modelcontextprotocol/tasks"
CANCEL_CHANCE = 0.12
#: tasks/get polls between these (the server suggests 1 s).
POLL_S = (0.3, 1.2)
#: JSON-RPC's internal error: the server failed, which no call should ever see.
INTERNAL = -32603
INVALID_PARAMS = -32602
#: The HTTP API's wait-timeout (60 s) and a margin: a plain call's read timeout.
PLAIN_WAIT_S = 75.0
_THREAD = re.compile(r"thread ([0-9a-f-]{36})")


def expose_mcp_xml() -> str:
    """boot.xml's ``<expose-mcp>``."""
    return f'<expose-mcp listeners="{" ".join(AGENTS)}"/>'


@dataclass
class McpCall:
    """One logical call of an agent's tool over MCP, and everything seen of it."""

    nonce: str
    agent: str
    revision: str
    #: ``tools/call`` requests sent for it, and those whose answer was lost (a kill).
    sends: int = 0
    lost: int = 0
    #: Task ids (threads) the server answered a handle with (one, or more after a loss).
    task_ids: list[str] = field(default_factory=list)
    #: Every terminal state seen: (where, state, text, is_error); state ``completed``
    #: or ``cancelled``.
    ends: list[tuple[str, str, str, bool]] = field(default_factory=list)
    #: ``tasks/get`` answered "no task" for a handle: (task id, message).
    not_found: list[tuple[str, str]] = field(default_factory=list)
    #: A plain call ended with no answer in time (the thread it names, if any).
    timed_out: str | None = None
    #: ``tasks/cancel`` was acknowledged.
    cancelled: bool = False
    #: The server slot that answered its handle.
    origin: int | None = None

    @property
    def ended(self) -> bool:
        return bool(self.ends) or self.timed_out is not None


class HttpRefused(Exception):
    """An HTTP error status with no JSON-RPC answer (a problem document)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


#: HTTP statuses worth sending the same request again for (busy, a server going).
RETRIED = (408, 429, 500, 502, 503, 504)


class RpcError(Exception):
    def __init__(self, error: Mapping[str, Any]) -> None:
        super().__init__(str(error.get("message", "")))
        self.code = error.get("code")


class McpClient:
    """The client ``mcp`` (see the module docstring). ``servers.pick(rng)``: a live slot
    (its ``http_url``); ``switches``: the bench's (sending, faults, stop, counts)."""

    def __init__(self, seed: int, servers: Any, switches: Any, token: str) -> None:
        self.rng = random.Random(f"{seed}:mcp")
        self.servers = servers
        self.switches = switches
        self.token = token
        self.calls: list[McpCall] = []
        #: Every internal error (-32603) a call got: (method, message). A violation.
        self.internal_errors: list[tuple[str, str]] = []
        self.counts: Counter = Counter()
        self._ids = 0

    # -- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while not self.switches.stop:
                if self.switches.sending and self.open() < MAX_OPEN:
                    call = McpCall(
                        f"{self.rng.getrandbits(64):016x}",
                        self.rng.choice(AGENTS),
                        self.rng.choice(REVISIONS),
                    )
                    self.calls.append(call)
                    self.counts[f"mcp_calls_{'tasks' if call.revision == MODERN else 'plain'}"] += 1
                    nursery.start_soon(self._one, call, random.Random(self.rng.random()))
                await trio.sleep(self.rng.uniform(0.3, 2.0))
            nursery.cancel_scope.cancel()

    def open(self) -> int:
        return sum(1 for c in self.calls if not c.ended)

    async def _one(self, call: McpCall, rng: random.Random) -> None:
        """Call, then (a task) follow it until a terminal state is seen."""
        async with trio.open_nursery() as nursery:
            if call.revision == MODERN and rng.random() < CANCEL_CHANCE:
                nursery.start_soon(self._cancel_later, call, rng.uniform(0.5, 6.0), rng)
            while not call.ended and not self.switches.stop:
                slot = await self.servers.pick(rng)
                if not slot.http_url:
                    await trio.sleep(0.2)
                    continue
                try:
                    async with httpx.AsyncClient(
                        base_url=slot.http_url, timeout=PLAIN_WAIT_S
                    ) as http:
                        if not call.task_ids:
                            await self._call(http, call)
                            call.origin = slot.index
                        else:
                            await self._follow(http, call, rng, slot.index != call.origin)
                except (httpx.HTTPError, OSError, json.JSONDecodeError, ValueError, HttpRefused):
                    self.counts["mcp_transport_errors"] += 1
                    await trio.sleep(rng.uniform(0.2, 1.0))
            if call.ends and call.task_ids and not self.switches.stop:
                # Read an ended task again (once or twice, anywhere): the same end.
                for _ in range(rng.randint(1, 2)):
                    await self._read_again(call, rng)
            nursery.cancel_scope.cancel()

    async def _call(self, http: httpx.AsyncClient, call: McpCall) -> None:
        if call.sends:
            self.counts["mcp_calls_retried"] += 1
        call.sends += 1
        params = {
            "name": call.agent,
            "arguments": {"text": f"Please handle NONCE[{call.nonce}] with your tools."},
        }
        try:
            result = await self._rpc(http, "tools/call", params, call.revision)
        except (httpx.HTTPError, OSError, json.JSONDecodeError, ValueError):
            # The answer is lost: the call may or may not have become a task.
            call.lost += 1
            raise
        except RpcError as exc:
            # Refused before it became a task (e.g. -32602: not recorded in time).
            self.counts[f"mcp_call_error_{exc.code}"] += 1
            call.ends.append(("tools/call", "refused", str(exc), True))
            return
        except HttpRefused as exc:
            self.counts[f"mcp_call_http_{exc.status}"] += 1
            if exc.status in RETRIED:
                raise ValueError(str(exc)) from None  # sent again, on any live server
            call.ends.append(("tools/call", "refused", str(exc), True))
            return
        if result.get("resultType") == "task":
            call.task_ids.append(str(result["taskId"]))
            self._saw(call, result, "tools/call")
            return
        text = _content_text(result)
        if result.get("isError") and "no answer in time" in text:
            found = _THREAD.search(text)
            call.timed_out = found.group(1) if found else ""
            self.counts["mcp_wait_timeouts"] += 1
            return
        call.ends.append(("tools/call", "completed", text, bool(result.get("isError"))))

    async def _follow(
        self, http: httpx.AsyncClient, call: McpCall, rng: random.Random, elsewhere: bool
    ) -> None:
        """Poll ``tasks/get`` on this server a few times (then the next round picks any
        live server again: on two processes, either answers), or until the task ends."""
        task_id = call.task_ids[-1]
        for _ in range(rng.randint(1, 4)):
            if call.ended or self.switches.stop:
                return
            try:
                got = await self._rpc(http, "tasks/get", {"taskId": task_id}, MODERN)
            except RpcError as exc:
                self.counts[f"mcp_get_error_{exc.code}"] += 1
                if exc.code == INVALID_PARAMS:
                    call.not_found.append((task_id, str(exc)[:200]))
                    # Pruned (retention) or lost: nothing more to read of it.
                    call.ends.append(("tasks/get", "not-found", str(exc), True))
                    return
                raise
            self.counts["mcp_gets"] += 1
            # Read from another process than the one that made the task (PostgreSQL).
            self.counts["mcp_gets_elsewhere"] += 1 if elsewhere else 0
            self._saw(call, got, "tasks/get")
            await trio.sleep(rng.uniform(*POLL_S))

    async def _read_again(self, call: McpCall, rng: random.Random) -> None:
        slot = await self.servers.pick(rng)
        try:
            async with httpx.AsyncClient(base_url=slot.http_url, timeout=30) as http:
                got = await self._rpc(http, "tasks/get", {"taskId": call.task_ids[-1]}, MODERN)
            self.counts["mcp_rereads"] += 1
            self._saw(call, got, "reread")
        except RpcError as exc:
            self.counts[f"mcp_get_error_{exc.code}"] += 1
        except (httpx.HTTPError, OSError, json.JSONDecodeError, ValueError, HttpRefused):
            self.counts["mcp_transport_errors"] += 1

    async def _cancel_later(self, call: McpCall, delay: float, rng: random.Random) -> None:
        await trio.sleep(delay)
        if call.ended or not call.task_ids or not self.switches.faults:
            return
        slot = await self.servers.pick(rng)
        try:
            async with httpx.AsyncClient(base_url=slot.http_url, timeout=30) as http:
                self.counts["mcp_cancels"] += 1
                await self._rpc(http, "tasks/cancel", {"taskId": call.task_ids[-1]}, MODERN)
                call.cancelled = True
        except RpcError as exc:
            self.counts[f"mcp_cancel_error_{exc.code}"] += 1
        except (httpx.HTTPError, OSError, json.JSONDecodeError, ValueError, HttpRefused):
            self.counts["mcp_transport_errors"] += 1

    # -- what was seen -------------------------------------------------------------------
    def _saw(self, call: McpCall, got: Mapping[str, Any], where: str) -> None:
        status = got.get("status")
        self.counts[f"seen:{status}"] += 1
        if status == "completed":
            result = got.get("result") or {}
            call.ends.append(
                (where, "completed", _content_text(result), bool(result.get("isError")))
            )
        elif status in ("cancelled", "failed"):
            call.ends.append((where, str(status), str(got.get("statusMessage", "")), True))
        elif status == "input_required":
            self.counts["mcp_input_required_seen"] += 1

    # -- the wire ------------------------------------------------------------------------
    async def _rpc(
        self, http: httpx.AsyncClient, method: str, params: dict[str, Any], revision: str
    ) -> dict[str, Any]:
        """One JSON-RPC request at ``revision``: its result (an error raises RpcError).
        The answer is JSON or an SSE stream whose last message with our id is it."""
        self._ids += 1
        ident = self._ids
        headers = {
            "Authorization": f"Bearer {self.token}",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": revision,
        }
        params = dict(params)
        if revision == MODERN:
            headers["Mcp-Method"] = method
            if method == "tools/call":
                headers["Mcp-Name"] = params["name"]
            params["_meta"] = {
                "io.modelcontextprotocol/protocolVersion": MODERN,
                "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS: {}}},
                "io.modelcontextprotocol/clientInfo": {"name": "chaos-mcp", "version": "1"},
            }
        body = {"jsonrpc": "2.0", "id": ident, "method": method, "params": params}
        answer: dict[str, Any] | None = None
        async with http.stream("POST", "/mcp", json=body, headers=headers) as response:
            kind = response.headers.get("content-type", "")
            if "text/event-stream" in kind:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    message = json.loads(line[5:])
                    if message.get("id") == ident and ("result" in message or "error" in message):
                        answer = message
                        break
            else:
                raw = await response.aread()
                answer = json.loads(raw) if raw.strip().startswith(b"{") else {}
                if response.status_code >= 400 and "error" not in answer:
                    raise HttpRefused(response.status_code, raw[:300].decode("utf-8", "replace"))
        if answer is None:
            raise ValueError(f"{method}: the stream ended without an answer")
        if "error" in answer:
            error = answer["error"]
            if error.get("code") == INTERNAL:
                self.internal_errors.append((method, str(error.get("message", ""))[:200]))
            raise RpcError(error)
        return answer.get("result") or {}

    # -- after the drain -----------------------------------------------------------------
    async def settle(self) -> None:
        """Read every task once more (``tasks/get``, on a live server): its state now."""
        for call in self.calls:
            for task_id in sorted(set(call.task_ids)):
                slot = await self.servers.pick(self.rng)
                try:
                    async with httpx.AsyncClient(base_url=slot.http_url, timeout=30) as http:
                        got = await self._rpc(http, "tasks/get", {"taskId": task_id}, MODERN)
                except RpcError as exc:
                    # "no task": retention pruned it (its end was seen before), or lost.
                    self.counts[f"mcp_settle_error_{exc.code}"] += 1
                    continue
                except (httpx.HTTPError, OSError, json.JSONDecodeError, ValueError, HttpRefused):
                    self.counts["mcp_settle_errors"] += 1
                    continue
                self._saw(call, got, "settle")


def _content_text(result: Mapping[str, Any]) -> str:
    return "\n".join(
        str(c.get("text", "")) for c in result.get("content") or [] if c.get("type") == "text"
    )


def nonce_threads(rows: Sequence[tuple[str, str]], nonces: Sequence[str]) -> dict[str, list[str]]:
    """Per nonce, the threads (the reply reference's ``caller_thread``: the task's own)
    of the store's turn rows whose payload names it. ``rows``: (reply reference,
    payload text) of every turn row."""
    wanted = set(nonces)
    found: dict[str, list[str]] = {n: [] for n in wanted}
    pattern = re.compile(r"NONCE\[([0-9a-f]{16})\]")
    for ref, payload in rows:
        try:
            thread = str(json.loads(ref).get("caller_thread") or ref)
        except (ValueError, AttributeError):
            thread = ref
        for nonce in set(pattern.findall(payload)):
            if nonce in wanted:
                found[nonce].append(thread)
    return found


def check_mcp(
    calls: list[McpCall],
    expected: Callable[[str, str], list[list[str]]],
    stored: Mapping[str, list[str]],
    answers: Mapping[str, list[bool]],
    gone: Callable[[str], bool],
    max_listed: int = 20,
    internal_errors: Sequence[tuple[str, str]] = (),
) -> tuple[dict[str, object], list[str]]:
    """Counts and violations (see the module docstring). ``stored``: per nonce, the
    threads whose turn row names it (:func:`nonce_threads`); ``answers``: per task id,
    the store's reply rows for it (each: failed); ``gone(thread)``: retention pruned it. Pure."""
    violations: list[str] = [
        f"MCP {m} got an internal error: {text}" for m, text in internal_errors
    ]
    states: Counter = Counter()
    failed: Counter = Counter()
    cancels: Counter = Counter()
    twice = unknown_second = unended = differently = wrong = not_stored = not_found = 0
    answered_twice = lost_calls = not_the_stores = 0
    for call in calls:
        where = f"MCP {call.revision} {call.agent} call ({call.nonce})"
        threads = stored.get(call.nonce, [])
        lost_calls += 1 if call.lost else 0
        if len(threads) > max(call.sends, 1) or (len(threads) > 1 and not call.lost):
            twice += 1
            violations.append(
                f"{where} became {len(threads)} tasks ({call.sends} calls, "
                f"{call.lost} answers lost): {sorted(threads)}"
            )
        elif len(threads) > 1:
            unknown_second += 1
        for task_id in set(call.task_ids):
            if task_id not in threads and not gone(task_id):
                not_stored += 1
                violations.append(f"{where}: handle {task_id} names no task in the store")
            rows = answers.get(task_id, [])
            if len(rows) > 1:
                answered_twice += 1
                violations.append(f"{where}: the store answered {task_id} {len(rows)} times")
        for task_id, text in call.not_found:
            if task_id in threads and not gone(task_id):
                not_found += 1
                violations.append(f"{where}: tasks/get said {text!r} of a stored task {task_id}")
        ends = [e for e in call.ends if e[1] != "not-found"]
        if call.timed_out is not None:
            states["wait_timeout"] += 1
            continue
        if not ends:
            if call.not_found or (call.lost and not call.task_ids and not threads):
                states["unknown"] += 1  # lost to a kill before it was a task, or pruned
                continue
            unended += 1
            violations.append(f"{where} never ended (tasks {call.task_ids})")
            continue
        seen = {(state, text, is_error) for _, state, text, is_error in ends}
        if len(seen) > 1:
            differently += 1
            shown = sorted((s, e, t[:80]) for s, t, e in seen)
            violations.append(f"{where} ended differently: {shown}")
        _, state, text, is_error = ends[0]
        states[state] += 1
        if call.cancelled:
            # Acknowledged: the Turn stopped, unless it had ended first (a race).
            cancels["effective" if state == "cancelled" else "after_the_end"] += 1
        # What the door said against the store's answer (its one reply row, if kept):
        # a success there is a completed, successful result here, and only that.
        rows = [answers.get(t, []) for t in set(call.task_ids)]
        if call.task_ids and len(rows[-1]) == 1 and state in ("completed", "cancelled"):
            succeeded = state == "completed" and not is_error
            if succeeded == rows[-1][0]:
                not_the_stores += 1
                violations.append(
                    f"{where} read {state} (error {is_error}); the store's answer "
                    f"{'failed' if rows[-1][0] else 'succeeded'}"
                )
        if state == "completed" and is_error:
            failed[failure_reason(text)] += 1
        elif state == "completed" and not any(
            content_proves(text, call.nonce, alt) for alt in expected(call.nonce, text)
        ):
            wrong += 1
            violations.append(f"{where} completed without its proofs: {text[:200]}")
    counts: dict[str, object] = {
        "mcp_calls": len(calls),
        "mcp_tasks": sum(1 for c in calls if c.revision == MODERN),
        "mcp_by_state": dict(sorted(states.items())),
        "mcp_failed_by_reason": dict(sorted(failed.items())),
        "mcp_cancels_acknowledged": dict(sorted(cancels.items())),
        "mcp_calls_answer_lost": lost_calls,
        "mcp_second_task_after_loss": unknown_second,
        "mcp_twice": twice,
        "mcp_handle_not_stored": not_stored,
        "mcp_unended": unended,
        "mcp_ended_differently": differently,
        "mcp_get_not_found": not_found,
        "mcp_wrong_content": wrong,
        "mcp_answered_twice": answered_twice,
        "mcp_state_not_the_stores": not_the_stores,
        "mcp_internal_errors": len(internal_errors),
    }
    return counts, violations[:max_listed] + (
        [f"... {len(violations) - max_listed} more"] if len(violations) > max_listed else []
    )
