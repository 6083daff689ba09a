"""Routing decisions: who receives a payload. Pure functions over the topology.

These encode the routing rules of docs/protocol.md; the pump applies the decisions
(threads, queues) and never decides itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agentserver.core.errors import (
    ConfigurationError,
    DeliveryRefused,
    HuhReason,
    InputRefused,
    SystemErrorCode,
)
from agentserver.core.listener import Listener
from agentserver.core.payloads import PayloadType


@dataclass(frozen=True, slots=True)
class SelfCall:
    """The sender emitted its own root tag: deliver back to it on the same thread."""


@dataclass(frozen=True, slots=True)
class Forward:
    """Deliver to each target on a new child thread of the sender's."""

    targets: tuple[str, ...]


SELF_CALL = SelfCall()


class RoutingTable:
    """Immutable topology view: root tag → listeners, name → listener.

    ``accepts`` are the tags a listener takes when a message names it; ``claims`` the
    subset a message that names no listener is routed by (its ``addressed_only`` types
    are taken by name only, so several listeners may take one without broadcast)."""

    def __init__(self, listeners: Iterable[Listener], tag_of: dict[type, PayloadType]) -> None:
        self.by_name: dict[str, Listener] = {}
        self.by_tag: dict[str, tuple[str, ...]] = {}
        self.accepts: dict[str, frozenset[str]] = {}
        self.claims: dict[str, frozenset[str]] = {}
        for listener in listeners:
            if listener.name in self.by_name:
                raise ConfigurationError(f"listener name {listener.name!r} is used twice")
            self.by_name[listener.name] = listener
            tags = frozenset(tag_of[m].tag for m in listener.payload_types)
            claimed = tags - frozenset(tag_of[m].tag for m in listener.addressed_only)
            self.accepts[listener.name] = tags
            self.claims[listener.name] = claimed
            for tag in claimed:
                self.by_tag[tag] = (*self.by_tag.get(tag, ()), listener.name)
        for tag, names in self.by_tag.items():
            if len(names) > 1 and not all(self.by_name[n].broadcast for n in names):
                raise ConfigurationError(
                    f"root tag {tag} is accepted by {', '.join(names)}: several listeners may "
                    "share a root tag only if all of them are broadcast listeners"
                )

    def inbound(self, tag: str, to: str | None) -> tuple[str, ...]:
        """Targets of a message from outside (a client). Raises InputRefused (one canned
        text for unknown tag and unknown or unfit ``to``, so nothing can be probed)."""
        if to is not None:
            if tag in self.accepts.get(to, ()):
                return (to,)
            raise InputRefused(HuhReason.INVALID_PAYLOAD, f"to={to!r} does not take {tag}")
        targets = self.by_tag.get(tag)
        if not targets:
            raise InputRefused(HuhReason.INVALID_PAYLOAD, f"nobody takes {tag}", payload_tag=tag)
        return targets

    def explain(self, refusal: InputRefused) -> InputRefused:
        """``refusal`` of a payload no listener takes, its detail (the log's, and
        ``--explain-refusals``'s) completed with what the listeners take of that local
        name: e.g. "payload `count` has no namespace; listener `wc` accepts
        `{urn:me:wc}count`". Refusals only: the sender's ``<huh>`` stays canned."""
        tag = refusal.payload_tag
        if tag is None:
            return refusal
        local = tag.rpartition("}")[2]
        takers = [
            f"listener `{name}` accepts `{t}`"
            for name, tags in self.accepts.items()
            for t in sorted(tags)
            if t.rpartition("}")[2] == local
        ]
        hint = "; ".join(takers) if takers else f"no listener accepts a payload named `{local}`"
        if tag.startswith("{") and refusal.detail.startswith("unknown root tag"):
            namespace = tag[1:].partition("}")[0]
            detail = f"payload `{local}` has namespace `{namespace}`, which no listener accepts"
        else:
            detail = refusal.detail
        return InputRefused(refusal.reason, f"{detail}; {hint}", payload_tag=tag)

    def outbound(self, sender: str, tag: str, to: str | None) -> SelfCall | Forward:
        """Where a handler's forward goes.

        Own root tag (no ``to``, or ``to`` = own name) is self-iteration, never a peer
        violation (a tag it takes by name only is its own with ``to`` = own name). Any
        other target must be in the sender's peers, else ``DeliveryRefused(routing)``; a
        peer that does not take the tag is InputRefused.
        """
        if (to is None and tag in self.claims[sender]) or (
            to == sender and tag in self.accepts[sender]
        ):
            return SELF_CALL
        peers = self.by_name[sender].peers
        if to is not None:
            if to not in peers:
                raise DeliveryRefused(
                    SystemErrorCode.ROUTING, retry_allowed=True, detail=f"{sender}→{to} not a peer"
                )
            if tag not in self.accepts.get(to, ()):
                raise InputRefused(HuhReason.INVALID_PAYLOAD, f"peer {to!r} does not take {tag}")
            return Forward((to,))
        candidates = self.by_tag.get(tag, ())
        if not candidates:
            raise InputRefused(HuhReason.INVALID_PAYLOAD, f"nobody takes {tag}")
        allowed = tuple(n for n in candidates if n in peers)
        if not allowed:
            raise DeliveryRefused(
                SystemErrorCode.ROUTING,
                retry_allowed=True,
                detail=f"{sender}: {tag} not for a peer",
            )
        return Forward(allowed)
