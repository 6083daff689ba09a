"""A pump's roster: who is attached to it, and the wiring made of them for the run.

Listeners are registered before the pump runs and frozen then (:meth:`Roster.freeze`) into
the routing table, one :class:`~agentserver.pump.runtime.ListenerRuntime` per listener and
the synchronous fast path's tags; endpoints are attached and detached while it runs.

Nothing here is on the per-message path: the pump holds the very dicts made here
(``runtimes``, ``sync_by_tag``, ``endpoints``) as its own attributes and reads them there,
so a message costs no lookup through the roster. All of it is synchronous (no checkpoint:
nothing here can be cancelled half-way).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from agentserver.core.errors import ConfigurationError, PumpClosed
from agentserver.core.listener import NAME_RE, RESERVED_NAMES, Listener
from agentserver.core.payloads import PayloadRegistry
from agentserver.core.routing import RoutingTable
from agentserver.core.threads import ThreadQuota, ThreadRegistry, new_thread_id
from agentserver.core.usage import describe_payload, usage_instructions
from agentserver.observability.metrics import LatencyHistogram
from agentserver.pump.config import PumpConfig
from agentserver.pump.endpoint import Endpoint, EndpointOwner, Sink
from agentserver.pump.runtime import ListenerRuntime


class Roster:
    """The listeners and endpoints of one pump (``owner``), by name: names are unique
    across both. ``payloads`` gets every listener's payload and response types as it is
    registered; ``threads`` loses a detached endpoint's conversations."""

    def __init__(
        self,
        config: PumpConfig,
        payloads: PayloadRegistry,
        threads: ThreadRegistry,
        owner: EndpointOwner,
    ) -> None:
        self.config = config
        self.payloads = payloads
        self.threads = threads
        self.owner = owner
        self._listeners: list[Listener] = []
        #: Set by :meth:`freeze`; listeners can no longer be registered then.
        self.table: RoutingTable | None = None
        #: Listener name → its runtime, filled by :meth:`freeze` (in place: the pump holds
        #: this dict).
        self.runtimes: dict[str, ListenerRuntime] = {}
        #: Root tag → the runtime of the one synchronous listener taking it (in place too).
        self.sync_by_tag: dict[str, ListenerRuntime] = {}
        #: Attached endpoints by name (the pump holds this dict too).
        self.endpoints: dict[str, Endpoint] = {}

    # -- listeners -----------------------------------------------------------------------

    def register(self, listener: Listener) -> None:
        """Add a listener (before :meth:`freeze`). Derives and compiles its payload XSDs
        now, so a model without an XSD equivalent fails here, not at the first message."""
        if self.table is not None:
            raise ConfigurationError("listeners must be registered before the pump runs")
        if any(existing.name == listener.name for existing in self._listeners):
            raise ConfigurationError(f"listener name {listener.name!r} is used twice")
        for model in (*listener.payload_types, *listener.responses):
            self.payloads.add(model)
        self._listeners.append(listener)

    @property
    def listeners(self) -> tuple[Listener, ...]:
        return tuple(self._listeners)

    @property
    def routes(self) -> RoutingTable:
        """The routing table :meth:`freeze` built. Raises :class:`PumpClosed` before it
        (nothing can be routed before the pump runs)."""
        if self.table is None:
            raise PumpClosed("new: the routing table is built when the pump runs")
        return self.table

    def freeze(self) -> RoutingTable:
        """Check the peers, build the routing table and each listener's runtime (its queue
        and generated usage instructions); returns the table. Raises ConfigurationError
        (an unknown peer, a root tag shared without broadcast) having set nothing."""
        names = {listener.name for listener in self._listeners}
        for listener in self._listeners:
            missing = [p for p in listener.peers if p not in names]
            if missing:
                raise ConfigurationError(
                    f"listener {listener.name!r} names unknown peers: {', '.join(missing)}"
                )
        tag_of = {p.model: p for p in self.payloads}
        table = RoutingTable(self._listeners, tag_of)
        by_name = {listener.name: listener for listener in self._listeners}
        # Describing a type compiles its XSD with xmlschema (~15 ms): once per type, not
        # once per listener that has it among its peers' types.
        describe = functools.cache(describe_payload)
        for listener in self._listeners:
            own = [tag_of[m] for m in listener.payload_types]
            peers = {p: [tag_of[m] for m in by_name[p].payload_types] for p in listener.peers}
            self.runtimes[listener.name] = ListenerRuntime(
                listener, usage_instructions(listener.name, own, peers, describe=describe)
            )
        for tag, taking in table.by_tag.items():
            if len(taking) == 1 and self.runtimes[taking[0]].listener.sync:
                self.sync_by_tag[tag] = self.runtimes[taking[0]]
        self.table = table
        return table

    def usage_instructions(self, name: str) -> str:
        """The generated instructions of a listener (available once frozen)."""
        return self.runtimes[name].usage

    def queue_stats(self) -> dict[str, dict[str, int]]:
        """Per listener: deliveries queued, senders waiting for room, deliveries handled."""
        runtimes = self.runtimes.items()
        return {
            "queues": {n: rt.send.statistics().current_buffer_used for n, rt in runtimes},
            "waiting": {n: len(rt.waiters) for n, rt in runtimes},
            "handled": {n: rt.handled for n, rt in runtimes},
        }

    def handler_latency(self) -> dict[str, LatencyHistogram]:
        """Each listener's handler durations (for the metrics)."""
        return {n: rt.latency for n, rt in self.runtimes.items()}

    # -- endpoints -----------------------------------------------------------------------

    def open_endpoint(
        self,
        name: str | None = None,
        *,
        buffer: int | None = None,
        buffer_bytes: int | None = None,
        allowed: Iterable[str] | None = None,
        sink: Sink | None = None,
        on_chain_end: Callable[[], None] | None = None,
    ) -> Endpoint:
        """Attach an external party. ``name`` must not be a listener's or another
        endpoint's; by default a unique ``client-…`` name is generated. Its outgoing buffer
        holds ``buffer`` messages and ``buffer_bytes`` bytes (the config's by default).
        ``sink`` and ``on_chain_end`` are its owner's hooks (see :class:`Endpoint`), kept
        until :meth:`Endpoint.release`. Synchronous; raises ConfigurationError for a bad
        or taken name."""
        if name is None:
            name = "client-" + new_thread_id()[:8]
            while name in self.endpoints:
                name = "client-" + new_thread_id()[:8]
        if not NAME_RE.match(name) or name in RESERVED_NAMES:
            raise ConfigurationError(f"endpoint name {name!r}: use 1-64 of [a-z0-9_-]")
        if name in self.endpoints or any(lst.name == name for lst in self._listeners):
            raise ConfigurationError(f"endpoint name {name!r} is taken")
        endpoint = Endpoint(
            self.owner,
            name,
            buffer or self.config.endpoint_buffer,
            frozenset(allowed) if allowed is not None else None,
            buffer_bytes or self.config.endpoint_buffer_bytes,
            quota=ThreadQuota(self.config.max_threads_per_endpoint),
            sink=sink,
            on_chain_end=on_chain_end,
        )
        self.endpoints[name] = endpoint
        return endpoint

    def detach_endpoint(self, endpoint: Endpoint) -> None:
        """Forget a closed endpoint: its name is free again and its threads are dropped.
        Synchronous; idempotent."""
        if self.endpoints.get(endpoint.name) is endpoint:
            del self.endpoints[endpoint.name]
            self.threads.remove_owned_by(endpoint.name)

    def is_connected(self, name: str) -> bool:
        """True if ``name`` is a listener (once frozen) or an attached endpoint."""
        return name in self.runtimes or name in self.endpoints
