"""What the TCP server asks of the objects that serve some of its connections.

They live in higher layers (the runner hub in :mod:`agentserver.remote.hub`, the operator
in :mod:`agentserver.console.operator`, the named clients' replies in
:mod:`agentserver.agents.edge.named_clients`); the composition root hands them to
:class:`~agentserver.net.server.Server`, which knows them only by these protocols.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

_Link = TypeVar("_Link")


class ClientLink(Protocol):
    """One connection of a named client, as the server exposes it."""

    #: The client name of the hello (a second connection's endpoint has another name).
    identity: str
    endpoint_name: str
    #: The hello asked for acknowledgement.
    acks: bool
    #: False once the client's end of input was read: it can acknowledge nothing more.
    input_open: bool

    def offer(self, reply_id: int, body: bytes) -> bool:
        """Queue a durable reply for the client; False if the connection cannot take it.
        Without acks, the caller has committed its receipt first: queued, it is written."""
        ...


class NamedClients(Protocol):
    """Where a named client's connections meet its durable replies
    (:class:`agentserver.agents.edge.named_clients.NamedClientReplies`)."""

    async def attach(self, link: ClientLink) -> None: ...
    async def detach(self, link: ClientLink) -> None: ...
    async def received(self, link: ClientLink, reply_ids: list[int]) -> None: ...


class Runners(Protocol[_Link]):
    """The remote listeners and their runners (:class:`agentserver.remote.hub.RunnerHub`):
    a runner client's frames go to it, never to the pump."""

    def is_runner(self, client: str | None) -> bool: ...

    def attach(self, client: str, name: str, push: Callable[[bytes], bool]) -> _Link:
        """A runner client connected; ``push`` queues a frame for it without blocking."""
        ...

    def detach(self, link: _Link) -> None: ...

    def frame(self, link: _Link, data: bytes) -> None:
        """One frame from the runner. Never blocks."""
        ...


class OperatorCommands(Protocol):
    """Carries out operator commands (stop/cancel; :mod:`agentserver.console.operator`)."""

    def may_be_command(self, frame: bytes) -> bool:
        """A cheap test: False means ``frame`` is surely an ordinary request."""
        ...

    async def handle(
        self, frame: bytes, sender: str, client: str | None = None, *, operator: bool = True
    ) -> bytes | None:
        """The answer to the command in ``frame``; None if it carries none. ``client``: the
        declared client sending it (None: anonymous); ``operator``: whether it is an
        operator (else the authorization rule limits it to its own tasks)."""
        ...
