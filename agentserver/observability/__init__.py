"""Observability: OpenTelemetry traces, Prometheus metrics, structured logs.

The composition root (:mod:`agentserver.app.root`) builds one :class:`Tracing` and one
:class:`Metrics` per server and hands them to the subsystems; nothing here is global.
See docs/operations.md for the span, metric and log field lists.
"""

from agentserver.observability.logs import configure_logging
from agentserver.observability.metrics import Metrics
from agentserver.observability.telemetry import LLMTelemetry
from agentserver.observability.tracing import Tracing

__all__ = ["LLMTelemetry", "Metrics", "Tracing", "configure_logging"]
