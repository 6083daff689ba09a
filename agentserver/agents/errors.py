"""Typed exceptions of the agents package."""

from __future__ import annotations

from lxml import etree

from agentserver.core.errors import AgentServerError, ConfigurationError

# Raised by every state machine (the step machine sits below the agents): defined in core.
from agentserver.core.errors import IllegalTransition as IllegalTransition


class AgentError(AgentServerError):
    """Base class of every error raised on purpose by ``agentserver.agents``."""


class StaleTurn(AgentError):
    """A compare-and-set on the agent head matched no row.

    The Turn this caller holds was ended, resumed or leased by someone else (watchdog, stop,
    a newer epoch). The transaction that raised it was rolled back: nothing was written, and
    the caller must stop without side effects.
    """


class PumpRefused(AgentError):
    """The pump refused a payload at once (validation, routing), before any peer saw it.

    ``element`` is the ``<huh>`` or ``<SystemError>`` the pump produced; the worker shows it
    to the model as the answer its payload earned.
    """

    def __init__(self, element: etree._Element, detail: str = "") -> None:
        super().__init__(detail or etree.QName(element).localname)
        self.element = element


class LLMUnavailable(AgentError):
    """The LLM port could not produce a completion (no backend, all retries failed, ...).

    ``kind`` is a short machine-readable category (the router's ``LLMError.kind`` when the
    error came from the router); ``retry_after`` the provider's Retry-After in seconds,
    when it sent one.
    """

    def __init__(
        self, message: str, kind: str = "unavailable", retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after = retry_after


class StoreError(AgentError):
    """The store is unusable (bad schema version, corrupt file, ...)."""


class StoreInUse(StoreError, ConfigurationError):
    """Another live process owns the store file. Two servers on one store would each
    "recover" the other's running Turns, so the second one refuses to start."""


class AgentConfigError(AgentError):
    """An agent or store section of boot.xml is invalid."""


class CallerElsewhere(AgentError):
    """A reply's anonymous caller is connected to another server process (a shared
    store): that process must send it; the reply stays pending in the outbox."""

    def __init__(self, process: str) -> None:
        super().__init__(f"the caller is connected to process {process}")
        self.process = process


class ForkRefused(AgentError):
    """A fork that cannot be made: no such Turn, or no such step in it."""


class TurnPruned(AgentError):
    """The Turn asked for was removed by retention (agents/store/sql/prune.py): a read
    answers this, never a partial record (HTTP: 404 problem ``pruned``)."""

    def __init__(self, agent: str, thread: str, owner: str | None = None) -> None:
        super().__init__(
            f"the Turn of {agent!r} on thread {thread!r} was pruned by the store's retention"
        )
        self.agent = agent
        self.thread = thread
        #: Who sent it, where the store knows (an A2A task's record): only they are told.
        self.owner = owner
