"""HttpContext: everything the HTTP API reads, built by the composition root."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from prometheus_client import CollectorRegistry

from agentserver.agents.edge.webhooks import Webhooks
from agentserver.agents.events import EventBus, Subscription
from agentserver.agents.governance.budgets import Budgets
from agentserver.agents.profile.schedule import ScheduleSpec
from agentserver.agents.store.base import Fired, ScheduleRow
from agentserver.core.access import AccessRule
from agentserver.core.throttle import HelloThrottle
from agentserver.http.agents_view import AgentsView
from agentserver.http.auth import HttpAuth
from agentserver.http.gateway import HttpGateway
from agentserver.http.ui.sessions import UiSessions
from agentserver.net.roles import OperatorCommands
from agentserver.pump.pump import Pump


class Forks(Protocol):
    """What ``POST /v1/agents/{name}/tasks/{thread}/fork`` asks of the agents (the agent
    runtime: ``AgentRuntime.fork`` and ``expect_fork``)."""

    async def fork(self, agent_id: str, thread: str, at_step: int) -> dict[str, Any]: ...

    def expect_fork(self, agent_id: str, thread: str, conversation: str) -> None: ...


class Schedules(Protocol):
    """What ``/v1/schedules`` asks of the agents (the runtime's
    :class:`~agentserver.agents.turn.scheduler.Scheduler`)."""

    async def list(self) -> list[ScheduleRow]: ...
    async def add(self, spec: ScheduleSpec, owner: str | None = None) -> ScheduleRow: ...
    async def pause(self, name: str, paused: bool) -> ScheduleRow: ...
    async def trigger(self, name: str) -> Fired | None: ...
    async def delete(self, name: str) -> None: ...
    async def get(self, name: str) -> ScheduleRow: ...


class DrainControl(Protocol):
    """What ``/v1/drain`` asks of the process (``agentserver/app/drain.py``)."""

    def start(self) -> dict[str, Any]: ...
    def state(self) -> dict[str, Any]: ...


@dataclass
class HttpContext:
    """Everything the app reads; built by the composition root (agentserver/app/root.py)."""

    pump: Pump
    gateway: HttpGateway
    auth: HttpAuth
    registry: CollectorRegistry
    throttle: HelloThrottle = field(default_factory=HelloThrottle)
    agents: AgentsView | None = None
    #: Forks of agents' conversations (None: no agents).
    forks: Forks | None = None
    #: Runs on a schedule (None: no agents).
    schedules: Schedules | None = None
    events: EventBus | None = None
    #: ``() -> {backend: stats}`` of the LLM router (None: no router).
    backends: Callable[[], dict[str, dict[str, Any]]] | None = None
    #: ``() -> dict`` of the transports' figures (connections, counters) for /v1/status.
    transports: Callable[[], dict[str, Any]] = dict
    #: The remote listeners' step log (agents/store/step_log.py; None: no remote listeners).
    steps: Any = None
    #: Carries out stop/cancel for the web console (the socket's operator object);
    #: None: no one may. Operators: the clients in ``operators``, and anonymous callers
    #: if ``anonymous_operators`` (as on the socket).
    operator: OperatorCommands | None = None
    operators: frozenset[str] = frozenset()
    anonymous_operators: bool = False
    #: The webhooks (agents/edge/webhooks.py; None: no agents, so no store to keep them).
    webhooks: Webhooks | None = None
    #: The web console's TLS: its cookies are marked ``Secure``.
    tls: bool = False
    #: ``/mcp`` (:class:`agentserver.http.mcp_expose.McpHttp`; None: ``<expose-mcp>`` absent).
    mcp: Any = None
    #: The A2A methods (:class:`agentserver.http.a2a.handler.A2aHandler`; None:
    #: ``<expose-a2a>`` absent).
    a2a: Any = None
    #: AG-UI runs on the agents (:class:`agentserver.http.agui.runs.AguiRuns`; None: no
    #: agents).
    agui: Any = None
    organism: str = ""
    version: str = ""
    #: The spend budgets (None: none declared; ``PUT /v1/budgets`` then refuses).
    budgets: Budgets | None = None
    #: The web console's sign-in sessions (http/ui/sessions.py), kept in the agents'
    #: store; None: in this process's memory (an app built without a store).
    ui_sessions: UiSessions | None = None
    counters: dict[str, int] = field(
        default_factory=lambda: {
            "requests": 0,
            "unauthenticated": 0,
            "throttled": 0,
            "sse_dropped": 0,
            "query_tokens": 0,
        }
    )
    #: The authorization rule every route applies (agentserver/core/access.py); None:
    #: made from ``operators`` and ``auth`` without a refusal sink (a test's context).
    access: AccessRule | None = None
    #: This process's drain (``/v1/drain``); None: not offered (a test's context).
    drain: DrainControl | None = None
    #: Set by :meth:`close`.
    closing: trio.Event = field(default_factory=trio.Event)
    #: The open event streams' subscriptions.
    subscriptions: set[Subscription] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.access is None:
            self.access = AccessRule(self.operators, anonymous_sees_all=not self.auth.required)

    def close(self) -> None:
        """The server is shutting down: end the event streams now (endless, they would
        hold the server for the whole graceful timeout)."""
        self.closing.set()
        for sub in list(self.subscriptions):
            sub.close()
