"""OpenTelemetry traces: GenAI span names and attributes, one trace per message chain.

Only ``opentelemetry-api`` is imported here; the SDK (``pip install agentserver[otel]``)
is needed to record anything. A :class:`Tracing` built without a provider is off: the pump
then checks one attribute per delivery and never calls into OpenTelemetry.

Spans (see docs/operations.md):

- ``handle {listener}``: one handler call. For a client's message (kind SERVER) it is the
  root of the chain's trace; otherwise (CONSUMER) its parent is the span that sent the
  message (another ``handle`` span, or an agent's span). One span per message: a span
  costs about half of a whole echo delivery, so the pump adds no other.
- ``invoke_agent {agent}``: an agent running its Turn (one span per run: a Turn suspended
  on tool calls continues in a new ``invoke_agent`` span of the same trace when the
  results are in). The trace context travels with the task's durable reply reference,
  so a Turn resumed after a restart still joins its request's trace.
- ``chat {model}`` (CLIENT): one model call through the LLM router.
- ``execute_tool {listener}``: an agent's tool call being dispatched; the tool's own
  ``handle`` span is its child.
- A remote listener's job carries its ``handle`` span as a ``traceparent`` attribute of
  the job envelope (docs/wire.md); ``agentserver.remote.runner`` continues it in the runner.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from contextvars import Token
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

#: Set to ``true`` to record message contents (payloads, prompts, completions) on spans.
CAPTURE_CONTENT_ENV = "AGENTSERVER_TRACE_CONTENT"
#: Any of these switches tracing on (with the SDK installed), as the OTel SDK defines them.
_ENABLING_ENV = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_TRACES_EXPORTER",
)
#: Longest message content recorded on a span (characters), when content is opted in.
MAX_CONTENT_CHARS = 8192

_PROPAGATOR = TraceContextTextMapPropagator()
#: An empty context: a span started in it begins a new trace.
_ROOT = otel_context.Context()


class Tracing:
    """The server's tracer. ``Tracing()`` is off; ``Tracing(provider)`` records through
    ``provider`` (an SDK ``TracerProvider``). Built by the composition root
    (:meth:`from_environ`) and handed to the pump, the agents and the router."""

    def __init__(self, provider: Any | None = None, *, capture_content: bool = False) -> None:
        self.provider = provider
        self.enabled = provider is not None
        self.capture_content = capture_content and self.enabled
        self.tracer: trace.Tracer = (
            provider.get_tracer("agentserver") if provider is not None else trace.NoOpTracer()
        )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Tracing:
        """On when an ``OTEL_*`` exporter variable is set (and ``OTEL_SDK_DISABLED`` is
        not true) and the SDK is installed; exports with OTLP (HTTP/protobuf) by default,
        or with what ``OTEL_TRACES_EXPORTER`` names (``otlp``, ``console``, ``none``)."""
        capture = environ.get(CAPTURE_CONTENT_ENV, "").strip().lower() in ("1", "true", "yes")
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls()
        if not any(environ.get(name) for name in _ENABLING_ENV):
            return cls()
        exporter_name = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
        if exporter_name == "none":
            return cls()
        try:
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import (
                BatchSpanProcessor,
                ConsoleSpanExporter,
                SpanExporter,
            )
        except ImportError:
            log.warning(
                "OTEL_* variables are set but the OpenTelemetry SDK is not installed "
                "(pip install 'agentserver[otel]'): tracing is off"
            )
            return cls()
        exporter: SpanExporter
        if exporter_name == "console":
            exporter = ConsoleSpanExporter()
        else:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError:
                log.warning("the OTLP exporter is not installed: tracing is off")
                return cls()
            protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            if protocol != "http/protobuf":
                log.warning(
                    "OTLP protocol %s is not supported: exporting with http/protobuf", protocol
                )
            endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            if not endpoint and environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
                endpoint = environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
            # The endpoint from ``environ`` (the server's); headers, timeout, compression
            # and certificates the exporter reads from the process environment itself.
            exporter = OTLPSpanExporter(endpoint=endpoint or None)
        service = environ.get("OTEL_SERVICE_NAME") or "agentserver"
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("tracing on: exporting spans with %s", exporter_name)
        return cls(provider, capture_content=capture)

    def shutdown(self) -> None:
        """Flush and stop the provider's exporters (the server calls it on exit)."""
        if self.provider is not None and hasattr(self.provider, "shutdown"):
            self.provider.shutdown()

    # -- the pump (called only when enabled) -----------------------------------------------

    def start_handle(
        self, listener: str, parent: Span | None, sender: str, thread_id: str, from_client: bool
    ) -> Span:
        """The span of one handler call. A client's message has no parent span: its
        ``handle`` span (kind SERVER) is the root of the chain's trace."""
        if from_client or parent is None:
            ctx, kind = _ROOT, SpanKind.SERVER
        else:
            ctx, kind = trace.set_span_in_context(parent), SpanKind.CONSUMER
        # Attributes given at the start: one pass instead of a locked call per attribute.
        return self.tracer.start_span(
            f"handle {listener}",
            context=ctx,
            kind=kind,
            attributes={
                "agentserver.listener": listener,
                "agentserver.sender": sender,
                "agentserver.thread.id": thread_id,
            },
        )

    current_span = staticmethod(trace.get_current_span)

    # -- agents --------------------------------------------------------------------------

    def traceparent(self) -> str | None:
        """The current span as a W3C ``traceparent`` (stored with a task, so its Turn
        joins the trace even after a restart); None when off or outside any span."""
        if not self.enabled:
            return None
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return carrier.get("traceparent")

    @contextlib.contextmanager
    def invoke_agent(
        self, agent: str, turn_id: str, conversation: str | None, traceparent: str | None
    ) -> Iterator[Span]:
        if not self.enabled:
            yield trace.INVALID_SPAN
            return
        ctx = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else _ROOT
        attributes = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": agent,
            "gen_ai.agent.id": turn_id,
        }
        if conversation:
            attributes["gen_ai.conversation.id"] = conversation
        # Attributes given at the start: the SDK cleans them in one pass, where each
        # set_attribute call takes the span's lock and cleans its value on its own.
        with self.tracer.start_as_current_span(
            f"invoke_agent {agent}", context=ctx, kind=SpanKind.INTERNAL, attributes=attributes
        ) as span:
            yield span

    @contextlib.contextmanager
    def execute_tool(self, listener: str, content: str | None = None) -> Iterator[Span]:
        if not self.enabled:
            yield trace.INVALID_SPAN
            return
        attributes = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": listener}
        if self.capture_content and content is not None:
            attributes["gen_ai.tool.call.arguments"] = content[:MAX_CONTENT_CHARS]
        with self.tracer.start_as_current_span(
            f"execute_tool {listener}", kind=SpanKind.INTERNAL, attributes=attributes
        ) as span:
            yield span

    def start_chat(self, model: str, agent: str, messages: Any = None) -> Span:
        """A ``chat`` span, child of the current span; not made current (a stream's span
        outlives the frame that opened it). End it with :meth:`end_chat`."""
        attributes = {"gen_ai.operation.name": "chat", "gen_ai.request.model": model}
        if agent:
            attributes["gen_ai.agent.name"] = agent
        span = self.tracer.start_span(f"chat {model}", kind=SpanKind.CLIENT, attributes=attributes)
        # The prompt is formatted only for a span that records (a sampled-out one drops it).
        if self.capture_content and messages is not None and span.is_recording():
            span.set_attribute(
                "gen_ai.input.messages",
                "\n".join(f"{m.role}: {m.content}" for m in messages)[:MAX_CONTENT_CHARS],
            )
        return span

    def end_chat(self, span: Span, completion: Any = None, provider: str | None = None) -> None:
        if span.is_recording() and completion is not None:
            if provider:
                span.set_attribute("gen_ai.provider.name", provider)
            span.set_attribute("agentserver.llm.backend", completion.backend)
            span.set_attribute("gen_ai.response.model", completion.model)
            span.set_attribute("gen_ai.usage.input_tokens", completion.usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", completion.usage.completion_tokens)
            if completion.finish_reason:
                span.set_attribute("gen_ai.response.finish_reasons", [completion.finish_reason])
            if self.capture_content:
                span.set_attribute("gen_ai.output.messages", completion.content[:MAX_CONTENT_CHARS])
        span.end()


def current_traceparent() -> str | None:
    """The current span as a W3C ``traceparent`` value, for a message leaving the process
    (a remote runner's job); None when there is no valid span (tracing off: one check)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def context_of(traceparent: str | None) -> otel_context.Context:
    """The context a span continuing ``traceparent`` starts in (a new trace if None or
    malformed: the propagator ignores what does not parse)."""
    return _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else _ROOT


def annotate_current(attributes: Mapping[str, str | int | float]) -> None:
    """Add ``attributes`` to the current span, if one is recording (tracing off: one
    check)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(dict(attributes))


def record_error(span: Span, kind: str) -> None:
    """Mark ``span`` failed with ``error.type`` ``kind`` (an exception's class name, or a
    typed error's kind)."""
    if span.is_recording():
        span.set_attribute("error.type", kind)
        span.set_status(Status(StatusCode.ERROR, kind))


def attach(span: Span) -> Token[otel_context.Context]:
    """Make ``span`` current in this task's context; returns the token for :func:`detach`."""
    return otel_context.attach(trace.set_span_in_context(span))


def detach(token: Token[otel_context.Context]) -> None:
    otel_context.detach(token)
