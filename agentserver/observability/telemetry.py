"""What the LLM router reports per call: a ``chat`` span and the GenAI metrics."""

from __future__ import annotations

import time
from typing import Any

import trio

from agentserver.observability.metrics import Metrics
from agentserver.observability.tracing import Tracing, record_error


class LLMCall:
    """One model call in progress (see :meth:`LLMTelemetry.start`)."""

    __slots__ = ("model", "span", "started", "telemetry")

    def __init__(self, telemetry: LLMTelemetry, model: str, span: Any) -> None:
        self.telemetry = telemetry
        self.model = model
        self.span = span
        self.started = time.perf_counter()

    def succeeded(self, completion: Any) -> None:
        t = self.telemetry
        provider = t.providers.get(completion.backend, "")
        if self.span is not None:
            t.tracing.end_chat(self.span, completion, provider)
        if t.metrics is not None:
            t.metrics.llm_call(
                provider=provider,
                model=self.model,
                backend=completion.backend,
                duration=time.perf_counter() - self.started,
                completion=completion,
            )

    def failed(self, exc: BaseException | None) -> None:
        """The call raised ``exc`` (its ``kind`` is the error type), or was abandoned
        (None: a stream closed or cancelled before its end)."""
        t = self.telemetry
        if exc is None or isinstance(exc, trio.Cancelled):
            kind = "cancelled"
        else:
            kind = getattr(getattr(exc, "kind", None), "value", None) or type(exc).__name__
        backend = getattr(exc, "backend", None)
        provider = t.providers.get(backend or "", "")
        if self.span is not None:
            record_error(self.span, kind)
            if provider:
                self.span.set_attribute("gen_ai.provider.name", provider)
            self.span.end()
        if t.metrics is not None:
            t.metrics.llm_call(
                provider=provider,
                model=self.model,
                backend=backend,
                duration=time.perf_counter() - self.started,
                error_type=kind,
            )


class LLMTelemetry:
    """Given to the router; ``providers`` maps a backend name to its provider
    (``gen_ai.provider.name``: openai, anthropic, ...)."""

    def __init__(
        self, tracing: Tracing, metrics: Metrics | None, providers: dict[str, str]
    ) -> None:
        self.tracing = tracing
        self.metrics = metrics
        self.providers = providers

    def start(self, request: Any) -> LLMCall:
        span = None
        if self.tracing.enabled:
            span = self.tracing.start_chat(request.model, request.agent, request.messages)
        return LLMCall(self, request.model, span)
