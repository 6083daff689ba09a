"""The agent runtime's composition: every part of an :class:`AgentRuntime` built here, in
dependency order, each given what it uses at construction (docs/architecture.md,
"Composition"). The server's root (``app/agents.py``), replay, the benches and the tests
all build a runtime through :func:`runtime_parts`, so there is one way it is wired.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from agentserver.agents.clock import Clock, SystemClock
from agentserver.agents.doorbell import Doorbell
from agentserver.agents.events import EventBus
from agentserver.agents.governance.approvals import Approvals, SendApproval
from agentserver.agents.governance.budgets import Budgets
from agentserver.agents.ports import LLMPort, ReplyPort, ToolPort
from agentserver.agents.profile.agent import AgentProfile
from agentserver.agents.profile.schedule import ScheduleSpec
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.runtime import (
    AgentRuntime,
    EndedElsewhere,
    RuntimeParts,
    open_agent_store,
    served_versions,
)
from agentserver.agents.store.base import AgentStore
from agentserver.agents.store.served import ServedVersions
from agentserver.agents.turn.delivery import SentMarks, TurnEnder
from agentserver.agents.turn.hold import TurnHold
from agentserver.agents.turn.scheduler import Scheduler
from agentserver.agents.turn.watchdog import Watchdog
from agentserver.agents.turn.worker import Worker
from agentserver.observability.tracing import Tracing

__all__ = ["open_runtime", "runtime_parts"]


def runtime_parts(
    *,
    store: AgentStore,
    profiles: Mapping[str, AgentProfile],
    llm: LLMPort,
    tools: ToolPort,
    replies: ReplyPort,
    settings: StoreSettings,
    clock: Clock | None = None,
    events: EventBus | None = None,
    tracing: Tracing | None = None,
    send_approval: SendApproval | None = None,
    listener_approvers: tuple[str, ...] = (),
    retryable_tools: Collection[str] = (),
    budgets: Budgets | None = None,
    schedules: Sequence[ScheduleSpec] = (),
    served: ServedVersions | None = None,
) -> RuntimeParts:
    """The parts of a runtime over ``store`` for ``profiles``. ``send_approval`` delivers
    approval requests (None: they wait in the store); ``listener_approvers`` are the
    approvers that are listeners (their requests are sent again after a restart);
    ``retryable_tools`` the listeners whose calls a restart interrupted are sent again
    (``idempotent``). Builds objects only: no I/O."""
    profiles = dict(profiles)
    served = served if served is not None else served_versions(profiles)
    clock = clock or SystemClock()
    events = events or EventBus()
    doorbell = Doorbell()
    sent_marks = SentMarks(store)
    ender = TurnEnder(
        store,
        profiles,
        replies,
        events,
        doorbell,
        settings.reply_max_attempts,
        sent_marks,
    )
    approvals = Approvals(
        store,
        clock,
        doorbell,
        send=send_approval,
        interval_s=settings.watchdog_interval_s,
        events=events,
    )
    hold = TurnHold(ender, tracing or Tracing())
    worker = Worker(
        hold=hold,
        llm=llm,
        tools=tools,
        clock=clock,
        settings=settings,
        approvals=approvals,
        budgets=budgets,
        served=served,
    )
    return RuntimeParts(
        store=store,
        profiles=profiles,
        settings=settings,
        clock=clock,
        events=events,
        doorbell=doorbell,
        tools=tools,
        sent_marks=sent_marks,
        ender=ender,
        approvals=approvals,
        hold=hold,
        worker=worker,
        watchdog=Watchdog(ender=ender, settings=settings, budgets=budgets),
        scheduler=Scheduler(
            store,
            profiles,
            clock,
            doorbell,
            EndedElsewhere(worker, ender),
            declared=schedules,
        ),
        budgets=budgets,
        listener_approvers=listener_approvers,
        retryable_tools=frozenset(retryable_tools),
        served=served,
    )


def open_runtime(
    settings: StoreSettings,
    profiles: Mapping[str, AgentProfile],
    *,
    llm: LLMPort,
    tools: ToolPort,
    replies: ReplyPort,
    clock: Clock | None = None,
    tracing: Tracing | None = None,
    send_approval: SendApproval | None = None,
    listener_approvers: tuple[str, ...] = (),
    retryable_tools: Collection[str] = (),
    schedules: Sequence[ScheduleSpec] = (),
) -> AgentRuntime:
    """A runtime over the store of ``settings``, opened (created or migrated) here: the
    PostgreSQL database of ``settings.url`` if set, else the SQLite file at
    ``settings.path``. Blocking (the store's open): call once at start."""
    clock = clock or SystemClock()
    served = served_versions(profiles)
    store = open_agent_store(settings, profiles, clock=clock, served=served)
    return AgentRuntime(
        runtime_parts(
            store=store,
            profiles=profiles,
            llm=llm,
            tools=tools,
            replies=replies,
            settings=settings,
            clock=clock,
            tracing=tracing,
            send_approval=send_approval,
            listener_approvers=listener_approvers,
            retryable_tools=retryable_tools,
            schedules=schedules,
            served=served,
        )
    )
