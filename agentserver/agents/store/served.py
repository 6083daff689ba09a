"""Which agent versions this process serves, and so which rows it may claim
(docs/deploy.md, "Deploying with Turns in flight").

A Turn records the version it started with on its agent's head (``turn_version``), and a
pinned Turn its pin (``turn_pin``: the same version). A process claims:

- a pinned Turn's rows only if it serves that Turn's version;
- anything else (a new task, an ``upgrade`` Turn's rows) only if it takes new work for the
  agent: it is not draining, and no live process serves a newer version of the agent
  (:attr:`ServedVersions.newest`, set from the store's leases on PostgreSQL; a process
  alone on its store takes all of it).

Plain data read on the store's hot path (the claim's filter): no I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class ServedVersions:
    """This process's agents' versions. ``versions`` empty: unversioned (a store opened
    without agents, as tools and tests do): every row may be claimed."""

    #: agent → the version this process serves (its id).
    versions: Mapping[str, str] = field(default_factory=dict)
    #: agent → its full digest.
    digests: Mapping[str, str] = field(default_factory=dict)
    #: The agents whose Turns are pinned (``<agent versioning="pinned">``).
    pinned: frozenset[str] = frozenset()
    #: The agents whose new work this process takes: it serves their newest live version.
    #: None: all of them (alone on the store). Set by the store's heartbeat.
    newest: frozenset[str] | None = None
    #: Draining (``agentserver drain``): no new work, only Turns pinned to its versions.
    draining: bool = False

    def version(self, agent_id: str) -> str | None:
        """The version of ``agent_id`` this process serves (None: unversioned)."""
        return self.versions.get(agent_id)

    def takes_new(self, agent_id: str) -> bool:
        """Whether this process takes new tasks and ``upgrade`` Turns of ``agent_id``."""
        return not self.draining and (self.newest is None or agent_id in self.newest)

    def start_given(self, agent_id: str) -> dict[str, str | None]:
        """The values a Turn's start records on the head (``HeadEvent.START``'s effects):
        its version, and its pin if the agent's Turns are pinned."""
        version = self.versions.get(agent_id)
        return {"version": version, "pin": version if agent_id in self.pinned else None}

    def head_filter(self, agent_id: str) -> tuple[str, tuple[str, ...]]:
        """The condition on head ``h`` of ``agent_id`` under which this process claims the
        agent's rows, with its parameters; ``("", ())`` when unversioned."""
        if not self.versions:
            return "", ()
        version = self.versions.get(agent_id)
        if self.takes_new(agent_id):
            if version is None:
                return "h.turn_pin IS NULL", ()
            return "(h.turn_pin IS NULL OR h.turn_pin = ?)", (version,)
        if version is None:
            return "1 = 0", ()
        return "h.turn_pin = ?", (version,)

    def heads_filter(self) -> tuple[str, tuple[str, ...]]:
        """:meth:`head_filter` for every agent at once (head ``h``; the due agents' list)."""
        if not self.versions:
            return "", ()
        pairs = tuple(f"{agent} {version}" for agent, version in sorted(self.versions.items()))
        pinned_here = f"(h.agent_id || ' ' || h.turn_pin) IN ({', '.join('?' * len(pairs))})"
        if not self.draining and self.newest is None:
            # Alone on the store: every agent's new work (an agent this process does not
            # serve too: its rows are answered as such).
            return f"(h.turn_pin IS NULL OR {pinned_here})", pairs
        new = tuple(agent for agent in sorted(self.versions) if self.takes_new(agent))
        if not new:
            return pinned_here, pairs
        return (
            f"((h.turn_pin IS NULL AND h.agent_id IN ({', '.join('?' * len(new))})) "
            f"OR {pinned_here})",
            (*new, *pairs),
        )
