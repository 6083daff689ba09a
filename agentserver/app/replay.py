"""Replay, export and the store a recorded Turn is read from (docs/agents.md, "Replay and
export"): the composition of a replay run.

``replay`` re-runs a recorded Turn offline: the boot file's pump and listeners (as they
are configured now), the agent runtime on a scratch SQLite store in a temporary folder,
the model's recorded outputs instead of any LLM (agents/replay/recorded.py ``RecordedLLM``), the
recorded tool results, or the real tools with ``live_tools``. Policy, guardrails, loop
detection, compaction and step limits run as configured now. The replayed Turn's cards
are then compared with the recorded ones.

Bounded by ``timeout`` (a replay waiting for something that never comes, e.g. a human
approval the policy now asks for, reports that). Cancelling it cancels the run; the
scratch store is removed either way; the recorded store is only read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from lxml import etree

from agentserver.agents.clock import SystemClock
from agentserver.agents.edge.bridge import PumpPorts, agent_handler
from agentserver.agents.errors import AgentError, StoreError, StoreInUse, TurnPruned
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.replay.record import TurnRecord
from agentserver.agents.replay.recorded import (
    Divergence,
    RecordedLLM,
    RecordedResult,
    RecordedTools,
    compare,
)
from agentserver.agents.runtime import AgentRuntime, open_agent_store
from agentserver.agents.store.sql import record as sql_record
from agentserver.agents.store.sqlite_store import SqliteAgentStore
from agentserver.app.agents import build_profiles
from agentserver.app.builtins import RunContext, build_listener_set
from agentserver.app.runtime_parts import runtime_parts
from agentserver.config import loader as boot
from agentserver.config.topology import Topology
from agentserver.core.envelope import build_envelope
from agentserver.core.threads import new_thread_id
from agentserver.core.xmlsafe import SafeParser
from agentserver.pump.pump import open_pump


class ReplayError(AgentError):
    """A replay or export that cannot run: no such Turn, an unreadable record, an agent
    the boot file does not declare."""


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What a replay found. ``divergence`` None: identical."""

    agent: str
    thread: str
    divergence: Divergence | None
    #: Model outputs the replay asked for (served from the record; no LLM is called).
    model_calls: int
    #: Tool calls the replay made.
    tool_calls: int
    #: The replayed Turn's answer ("" if it did not end).
    answer: str

    @property
    def identical(self) -> bool:
        return self.divergence is None

    def __str__(self) -> str:
        return "identical" if self.divergence is None else f"diverged: {self.divergence}"


def store_settings(topology: Topology, store: str | os.PathLike[str] | None) -> StoreSettings:
    """The topology's ``<store>``, or ``store`` instead: a ``postgresql://`` URL or a
    SQLite file's path."""
    settings = topology.store
    if store is None:
        return settings
    text = os.fspath(store)
    if text.startswith(("postgresql://", "postgres://")):
        return dataclasses.replace(settings, url=text)
    return dataclasses.replace(settings, path=Path(text), url=None)


async def open_beside(settings: StoreSettings) -> tuple[Any, bool]:
    """The store of ``settings`` opened to read it by hand (export, replay, ``store stats``,
    ``result``): as the server would open it when none runs, else beside the running
    server (SQLite: :meth:`SqliteAgentStore.attach`, no lock, no migration). Returns (the
    store, whether a running server holds it). Raises ``StoreError`` for a SQLite file
    that is not there."""
    if settings.url:
        from agentserver.agents.store.pg.store import PostgresAgentStore

        return PostgresAgentStore.open(settings.url, clock=SystemClock(), settings=settings), False
    if not settings.path.exists():
        raise StoreError(f"no agent store at {settings.path}")
    try:
        return SqliteAgentStore.open(settings.path, settings=settings), False
    except StoreInUse:
        return SqliteAgentStore.attach(settings.path, settings=settings), True


async def read_record(
    boot_path: str | os.PathLike[str],
    agent: str,
    thread: str,
    *,
    store: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> TurnRecord:
    """The latest Turn of ``agent`` on ``thread`` from the store of ``boot_path`` (or
    ``store``), read beside a running server as ``store stats`` reads it (:func:`open_beside`).
    Raises :class:`ReplayError`."""
    topology = boot.load_or_raise(boot_path, environ=environ)
    settings = store_settings(topology, store)
    if settings.url is None and not settings.path.exists():
        raise ReplayError(f"no agent store at {settings.path}")
    opened, _beside = await open_beside(settings)
    try:
        data = await opened.read(sql_record.turn_record, agent, thread)
    except TurnPruned as exc:
        raise ReplayError(str(exc)) from None
    finally:
        await opened.aclose()
    if data is None:
        raise ReplayError(f"no Turn of {agent!r} on thread {thread!r}")
    return TurnRecord.from_dict(data)


async def replay(
    boot_path: str | os.PathLike[str],
    agent: str | None = None,
    thread: str | None = None,
    *,
    store: str | os.PathLike[str] | None = None,
    record: TurnRecord | None = None,
    live_tools: bool = False,
    environ: Mapping[str, str] | None = None,
    timeout: float = 60.0,  # noqa: ASYNC109 - the replay's own bound is the point
) -> ReplayReport:
    """Re-run a recorded Turn offline and compare it with its record: ``record`` (e.g.
    ``TurnRecord.from_jsonl``), else the latest Turn of ``agent`` on ``thread`` in the
    store of ``boot_path`` (or ``store``). Raises :class:`ReplayError`."""
    env = os.environ if environ is None else environ
    if record is None:
        if agent is None or thread is None:
            raise ReplayError("replay needs an agent and a thread, or a record")
        record = await read_record(boot_path, agent, thread, store=store, environ=env)
    topology = boot.load_or_raise(boot_path, environ=env)
    if record.agent not in {s.name for s in topology.listeners if s.agent}:
        raise ReplayError(f"{boot_path} declares no agent {record.agent!r}")
    with tempfile.TemporaryDirectory(prefix="agentserver-replay-") as scratch:
        settings = dataclasses.replace(
            topology.store, path=Path(scratch) / "replay.sqlite3", url=None
        )
        return await _run(topology, settings, record, live_tools, env, timeout)


async def _report(
    results: trio.MemoryReceiveChannel[RecordedResult], runtime: AgentRuntime
) -> None:
    """The recorded tool results into the runtime, each in a task of its own (as a
    peer's response comes, independent of the others)."""
    async with trio.open_nursery() as nursery:
        async for agent, sub, body, failed in results:
            nursery.start_soon(
                functools.partial(runtime.report_tool_result, agent, sub, body, failed=failed)
            )


async def _run(
    topology: Topology,
    settings: StoreSettings,
    record: TurnRecord,
    live_tools: bool,
    env: Mapping[str, str],
    timeout: float,  # noqa: ASYNC109 - passed down from replay
) -> ReplayReport:
    listeners = build_listener_set(topology, RunContext(topology))
    task = SafeParser().parse(record.task.encode())
    llm = RecordedLLM(record)
    async with open_pump(listeners.listeners, config=topology.pump_config()) as pump:
        profiles = build_profiles(topology, pump, env)
        clock = SystemClock()
        scratch = open_agent_store(settings, profiles, clock=clock)
        try:
            ports = PumpPorts(pump, store=scratch)
            async with trio.open_nursery() as nursery:
                send, results = trio.open_memory_channel[RecordedResult](math.inf)
                tools = RecordedTools(record, ports, ports, send, live=live_tools)
                runtime = AgentRuntime(
                    runtime_parts(
                        store=scratch,
                        profiles=profiles,
                        llm=llm,
                        tools=tools,
                        replies=ports,
                        settings=settings,
                        clock=clock,
                    )
                )

                nursery.start_soon(_report, results, runtime)
                for name, handler in listeners.agent_handlers.items():
                    handler.bind(agent_handler(runtime, pump, name, ports))
                await nursery.start(runtime.run)
                endpoint = pump.open_endpoint("replay")
                thread = new_thread_id()
                await endpoint.send(
                    etree.tostring(build_envelope("replay", record.agent, thread, task))
                )
                ended = False
                with trio.move_on_after(timeout):
                    await endpoint.receive()
                    ended = True
                replayed = await scratch.read(sql_record.turn_record, record.agent, thread)
                nursery.cancel_scope.cancel()
        finally:
            await scratch.aclose()
    cards = replayed["cards"] if replayed else []
    divergence = compare(record.cards, cards)
    if divergence is None and not ended:
        divergence = Divergence(
            llm.asked, "Turn ended", f"did not end within {timeout:g} s (an approval?)"
        )
    answers = [c["content"] for c in cards if c["type"] == "task.deliverable"]
    return ReplayReport(
        record.agent,
        record.thread,
        divergence,
        llm.asked,
        tools.made,
        answers[-1] if answers else "",
    )
