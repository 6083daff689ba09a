"""The chaos bench's deploy fault (issue 49; docs/deploy.md, "Deploying with Turns in
flight"): agent versions, the processes replaced one by one under load, and the check.

Two boot files (bench/chaos.py ``--deploy``): ``v1`` is the bench's usual boot.xml with
``version="v1"`` on every agent and :data:`PINNED_AGENT` ``versioning="pinned"``; ``v2``
changes every agent's ``<system-prompt>`` and removes :data:`REMOVED_TOOL` from
:data:`SHRUNK_AGENT`'s peers (an ``upgrade`` agent). Each prompt names the agent's tools
(:func:`prompt_text`): the scripted model calls only those (bench/support/chaos_model.py),
and answers ``relay=removed`` for a task whose plan needs the removed tool, which the
checker then accepts (bench/chaos.py ``expected_proofs``). A call already out when its
Turn moved to v2 is answered by the server as a failed result naming the change.

:class:`Deployer`: every 25-50 s (the seed's), a deploy round replaces every server
process, one at a time (with two processes on PostgreSQL the two versions run side by side
for 8-20 s: a rolling deploy), alternately onto v2 and back onto v1 (a rollback). Each
replacement drains the process (``agentserver drain BOOT --url HTTP --wait``, 70 %) or
sends it SIGTERM, then starts the other boot file in its place. Once the faults stop,
:meth:`Deployer.settle` deploys the version a pinned Turn waits for when no live process
serves it (its Turn would wait for ever).

:func:`check_versions` (sans-IO; :func:`read_versions` reads the store): a pinned Turn
whose steps ran on two versions is a violation (``agentserver turns migrate``, which the
bench never runs, is the only way one may: each ``migrate`` edge allows one change of
version), as is an ``upgrade`` edge on a pinned Turn. Counts: Turns by the version they
began on, upgrades seen (``upgrade`` edges) by direction, Turns that ran on two versions.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import random
import re
import sqlite3
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping

import trio
from chaos_procs import ServerSlot
from chaos_tools import TOOL_KINDS

V1, V2 = "v1", "v2"
VERSIONS = (V1, V2)
#: The agent whose Turns are pinned to the version they began on.
PINNED_AGENT = "gamma"
#: The ``upgrade`` agent whose v2 lacks a tool, and the tool (its tasks' plans may need
#: it: the model then answers without it, bench/support/chaos_model.py).
SHRUNK_AGENT, REMOVED_TOOL = "alpha", "relay"
#: Seconds between deploy rounds, and between two processes' replacements in one round.
ROUND_EVERY_S = (25.0, 50.0)
ROLLING_GAP_S = (8.0, 20.0)
#: The share of replacements that drain (the others: SIGTERM).
DRAIN_SHARE = 0.7
#: ``agentserver drain --wait --timeout``: after this, SIGTERM instead.
DRAIN_TIMEOUT_S = 45.0
#: After the faults, a settling deploy at most this often.
SETTLE_GAP_S = 10.0
_WORDS = {V1: "one", V2: "two"}
#: What a prompt says (:func:`prompt_text`), read back by the model.
PROMPT = re.compile(r"Chaos agent (\w+), version (\w+)\. Your tools: ([a-z ]+)\.")


def tools_of(agent: str, version: str | None) -> tuple[str, ...]:
    """``agent``'s peers in ``version`` (None: the bench without ``--deploy``)."""
    if version == V2 and agent == SHRUNK_AGENT:
        return tuple(t for t in TOOL_KINDS if t != REMOVED_TOOL)
    return TOOL_KINDS


def prompt_text(agent: str, version: str) -> str:
    return (
        f"Chaos agent {agent}, version {_WORDS[version]}. "
        f"Your tools: {' '.join(tools_of(agent, version))}."
    )


def agent_attrs(agent: str, version: str | None) -> str:
    """The ``<agent>`` element's version attributes."""
    if version is None:
        return ""
    pinned = ' versioning="pinned"' if agent == PINNED_AGENT else ""
    return f' version="{version}"{pinned}'


def agent_end(agent: str, version: str | None) -> str:
    """How the ``<agent>`` element ends: with its ``<system-prompt>`` when versioned."""
    if version is None:
        return "/>"
    return (
        f">\n        <system-prompt>{prompt_text(agent, version)}</system-prompt>\n      </agent>"
    )


def offered_tools(system_texts: Iterable[str]) -> tuple[str | None, tuple[str, ...] | None]:
    """The version a prompt names and the tools it names (None, None: no such prompt)."""
    for text in system_texts:
        found = PROMPT.search(text)
        if found:
            word = found.group(2)
            version = next((v for v, w in _WORDS.items() if w == word), word)
            return version, tuple(found.group(3).split())
    return None, None


# -- the fault -------------------------------------------------------------------------


class Deployer:
    """Replaces the server processes, under load, by the other version's boot file."""

    def __init__(
        self,
        slots: list[ServerSlot],
        boots: Mapping[str, pathlib.Path],
        env: dict[str, str],
        seed: int,
        faults_on: Callable[[], bool],
        say: Callable[[str], None],
        sqlite_path: pathlib.Path | None,
        pg_url: str | None,
    ) -> None:
        self.slots = slots
        self.boots = dict(boots)
        #: The drain CLI's environment (``AGENTSERVER_TOKEN``: an operator's).
        self.env = env
        self.rng = random.Random(f"{seed}:deploy")
        self.faults_on = faults_on
        self.say = say
        self.sqlite_path = sqlite_path
        self.pg_url = pg_url
        self.version_of = {slot.index: V1 for slot in slots}
        self.counts: Counter = Counter()
        self.violations: list[str] = []
        self.idle = trio.Event()
        self._nap: trio.CancelScope | None = None
        self._stopping = False
        self._settled_at = -SETTLE_GAP_S

    async def run(self) -> None:
        """Deploy rounds until the faults stop (a round under way is finished)."""
        rounds = 0
        try:
            while not self._stopping:
                with trio.CancelScope() as self._nap:
                    await trio.sleep(self.rng.uniform(*ROUND_EVERY_S))
                self._nap = None
                if self._stopping or not self.faults_on():
                    return
                rounds += 1
                target = V2 if rounds % 2 else V1
                self.counts["deploy_rounds"] += 1
                for i, slot in enumerate(self.slots):
                    if i:  # rolling: the two versions run side by side meanwhile
                        await trio.sleep(self.rng.uniform(*ROLLING_GAP_S))
                    drain = self.rng.random() < DRAIN_SHARE
                    async with slot.lock:
                        await self.replace(slot, target, drain)
        finally:
            self.idle.set()

    async def stop(self) -> None:
        """No new round; returns once a round under way is done."""
        self._stopping = True
        if self._nap is not None:
            self._nap.cancel()
        await self.idle.wait()

    async def replace(self, slot: ServerSlot, version: str, drain: bool) -> None:
        """Drain (or SIGTERM) the process of ``slot``; start ``version`` in its place.
        The caller holds ``slot.lock``."""
        was = self.version_of[slot.index]
        how = "SIGTERM"
        if drain:
            outcome, code = await slot.drain(self.env, DRAIN_TIMEOUT_S)
            if outcome == "drained":
                how = "drained"
                self.counts["deploys_drained"] += 1
                if code != 0:
                    self.violations.append(
                        f"server {slot.index} ({was}) drained and exited {code}, not 0"
                    )
            else:
                self.counts[f"drains_{outcome}"] += 1
                how = f"SIGTERM, the drain {outcome}"
                drain = False
        if not drain:
            code = await slot.terminate()
            self.counts["deploys_sigterm"] += 1
            self.counts[f"sigterm_exit_{code}"] += 1
        slot.boot = self.boots[version]
        self.version_of[slot.index] = version
        await slot.start()
        self.counts["deploys"] += 1
        self.counts[f"deploys_{was}_to_{version}"] += 1
        self.say(f"deploy: server {slot.index} {was} -> {version} ({how})")

    async def settle(self, now: float) -> None:
        """After the faults: when a pinned Turn waits for a version no live process
        serves, drain a process and start that version (at most every SETTLE_GAP_S)."""
        if now - self._settled_at < SETTLE_GAP_S:
            return
        pins = await trio.to_thread.run_sync(read_pins, self.sqlite_path, self.pg_url)
        served = {self.version_of[s.index] for s in self.slots if s.alive}
        for pin in sorted(set(pins) - served):
            if pin not in self.boots:
                continue
            slot = self.slots[-1]
            async with slot.lock:
                await self.replace(slot, pin, drain=True)
            self.counts["settle_deploys"] += 1
            self._settled_at = now

    def figures(self) -> dict[str, object]:
        counts = dict(sorted(self.counts.items()))
        deploys = counts.pop("deploys", 0)
        return {"deploys": deploys, "deploys_by_kind": counts}


# -- the store, and the check ------------------------------------------------------------

#: Every step's Turn and version (the version that ran it).
STEPS = "SELECT agent_id, agent_turn_id, step_no, version FROM agent_steps"
#: The edges that move a Turn between versions.
EDGES = (
    "SELECT agent_id, agent_turn_id, primitive, metadata FROM execution_edges "
    "WHERE primitive IN ('upgrade', 'migrate')"
)
#: The pinned agent's active Turn's pin (one head per agent).
PINS = (
    "SELECT turn_pin FROM agent_state_head WHERE agent_id = '{agent}' "
    "AND status IN ('dispatched', 'running', 'suspended') AND turn_pin IS NOT NULL"
)


def _read(sqlite_path: pathlib.Path | None, pg_url: str | None, *queries: str) -> list[list]:
    if pg_url is not None:
        import psycopg

        with psycopg.connect(pg_url, connect_timeout=10) as conn:
            return [conn.execute(q).fetchall() for q in queries]
    if sqlite_path is None or not sqlite_path.exists():
        return [[] for _ in queries]
    conn = sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True, timeout=30)
    try:
        return [conn.execute(q).fetchall() for q in queries]
    finally:
        conn.close()


def read_pins(sqlite_path: pathlib.Path | None, pg_url: str | None) -> list[str]:
    """The versions the pinned agent's active Turns are pinned to."""
    [rows] = _read(sqlite_path, pg_url, PINS.format(agent=PINNED_AGENT))
    return [str(r[0]) for r in rows]


def read_versions(
    sqlite_path: pathlib.Path | None, pg_url: str | None
) -> tuple[list[tuple], list[tuple]]:
    """(steps, edges) for :func:`check_versions`."""
    steps, edges = _read(sqlite_path, pg_url, STEPS, EDGES)
    return [tuple(r) for r in steps], [tuple(r) for r in edges]


def check_versions(
    steps: Iterable[tuple],
    edges: Iterable[tuple],
    pinned: Collection[str] = (PINNED_AGENT,),
    max_listed: int = 20,
) -> tuple[dict[str, object], list[str]]:
    """``steps``: (agent, turn, step_no, version) per step; ``edges``: (agent, turn,
    primitive, metadata JSON) per ``upgrade`` or ``migrate`` edge. Violations: a Turn of
    a ``pinned`` agent whose steps (in order) change version more often than its
    ``migrate`` edges allow (one change each), and an ``upgrade`` edge on such a Turn
    that was never migrated."""
    by_turn: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for agent, turn, step_no, version in steps:
        if version is not None:
            by_turn.setdefault((str(agent), str(turn)), []).append((int(step_no), str(version)))
    migrations: Counter = Counter()
    upgrades: Counter = Counter()
    upgraded_pinned: list[tuple[str, str, str]] = []
    for agent, turn, primitive, metadata in edges:
        try:
            meta = json.loads(metadata or "{}")
        except ValueError:
            meta = {}
        key = (str(agent), str(turn))
        way = f"{meta.get('from')}->{meta.get('to')}"
        if primitive == "migrate":
            migrations[key] += 1
        elif primitive == "upgrade":
            upgrades[way] += 1
            if agent in pinned:
                upgraded_pinned.append((str(agent), str(turn), way))
    violations: list[str] = []
    began: Counter = Counter()
    pinned_began: Counter = Counter()
    moved = 0
    for (agent, turn), ran in sorted(by_turn.items()):
        ran.sort()
        began[ran[0][1]] += 1
        changes = sum(1 for (_, a), (_, b) in itertools.pairwise(ran) if a != b)
        if agent in pinned:
            pinned_began[ran[0][1]] += 1
            if changes > migrations[agent, turn]:
                violations.append(
                    f"pinned Turn {turn} of {agent} ran on versions "
                    + " ".join(f"{n}:{v}" for n, v in ran)
                )
        elif changes:
            moved += 1
    for agent, turn, way in upgraded_pinned:
        if not migrations[agent, turn]:
            violations.append(f"pinned Turn {turn} of {agent} upgraded {way}")
    counts: dict[str, object] = {
        "turns_by_version": dict(sorted(began.items())),
        "pinned_turns_by_version": dict(sorted(pinned_began.items())),
        "turns_on_two_versions": moved,
        "upgrades": sum(upgrades.values()),
        "upgrades_by_way": dict(sorted(upgrades.items())),
        "migrations": sum(migrations.values()),
        "pinned_violations": len(violations),
    }
    return counts, violations[:max_listed]
