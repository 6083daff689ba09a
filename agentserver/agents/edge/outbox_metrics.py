"""The outbox's figures (agents/edge/outbox.py) in the server's Prometheus registry: the
sender's counters and its last read of the store's per-channel state (docs/webhooks.md)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agentserver.agents.edge.outbox import Outbox


class OutboxCollector(Collector):
    """The outbox's figures in the server's Prometheus registry (read when scraped,
    from the sender's counters and its last read of the store: never waits)."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    def collect(self) -> Iterator[Metric]:
        figures = self.outbox.figures
        attempts = CounterMetricFamily(
            "agentserver_outbox_attempts",
            "Delivery attempts from the outbox in this process, by outcome",
            labels=["outcome"],
        )
        attempts.add_metric(["delivered"], figures.delivered)
        attempts.add_metric(["failed"], figures.failed)
        attempts.add_metric(["expired"], figures.expired)
        yield attempts
        failures = CounterMetricFamily(
            "agentserver_outbox_channel_failures",
            "Failed delivery attempts in this process, by channel (webhook:NAME)",
            labels=["channel"],
        )
        for channel, n in sorted(figures.failures.items()):
            failures.add_metric([channel], n)
        yield failures
        pending = GaugeMetricFamily(
            "agentserver_outbox_pending",
            "Deliveries waiting in the outbox, by channel (as last read, every 5 s)",
            labels=["channel"],
        )
        failing = GaugeMetricFamily(
            "agentserver_outbox_failing",
            "1 while a channel's last attempts failed (no delivery since its first failure)",
            labels=["channel"],
        )
        disabled = GaugeMetricFamily(
            "agentserver_outbox_disabled",
            "1 when a channel was disabled for failing too long",
            labels=["channel"],
        )
        for f in self.outbox.channel_figures:
            pending.add_metric([f.channel], f.pending)
            failing.add_metric([f.channel], 1 if f.failing_since is not None else 0)
            disabled.add_metric([f.channel], 1 if f.disabled_at is not None else 0)
        yield pending
        yield failing
        yield disabled
