"""The HTTP API's own figures in the server's Prometheus registry (read when scraped)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agentserver.http.gateway import HttpGateway


class HttpCollector(Collector):
    def __init__(self, gateway: HttpGateway) -> None:
        self.gateway = gateway

    def collect(self) -> Iterator[Metric]:
        gateway = self.gateway
        yield GaugeMetricFamily(
            "agentserver_http_pending_messages",
            "Messages sent over HTTP holding an endpoint (waiting, or kept for GET /v1/threads)",
            value=gateway.active,
        )
        messages = CounterMetricFamily(
            "agentserver_http_messages",
            "Messages sent over HTTP, by what became of them before the pump",
            labels=["outcome"],
        )
        counters = gateway.counters
        messages.add_metric(["received"], counters["messages"])
        messages.add_metric(["refused"], counters["refused"])
        messages.add_metric(["busy"], counters["busy"])
        messages.add_metric(["timeout"], counters["timeouts"])
        yield messages
