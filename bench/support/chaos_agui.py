"""The chaos bench's AG-UI client (issue 47; docs/ag-ui.md): agents run as AG-UI agents
at ``POST /agui/agents/{name}`` under kills.

The named client ``agui`` keeps up to :data:`MAX_OPEN` runs open, each on an AG-UI
thread of its own (``beta`` and ``gamma``: no memory, a run is whole), reading the run's
Server-Sent Events. Now and then it drops the stream early on purpose; a server killed
under it breaks it. Either way it posts **the same run again** (the same ``threadId`` and
``runId``) to any live server, which docs/ag-ui.md says sends nothing and streams the
run from where it is (a ``MESSAGES_SNAPSHOT``, then the rest, and its end). A run that
ends with an approval interrupt (``RUN_FINISHED`` with ``outcome.type`` ``interrupt``:
its ``pay`` waits) is posted again a few seconds later, after the bench's approver has
decided over her socket, until its Turn ends; an ended run is sometimes posted once more
(it must end the same way).

:func:`check_agui`, against the store too: every stream that got ``RUN_STARTED`` and
was read to its end (not dropped by us, not broken by a kill, not ended by a drain's or
a SIGTERM's shutdown, docs/ag-ui.md) ended with exactly one of
``RUN_FINISHED``/``RUN_ERROR``, as its last event (``agui_bad_end``); every run ended
(``agui_unended``), the same way however often it was read (``agui_ended_differently``);
a run's task is the thread derived from the caller and the run (its state names it;
``agui_wrong_thread``); posting a run again sent nothing: the store has at most one task
naming the run's nonce (``agui_twice``) and answered it at most once
(``agui_answered_twice``); a finished run's ``result.answer`` carries its nonce and the
proofs its plan needs (``agui_wrong_content``). Raw SSE over httpx (under trio).

A library module of bench/chaos.py (not a bench).
"""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio
from chaos_check import content_proves, failure_reason

#: The client's name in boot.xml, and the agents it runs (no memory: a run is whole).
CLIENT = "agui"
AGENTS = ("beta", "gamma")
MAX_OPEN = 3
DROP_STREAM_CHANCE = 0.3
READ_AGAIN_CHANCE = 0.3
TERMINAL = ("RUN_FINISHED", "RUN_ERROR")
#: Refusals before the stream worth posting the run again for (busy, a server going).
RETRIED = (408, 429, 500, 502, 503, 504)


def run_thread(owner: str, agent: str, thread_id: str, run_id: str) -> str:
    """The thread of a run's task, as docs/ag-ui.md derives it (agentserver/http/agui/
    agents.py ``run_thread``; written out here so the check does not trust the server)."""
    digest = hashlib.sha256("\0".join(("agui", owner, agent, thread_id, run_id)).encode())
    return str(uuid.UUID(bytes=digest.digest()[:16], version=4))


@dataclass
class Stream:
    """One post of a run and what its stream carried."""

    started: bool = False
    #: The terminal events, in order: (type, summary); and whether one came last.
    ends: list[tuple[str, str]] = field(default_factory=list)
    last_terminal: bool = False
    #: Read to its end (the server closed it), not dropped nor broken.
    whole: bool = False
    thread: str = ""


@dataclass
class AguiRun:
    nonce: str
    agent: str
    thread_id: str
    run_id: str
    streams: list[Stream] = field(default_factory=list)
    #: Every end seen (an interrupt aside): (kind, text) with kind ``finished``,
    #: ``cancelled`` or ``error:CODE``.
    ends: list[tuple[str, str]] = field(default_factory=list)
    interrupts: int = 0
    #: A stream said retention removed it (``RUN_ERROR`` ``pruned``).
    pruned: bool = False
    #: Posts refused before a stream (status, problem type).
    refusals: list[tuple[int, str]] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return bool(self.ends) or self.pruned


class AguiClient:
    """The client ``agui`` (see the module docstring)."""

    def __init__(self, seed: int, servers: Any, switches: Any, token: str) -> None:
        self.rng = random.Random(f"{seed}:agui")
        self.servers = servers
        self.switches = switches
        self.headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
        self.runs: list[AguiRun] = []
        self.counts: Counter = Counter()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while not self.switches.stop:
                if self.switches.sending and self.open() < MAX_OPEN:
                    run = AguiRun(
                        f"{self.rng.getrandbits(64):016x}",
                        self.rng.choice(AGENTS),
                        f"t-{self.rng.getrandbits(48):012x}",
                        f"r-{self.rng.getrandbits(48):012x}",
                    )
                    self.runs.append(run)
                    self.counts["agui_runs_started"] += 1
                    nursery.start_soon(self._one, run, random.Random(self.rng.random()))
                await trio.sleep(self.rng.uniform(0.3, 2.0))
            nursery.cancel_scope.cancel()

    def open(self) -> int:
        return sum(1 for r in self.runs if not r.ended)

    async def _one(self, run: AguiRun, rng: random.Random) -> None:
        while not run.ended and not self.switches.stop:
            if await self._post(run, rng, drop=rng.random() < DROP_STREAM_CHANCE):
                await trio.sleep(rng.uniform(1.0, 4.0))  # an interrupt: the approver decides
        if run.ended and not self.switches.stop and rng.random() < READ_AGAIN_CHANCE:
            self.counts["agui_read_again"] += 1
            await self._post(run, rng, drop=False)

    async def _post(self, run: AguiRun, rng: random.Random, drop: bool) -> bool:
        """Post the run (again) on a live server and read its stream; whether it ended
        with an interrupt."""
        slot = await self.servers.pick(rng)
        if not slot.http_url:
            await trio.sleep(0.2)
            return False
        generation = slot.generation
        body = {
            "threadId": run.thread_id,
            "runId": run.run_id,
            "state": {},
            "messages": [
                {
                    "id": f"m-{run.nonce}",
                    "role": "user",
                    "content": f"Please handle NONCE[{run.nonce}] with your tools.",
                }
            ],
            "tools": [],
            "context": [],
            "forwardedProps": {},
        }
        if run.streams:
            self.counts["agui_reposts"] += 1
        stream = Stream()
        drop_after = rng.randint(1, 6) if drop else None
        interrupted = False
        events = 0
        try:
            async with httpx.AsyncClient(base_url=slot.http_url, timeout=90) as http:
                async with http.stream(
                    "POST", f"/agui/agents/{run.agent}", json=body, headers=self.headers
                ) as response:
                    if response.status_code != 200:
                        raw = await response.aread()
                        kind = ""
                        try:
                            problem = json.loads(raw)
                            kind = f"{problem.get('type', '')}: {problem.get('detail', '')}"
                        except (ValueError, AttributeError):
                            pass
                        run.refusals.append((response.status_code, kind))
                        self.counts[f"agui_refused_{response.status_code}"] += 1
                        if response.status_code not in RETRIED:
                            # Refused for good (budget, validation): the run's end.
                            run.ends.append((f"refused:{response.status_code}", kind))
                        await trio.sleep(rng.uniform(0.5, 2.0))
                        return False
                    run.streams.append(stream)
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        event = json.loads(line[5:])
                        events += 1
                        kind = event.get("type")
                        stream.last_terminal = kind in TERMINAL
                        if kind == "RUN_STARTED":
                            stream.started = True
                        elif kind == "STATE_SNAPSHOT":
                            stream.thread = str((event.get("snapshot") or {}).get("thread", ""))
                        elif kind == "RUN_FINISHED":
                            outcome = event.get("outcome") or {}
                            if outcome.get("type") == "interrupt":
                                stream.ends.append(("interrupt", ""))
                                interrupted = True
                            elif outcome.get("type") == "cancelled":
                                stream.ends.append(("cancelled", ""))
                            else:
                                answer = str((event.get("result") or {}).get("answer", ""))
                                stream.ends.append(("finished", answer))
                        elif kind == "RUN_ERROR":
                            code = str(event.get("code", ""))
                            stream.ends.append((f"error:{code}", str(event.get("message", ""))))
                        if drop_after is not None and events >= drop_after and not stream.ends:
                            self.counts["agui_streams_dropped"] += 1
                            return False  # the connection closes: posted again next
                    # Closed by the server, which was not killed meanwhile, nor stopped
                    # (drained or sent SIGTERM: its shutdown ends open streams).
                    stream.whole = (
                        slot.alive and slot.generation == generation and not slot.stopping
                    )
        except (httpx.HTTPError, OSError, json.JSONDecodeError):
            self.counts["agui_transport_errors"] += 1
            await trio.sleep(rng.uniform(0.2, 1.0))
            return False
        if interrupted:
            run.interrupts += 1
        for kind, text in stream.ends:
            if kind == "error:pruned":
                run.pruned = True
            elif kind != "interrupt":
                run.ends.append((kind, text))
        return interrupted


def check_agui(
    runs: list[AguiRun],
    expected: Callable[[str, str], list[list[str]]],
    stored: Mapping[str, list[str]],
    answers: Mapping[str, list[bool]],
    max_listed: int = 20,
) -> tuple[dict[str, object], list[str]]:
    """Counts and violations (see the module docstring). ``stored``: per nonce, the
    threads of the store's turn rows naming it; ``answers``: per thread, the store's
    reply rows for it (each: failed). Pure."""
    violations: list[str] = []
    states: Counter = Counter()
    failed: Counter = Counter()
    not_the_stores = 0
    bad_end = unended = differently = wrong = twice = answered_twice = wrong_thread = 0
    for run in runs:
        thread = run_thread(CLIENT, run.agent, run.thread_id, run.run_id)
        where = f"AG-UI {run.agent} run {run.thread_id}/{run.run_id} ({run.nonce}, {thread})"
        for stream in run.streams:
            if stream.thread and stream.thread != thread:
                wrong_thread += 1
                violations.append(f"{where}: its state names thread {stream.thread}")
            if (
                stream.started
                and stream.whole
                and (len(stream.ends) != 1 or not stream.last_terminal)
            ):
                bad_end += 1
                violations.append(
                    f"{where}: a stream read to its end ended with {stream.ends} "
                    f"(terminal last: {stream.last_terminal})"
                )
        threads = stored.get(run.nonce, [])
        if len(threads) > 1:
            twice += 1
            violations.append(f"{where} became {len(threads)} tasks: {sorted(threads)}")
        if any(t != thread for t in threads):
            wrong_thread += 1
            violations.append(f"{where}: its task is on {sorted(set(threads))}")
        rows = answers.get(thread, [])
        if len(rows) > 1:
            answered_twice += 1
            violations.append(f"{where}: the store answered it {len(rows)} times")
        if not run.ends:
            if not run.streams and run.refusals:
                states["refused"] += 1
                continue
            if run.pruned:
                states["pruned"] += 1  # retention removed it before its end was read
                continue
            unended += 1
            violations.append(f"{where} never ended ({len(run.streams)} streams)")
            continue
        if len(set(run.ends)) > 1:
            differently += 1
            violations.append(f"{where} ended differently: {[(k, t[:80]) for k, t in run.ends]}")
        kind, text = run.ends[0]
        states[kind.split(":")[0]] += 1
        # The run's end against the store's answer (its one reply row, if kept): a
        # success there is RUN_FINISHED with a result here, and only that.
        if len(rows) == 1 and (kind == "finished") == rows[0]:
            not_the_stores += 1
            violations.append(
                f"{where} ended {kind}; the store's answer {'failed' if rows[0] else 'succeeded'}"
            )
        if kind.startswith(("error:", "refused:")):
            failed[kind.split(":", 1)[1] + ":" + failure_reason(text)] += 1
        elif kind == "finished" and not any(
            content_proves(text, run.nonce, alt) for alt in expected(run.nonce, text)
        ):
            wrong += 1
            violations.append(f"{where} finished without its proofs: {text[:200]}")
    counts: dict[str, object] = {
        "agui_runs": len(runs),
        "agui_streams": sum(len(r.streams) for r in runs),
        "agui_interrupts": sum(r.interrupts for r in runs),
        "agui_by_end": dict(sorted(states.items())),
        "agui_errors_by_reason": dict(sorted(failed.items())),
        "agui_bad_end": bad_end,
        "agui_unended": unended,
        "agui_ended_differently": differently,
        "agui_wrong_thread": wrong_thread,
        "agui_twice": twice,
        "agui_answered_twice": answered_twice,
        "agui_end_not_the_stores": not_the_stores,
        "agui_wrong_content": wrong,
    }
    return counts, violations[:max_listed] + (
        [f"... {len(violations) - max_listed} more"] if len(violations) > max_listed else []
    )
