"""Logs, traces and metrics (docs/architecture.md, "Observability").

* structlog JSON logs; every line carries the bound ``request_id`` and the current
  OpenTelemetry ``trace_id``/``span_id``.
* One tracer provider per process; W3C trace context rides in NATS headers
  (:func:`inject`, :func:`extract`) and, for durable events, as a ``traceparent`` string
  (:func:`current_traceparent`, :func:`context_from_traceparent`).
* Server spans (:func:`server_span`) are built only in a process that exports spans
  (an OTLP endpoint is set, or :func:`export_spans` was called). Elsewhere the caller's
  context is carried through unchanged: logs keep the trace id, downstream services see
  the caller's span as their parent, and a lookup does not pay ~20 µs for a span no one
  will ever read.
* One meter provider per process, exported for Prometheus when a port is configured
  (its own HTTP server) or asked for (``prometheus_reader``: the process serves
  ``prometheus_client.generate_latest()`` itself, as the gateway's ``/metrics``).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cpd.ops.config import TelemetrySettings
from cpd.protocol.errors import ConfigError

_propagator = TraceContextTextMapPropagator()
_configured: str | None = None
_provider: TracerProvider | None = None  # this process's SDK provider, once there is one
_exporting = False  # whether any span processor will read spans built here


def setup(service: str, settings: TelemetrySettings | None = None, *,
          prometheus_reader: bool = False, log_file: str | os.PathLike[str] | None = None
          ) -> None:
    """Configure logging, tracing and metrics for this process (idempotent). Logs go to
    standard error, or appended to ``log_file`` (a terminal that shows something else).

    Metrics go to prometheus_client's default registry when ``settings.prometheus_port``
    is set (served on that port) or ``prometheus_reader`` is true (no server started: the
    process exposes ``prometheus_client.generate_latest()`` itself).
    """
    global _configured
    settings = settings or TelemetrySettings()
    _configure_logging(service, settings, log_file)
    if _configured is not None:
        return
    _configured = service
    resource = Resource.create({"service.name": f"cpd-{service}"})
    _install_provider(TracerProvider(resource=resource))
    if settings.otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        except ImportError as e:
            raise ConfigError("telemetry.otlp_endpoint needs the OTLP exporter: install "
                              "the otlp extra (pip install 'cpd[otlp]')") from e
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        export_spans(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    readers = []
    if settings.prometheus_port or prometheus_reader:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        if settings.prometheus_port:
            from prometheus_client import start_http_server

            start_http_server(settings.prometheus_port)
        readers.append(PrometheusMetricReader())
    from opentelemetry.sdk.metrics import MeterProvider

    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))


def _install_provider(provider: TracerProvider) -> TracerProvider:
    """Make ``provider`` this process's tracer provider unless one was installed first
    (OpenTelemetry allows only one per process)."""
    global _provider
    if _provider is None:
        _provider = provider
        trace.set_tracer_provider(provider)
    return _provider


def export_spans(processor: SpanProcessor) -> None:
    """Send this process's spans to ``processor`` (an exporter's, or a test's in-memory
    one) and from now on build a server span for every request handled."""
    global _exporting
    (_provider or _install_provider(TracerProvider())).add_span_processor(processor)
    _exporting = True


class _ServerSpan:
    """:func:`server_span`'s context manager: a class, not a generator, because it wraps
    every request a service handles (a generator-based one cost ~3 µs a lookup)."""

    __slots__ = ("_attributes", "_headers", "_name", "_span_cm", "_token")

    def __init__(self, name: str, headers: Mapping[str, str] | None,
                 attributes: Mapping[str, str]) -> None:
        self._name = name
        self._headers = headers
        self._attributes = attributes
        self._span_cm: Any = None
        self._token: object | None = None

    def __enter__(self) -> trace.Span:
        ctx = extract(self._headers) if self._headers else otel_context.Context()
        if _exporting:
            self._span_cm = tracer().start_as_current_span(
                self._name, context=ctx, kind=SpanKind.SERVER, attributes=self._attributes)
            return self._span_cm.__enter__()
        if ctx or otel_context.get_current():
            self._token = otel_context.attach(ctx)
        # else: no caller context and none current - nothing to make current.
        return trace.get_current_span()

    def __exit__(self, *exc: Any) -> None:
        if self._span_cm is not None:
            self._span_cm.__exit__(*exc)
        elif self._token is not None:
            otel_context.detach(self._token)


def server_span(name: str, headers: Mapping[str, str] | None,
                attributes: Mapping[str, str]) -> _ServerSpan:
    """The current span while a request received with ``headers`` is handled: a new
    SERVER span, child of the caller's, when spans are exported; otherwise the caller's
    own context (a non-recording span: status and events set on it are dropped)."""
    return _ServerSpan(name, headers, attributes)


def _configure_logging(service: str, settings: TelemetrySettings,
                       log_file: str | os.PathLike[str] | None = None) -> None:
    level = logging.getLevelNamesMapping()[settings.log_level.upper()]
    renderer: Any = (structlog.processors.JSONRenderer() if settings.log_json
                     else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_service(service),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(
            file=sys.stderr if log_file is None else open(log_file, "a", buffering=1)),  # noqa: SIM115
        cache_logger_on_first_use=False,
    )


def _add_service(service: str) -> Any:
    def processor(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event.setdefault("service", service)
        return event

    return processor


def _add_trace_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


def get_logger(name: str | None = None, **bound: Any) -> structlog.stdlib.BoundLogger:
    """A structlog logger, optionally with bound key/values."""
    return structlog.get_logger(name).bind(**bound) if bound else structlog.get_logger(name)


@functools.cache
def tracer(name: str = "cpd") -> trace.Tracer:
    """The process tracer (cached: the SDK's get_tracer is costly on hot paths; a tracer
    fetched before :func:`setup` is a proxy that follows the provider set later)."""
    return trace.get_tracer(name)


def meter(name: str = "cpd") -> metrics.Meter:
    """The process meter."""
    return metrics.get_meter(name)


class _Bound:
    __slots__ = ("_tokens", "_values")

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values
        self._tokens: Mapping[str, Any] | None = None

    def __enter__(self) -> None:
        if self._values:
            self._tokens = structlog.contextvars.bind_contextvars(**self._values)

    def __exit__(self, *exc: Any) -> None:
        if self._tokens:
            structlog.contextvars.reset_contextvars(**self._tokens)


def bound_request(request_id: str, **extra: Any) -> _Bound:
    """Bind ``request_id`` (and extras) to every log line in this context; an empty
    ``request_id`` with no extras binds nothing (a class, not a generator: it wraps
    every request a service handles)."""
    return _Bound({"request_id": request_id, **extra} if request_id or extra else {})


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Add the current W3C trace context (``traceparent``) to NATS headers."""
    headers = {} if headers is None else headers
    _propagator.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context carried by NATS headers (an empty context when absent)."""
    return _propagator.extract(dict(headers or {}))


def current_traceparent() -> str:
    """The current ``traceparent`` string, for durable records (events)."""
    return inject({}).get("traceparent", "")


def context_from_traceparent(value: str) -> otel_context.Context:
    """Rebuild a context from a stored ``traceparent`` string."""
    return _propagator.extract({"traceparent": value} if value else {})
