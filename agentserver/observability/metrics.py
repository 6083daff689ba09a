"""Prometheus metrics, on a ``CollectorRegistry`` the composition root creates.

The pump's hot path only bumps plain ints and one cheap latency histogram of its own
(:class:`LatencyHistogram`); they are read when the registry is scraped, by collectors
bound here. Cold paths (LLM calls, agent events) use prometheus-client's metrics
directly. Metrics of a subsystem that is absent (no agents, no LLM router) are not
registered. The list is in docs/operations.md.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from agentserver.observability.logs import FIELDS_ATTRIBUTE

_access_log = logging.getLogger("agentserver.access")

#: Seconds; handlers range from microseconds (echo) to the handler timeout.
HANDLER_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: The GenAI semantic conventions' advice for gen_ai.client.operation.duration.
LLM_DURATION_BUCKETS = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
#: ... and for gen_ai.client.token.usage.
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))
_BREAKER_STATES = ("closed", "open", "half_open")


class LatencyHistogram:
    """A histogram cheap enough for the pump's per-message path: no lock (trio runs the
    pump on one thread), one bisect per observation. An observation may stand for
    ``weight`` calls (the pump times fast handlers one call in several). Read by
    :class:`_PumpCollector`."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = HANDLER_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, seconds: float, weight: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += weight
        self.total += seconds * weight

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative ``(le, count)`` pairs, ``+Inf`` last."""
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class _PumpCollector(Collector):
    def __init__(self, pump: Any, connections: Callable[[], int] | None) -> None:
        self.pump = pump
        self.connections = connections

    def collect(self) -> Iterator[Metric]:
        pump = self.pump
        stats = pump.stats()
        yield _counter(
            "agentserver_messages_received",
            "Messages delivered to a listener's handler, by listener.",
            ["listener"],
            stats["handled"].items(),
        )
        yield _counter(
            "agentserver_messages_injected",
            "Messages received from clients (endpoints), before validation.",
            [],
            [((), stats["injected"])],
        )
        yield _counter(
            "agentserver_messages_sent",
            "Messages the pump pushed to clients (endpoints): replies and refusals.",
            [],
            [((), stats["sent"])],
        )
        yield _counter(
            "agentserver_messages_refused",
            "Messages refused by the pump, by the listener (or client) refused and reason.",
            ["listener", "reason"],
            pump.refusals.items(),
        )
        events = [
            ("handler_errors", "Handler calls that raised or returned something unusable."),
            ("timeouts", "Handler calls and queue waits that timed out."),
            ("dropped", "Messages dropped because nobody could receive them any more."),
        ]
        for key, doc in events:
            yield _counter(f"agentserver_pump_{key}", doc, [], [((), stats[key])])
        queue = GaugeMetricFamily(
            "agentserver_queue_depth", "Messages queued for a listener.", labels=["listener"]
        )
        for name, depth in stats["queues"].items():
            queue.add_metric([name], depth)
        yield queue
        waiting = GaugeMetricFamily(
            "agentserver_queue_waiters",
            "Senders waiting for room in a listener's full queue.",
            labels=["listener"],
        )
        for name, n in stats["waiting"].items():
            waiting.add_metric([name], n)
        yield waiting
        yield GaugeMetricFamily(
            "agentserver_threads", "Threads in the thread registry.", value=stats["threads"]
        )
        yield GaugeMetricFamily(
            "agentserver_inflight", "Messages queued or being handled.", value=stats["inflight"]
        )
        yield GaugeMetricFamily(
            "agentserver_endpoints",
            "Attached endpoints (client connections and in-process endpoints).",
            value=stats["endpoints"],
        )
        if self.connections is not None:
            yield GaugeMetricFamily(
                "agentserver_connections", "Open client connections.", value=self.connections()
            )
        latency = HistogramMetricFamily(
            "agentserver_handler_duration_seconds",
            "Time a listener's handler took per message (the handler call only).",
            labels=["listener"],
        )
        for name, hist in pump.handler_latency().items():
            latency.add_metric([name], hist.buckets(), hist.total)
        yield latency


class _RouterCollector(Collector):
    def __init__(self, router: Any) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        stats = self.router.stats()
        breaker = GaugeMetricFamily(
            "agentserver_llm_breaker_state",
            "1 for the breaker state a backend is in, 0 for the others.",
            labels=["backend", "state"],
        )
        cooling = GaugeMetricFamily(
            "agentserver_llm_cooling_seconds",
            "Seconds until a backend's Retry-After expires.",
            labels=["backend"],
        )
        active = GaugeMetricFamily(
            "agentserver_llm_active_calls",
            "Calls holding or waiting for a backend's slot or rate-limit admission.",
            labels=["backend"],
        )
        buckets = GaugeMetricFamily(
            "agentserver_llm_bucket_fill_ratio",
            "A backend's rate-limit bucket level over its capacity (1 = full).",
            labels=["backend", "bucket"],
        )
        attempts = CounterMetricFamily(
            "agentserver_llm_backend_attempts",
            "HTTP attempts sent to a backend (retries and failovers included).",
            labels=["backend"],
        )
        opens = CounterMetricFamily(
            "agentserver_llm_breaker_opens", "Times a backend's breaker opened.", labels=["backend"]
        )
        for name, b in stats.backends.items():
            if b.skipped is not None:
                continue
            for state in _BREAKER_STATES:
                breaker.add_metric([name, state], 1.0 if b.breaker == state else 0.0)
            cooling.add_metric([name], b.cooling_for)
            active.add_metric([name], b.active)
            if b.requests_bucket_fill is not None:
                buckets.add_metric([name, "requests"], b.requests_bucket_fill)
            if b.tokens_bucket_fill is not None:
                buckets.add_metric([name, "tokens"], b.tokens_bucket_fill)
            attempts.add_metric([name], b.counters.requests)
            opens.add_metric([name], b.breaker_opens)
        yield from (breaker, cooling, active, buckets, attempts, opens)


class _AgentStoreCollector(Collector):
    """Inbox lag and pending approvals of the agent store, from the snapshot of
    ``figures`` (an :class:`agentserver.agents.store.figures.StoreFigures`, refreshed by
    its own task: a scrape never waits on the database); every agent of ``agents`` gets a
    sample (0 when it has nothing waiting)."""

    def __init__(self, figures: Any, agents: tuple[str, ...]) -> None:
        self.figures = figures
        self.agents = agents

    def collect(self) -> Iterator[Metric]:
        lag = self.figures.inbox_lag()
        pending = self.figures.approvals_pending()
        if lag is None or pending is None:
            # No snapshot yet, or the store is failing: left out, the rest stays whole.
            return
        lag_family = GaugeMetricFamily(
            "agentserver_agent_inbox_lag_seconds",
            "Age of an agent's oldest task not yet started (0 when none waits).",
            labels=["agent"],
        )
        pending_family = GaugeMetricFamily(
            "agentserver_agent_approvals_pending",
            "Approval requests of an agent's tool calls waiting for a decision.",
            labels=["agent"],
        )
        for agent in sorted({*self.agents, *lag, *pending}):
            lag_family.add_metric([agent], lag.get(agent, 0.0))
            pending_family.add_metric([agent], pending.get(agent, 0))
        yield lag_family
        yield pending_family


class _StepLogCollector(Collector):
    """The durable step log's buffer (agents/store/step_log.py ``StoreStepLog``): rows waiting
    to be written, and rows dropped because the buffer was full."""

    def __init__(self, step_log: Any) -> None:
        self.step_log = step_log

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "agentserver_step_log_waiting",
            "Step-log rows buffered and not yet written to the agent store.",
            value=self.step_log.waiting,
        )
        yield CounterMetricFamily(
            "agentserver_step_log_dropped",
            "Step-log rows dropped because the buffer was full (the store failing or slow).",
            value=self.step_log.dropped,
        )


class _BudgetCollector(Collector):
    """The spend budgets (agents/governance/budgets.py ``Budgets``): spent, reserved and
    remaining of each budget's current period, from the snapshot its refresh task reads
    (a scrape never waits on the store), and this process's refusals by budget."""

    def __init__(self, budgets: Any) -> None:
        self.budgets = budgets

    def collect(self) -> Iterator[Metric]:
        rows = self.budgets.snapshot
        refused = CounterMetricFamily(
            "agentserver_budget_refusals",
            "Model calls this process refused because a budget had no room, by budget.",
            labels=["budget"],
        )
        for name in sorted({*self.budgets.specs, *self.budgets.refusals}):
            refused.add_metric([name], self.budgets.refusals.get(name, 0))
        yield refused
        if rows is None:
            return
        families = {
            what: GaugeMetricFamily(
                f"agentserver_budget_{what}",
                f"A budget's {what} in its current period, by budget and unit (tokens, cost).",
                labels=["budget", "unit"],
            )
            for what in ("spent", "reserved", "remaining", "limit")
        }
        for r in rows:
            tokens_left, cost_left = r.remaining()
            for unit, spent, reserved, left, limit in (
                ("tokens", r.spent_tokens, r.reserved_tokens, tokens_left, r.limit_tokens),
                ("cost", r.spent_cost, r.reserved_cost, cost_left, r.limit_cost),
            ):
                if limit is None:
                    continue
                families["spent"].add_metric([r.budget, unit], spent)
                families["reserved"].add_metric([r.budget, unit], reserved)
                families["remaining"].add_metric([r.budget, unit], left)
                families["limit"].add_metric([r.budget, unit], limit)
        yield from families.values()


def _counter(name: str, doc: str, labels: list[str], items: Any) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in items:
        family.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return family


class Metrics:
    """The server's metrics on ``registry``. Bind each subsystem that exists."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._llm: _LLMMetrics | None = None
        self._agents: AgentCounters | None = None

    def bind_pump(self, pump: Any, connections: Callable[[], int] | None = None) -> None:
        """Expose the pump's counters, queues and handler latencies (read at scrape time);
        ``connections`` returns the TCP server's open connections, if there is one."""
        self.registry.register(_PumpCollector(pump, connections))

    def bind_router(self, router: Any) -> None:
        """Expose the router's breakers and buckets and count its calls (the router calls
        :meth:`llm_call` through its telemetry)."""
        self.registry.register(_RouterCollector(router))
        if self._llm is None:
            self._llm = _LLMMetrics(self.registry)

    def bind_agents(self, figures: Any = None, agents: tuple[str, ...] = ()) -> AgentCounters:
        """Register the agent metrics; returns their counters (the agents' event bus feeds
        them: :func:`agentserver.agents.events.counting`). ``figures`` (a :class:`~agentserver.agents.store.figures.StoreFigures`) adds the
        inbox lag and pending approvals of ``agents``, from its snapshot."""
        if self._agents is None:
            self._agents = AgentCounters(self.registry)
        if figures is not None:
            self.registry.register(_AgentStoreCollector(figures, agents))
        return self._agents

    def bind_budgets(self, budgets: Any) -> None:
        """Expose the spend budgets (``agentserver_budget_*``)."""
        self.registry.register(_BudgetCollector(budgets))

    def bind_step_log(self, step_log: Any) -> None:
        """Expose the durable step log's buffer (waiting rows, dropped rows)."""
        self.registry.register(_StepLogCollector(step_log))

    def llm_call(
        self,
        *,
        provider: str,
        model: str,
        backend: str | None,
        duration: float,
        completion: Any = None,
        error_type: str | None = None,
    ) -> None:
        llm = self._llm
        if llm is None:
            return
        backend = backend or ""
        status = "error" if error_type else "ok"
        llm.calls.labels(backend, model, status).inc()
        llm.duration.labels("chat", provider, model, error_type or "").observe(duration)
        if completion is None:
            return
        usage = completion.usage
        llm.tokens.labels(backend, model, "input").inc(usage.prompt_tokens)
        llm.tokens.labels(backend, model, "output").inc(usage.completion_tokens)
        llm.token_usage.labels("chat", provider, model, "input").observe(usage.prompt_tokens)
        llm.token_usage.labels("chat", provider, model, "output").observe(usage.completion_tokens)
        if completion.cost:
            llm.cost.labels(backend, model).inc(completion.cost)


class _LLMMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter(
            "agentserver_llm_calls",
            "Model calls through the router, by backend, requested model and status.",
            ["backend", "model", "status"],
            registry=registry,
        )
        self.tokens = Counter(
            "agentserver_llm_tokens",
            "Tokens used, by backend, requested model and direction (input/output).",
            ["backend", "model", "direction"],
            registry=registry,
        )
        self.cost = Counter(
            "agentserver_llm_cost",
            "Cost of model calls (in the unit of boot.xml's prices), by backend and model.",
            ["backend", "model"],
            registry=registry,
        )
        # The GenAI semantic conventions' metrics, with their attributes as labels.
        self.duration = Histogram(
            "gen_ai_client_operation_duration_seconds",
            "gen_ai.client.operation.duration: a model call, retries included.",
            ["gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "error_type"],
            buckets=LLM_DURATION_BUCKETS,
            registry=registry,
        )
        self.token_usage = Histogram(
            "gen_ai_client_token_usage",
            "gen_ai.client.token.usage: tokens per model call, by type (input/output).",
            [
                "gen_ai_operation_name",
                "gen_ai_provider_name",
                "gen_ai_request_model",
                "gen_ai_token_type",
            ],
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )


class AgentCounters:
    """The agents' Prometheus counters (steps, retries, Turns started and ended)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.turns = Counter(
            "agentserver_agent_turns",
            "Agent Turns that ended, by agent and status.",
            ["agent", "status"],
            registry=registry,
        )
        self.steps = Counter(
            "agentserver_agent_steps",
            "Agent steps (model calls within Turns) started, by agent.",
            ["agent"],
            registry=registry,
        )
        self.started = Counter(
            "agentserver_agent_turns_started",
            "Agent Turns that started running (resumptions included), by agent.",
            ["agent"],
            registry=registry,
        )
        self.retries = Counter(
            "agentserver_agent_step_retries",
            "Failed steps the worker retries later, by agent and error kind.",
            ["agent", "kind"],
            registry=registry,
        )

    # One method per thing counted, called by the agents' side: observability sits below
    # the agents and never imports their event types.

    def step_started(self, agent: str) -> None:
        self.steps.labels(agent).inc()

    def step_retrying(self, agent: str, kind: str) -> None:
        self.retries.labels(agent, kind).inc()

    def turn_ended(self, agent: str, status: str) -> None:
        self.turns.labels(agent, status).inc()

    def turn_started(self, agent: str) -> None:
        self.started.labels(agent).inc()


class AccessRefusals:
    """The authorization rule's refusals (:class:`agentserver.core.access.AccessRule`):
    counted by door, route and client, and logged with the same three, never with the
    refused object's id or content (the route is its pattern, e.g.
    ``GET /v1/agents/{name}/tasks/{thread}``). Clients are boot.xml's declared names, so
    the label's values are bounded."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter(
            "agentserver_access_refusals",
            "Requests for another client's object (or an operator's action) the "
            "authorization rule refused, by door, route and client.",
            ["door", "route", "client"],
            registry=registry,
        )

    def refused(self, client: str | None, door: str, route: str) -> None:
        who = client or "anonymous"
        self.counter.labels(door, route, who).inc()
        _access_log.warning(
            "access refused: %s on %s %s",
            who,
            door,
            route,
            extra={FIELDS_ATTRIBUTE: {"client": who, "door": door, "route": route}},
        )
