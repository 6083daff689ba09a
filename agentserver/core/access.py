"""Who may see and act on an object (docs/security.md, "Who may see and act on what"):
the one authorization rule every door calls (the HTTP API's ``/v1`` and ``/ui`` routes,
its event streams, A2A, MCP, the socket's operator commands, the approval decisions).

- A declared client sees and acts on its own: what it sent (a task names its sender in
  its reply reference: ``client``, or ``speaks_for`` for an HTTP message), the
  conversations of those tasks, the schedules it made, its own budgets.
- An operator (a client boot.xml marks ``operator="true"``) sees and acts on all.
- An anonymous caller exists only without ``<clients>`` (loopback only): it keeps what it
  always had, everything.

A door asks :meth:`AccessRule.allows` with the caller's name and the object's owner (None:
nobody's, e.g. a schedule of boot.xml or a task an agent sent); a refused object must be
answered exactly as a missing one (so its id cannot be probed), and every refusal is
reported to the :class:`RefusalSink` the composition root passes in (counted in
``/metrics`` and logged with the client and the route, never with the object's content).

Sans I/O: the rule is a plain object; what a refusal does is the sink's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

#: The reply reference's keys naming the client that sent a task: a socket connection's
#: identity (``client``) or an HTTP message's bearer token's (``speaks_for``).
SENDER_KEYS = ("client", "speaks_for")


class RefusalSink(Protocol):
    """Told of each refusal (:class:`agentserver.observability.metrics.AccessRefusals`
    counts and logs them)."""

    def refused(self, client: str | None, door: str, route: str) -> None: ...


def sender_of(reply_ref: Mapping[str, object] | None) -> str | None:
    """The declared client that sent the task of ``reply_ref`` (a decoded reply reference),
    None when it names none (an anonymous caller, an agent, a schedule)."""
    if not isinstance(reply_ref, Mapping):
        return None
    for key in SENDER_KEYS:
        value = reply_ref.get(key)
        if isinstance(value, str) and value:
            return value
    return None


class AccessRule:
    """The rule for one server: ``operators`` are the clients marked ``operator="true"``;
    ``anonymous_sees_all`` is true when no client is declared (then every caller is
    anonymous and sees all, as before the rule). ``sink``: where refusals go (None: a
    test's rule, refusals only answered)."""

    def __init__(
        self,
        operators: frozenset[str] = frozenset(),
        *,
        anonymous_sees_all: bool = True,
        sink: RefusalSink | None = None,
    ) -> None:
        self.operators = frozenset(operators)
        self.anonymous_sees_all = anonymous_sees_all
        self.sink = sink

    def sees_all(self, client: str | None) -> bool:
        """Whether ``client`` (None: anonymous) sees and acts on every object."""
        if client is None:
            return self.anonymous_sees_all
        return client in self.operators

    def scope(self, client: str | None) -> str | None:
        """The one owner whose objects ``client`` may list, or None when it sees all (a
        listing's filter: ``scope`` of a client is its own name)."""
        if self.sees_all(client):
            return None
        # An anonymous caller with clients declared cannot be authenticated; should one
        # reach here it owns nothing (no object is owned by the empty name).
        return client or ""

    def decide(self, client: str | None, owner: str | None) -> bool:
        """Pure: whether ``client`` may see and act on an object of ``owner``."""
        return self.sees_all(client) or (client is not None and owner == client)

    def allows(self, client: str | None, owner: str | None, *, door: str, route: str) -> bool:
        """:meth:`decide`, with a refusal reported (``door``: http, ui, a2a, mcp, socket;
        ``route``: the route's pattern or the method's name, never an object's id)."""
        if self.decide(client, owner):
            return True
        self.refuse(client, door, route)
        return False

    def refuse(self, client: str | None, door: str, route: str) -> None:
        """Report a refusal the door decided with this rule (an object filtered out of a
        stream, an operator-only action asked by a client)."""
        if self.sink is not None:
            self.sink.refused(client, door, route)
