"""Traces: OpenTelemetry spans, exported over OTLP/HTTP when an endpoint is set.

One call per process turns tracing on, and only if ``OTEL_*`` asks for it (the CLI
makes it for every command)::

    shutdown = tracing.setup("loopmesh-loop-worker")   # no endpoint: does nothing
    try: ...
    finally: shutdown()                                  # flushes what is buffered

and the services use four functions::

    with tracing.span("chat gpt-4o", kind="client", attributes={...}) as span:
        ...                                   # span is None while tracing is off
    tracing.inject(headers)                   # the current span's W3C traceparent
    with tracing.span("invoke_agent", carrier=msg.headers): ...  # continue it
    trace = tracing.current()                 # hand the context to another task ...
    with tracing.attached(trace): ...         # ... and make it current there

With no endpoint nothing of the SDK is imported, no provider is installed, and each of
these is a check of one module global (a span is a shared ``nullcontext``); headers
are not parsed. :func:`forward` is the exception, for a service that passes a
caller's ``traceparent`` on while it does not trace itself: one dict lookup when the
caller sent none.

The variables that decide whether and where to export are read here, through
:mod:`loopmesh.settings` (the one reader of the environment): ``OTEL_SDK_DISABLED``,
``OTEL_TRACES_EXPORTER`` (``otlp`` or ``none``), ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
(used as is), else ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces`` appended),
``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`` (only ``http/protobuf``) and
``OTEL_SERVICE_NAME``. The SDK reads its own tuning variables as the specification
defines them (``OTEL_EXPORTER_OTLP_HEADERS``, ``…_TIMEOUT``, ``…_COMPRESSION``,
``…_CERTIFICATE``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``,
``OTEL_BSP_*``): copying that parsing here would only let the two drift apart.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import re
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import msgspec

from schemas import ToolResult

from .errors import ConfigError
from .settings import environ

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "NO_SPAN",
    "TRACEPARENT",
    "TraceSettings",
    "attached",
    "current",
    "enabled",
    "forward",
    "inject",
    "root_trace_id",
    "setup",
    "span",
    "tool_result",
    "trace_settings",
    "valid_traceparent",
]

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
#: W3C Trace Context, version 00 (and later versions' first four fields).
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[ -~]*)?")
_TRACESTATE = re.compile(r"[ -~]{0,512}")

Kind = Literal["internal", "server", "client", "producer", "consumer"]

#: What :func:`span` gives while tracing is off.
NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()

_tracer: Tracer | None = None
_propagator: Any = None
#: The trace id a root span started now takes (see :func:`span`'s ``root_key``).
_root_trace: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "loopmesh_root_trace", default=None
)


def root_trace_id(key: str) -> int:
    """The trace id of every root span started for ``key``: the first 128 bits of its
    SHA-256, so each process that starts one (each delivery of a turn) lands in the same
    trace."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:16]) or 1


class TraceSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Where spans go: the full OTLP/HTTP traces URL, and the resource's service name."""

    endpoint: str
    service_name: str


def trace_settings(service: str, env: Mapping[str, str] | None = None) -> TraceSettings | None:
    """The export the ``OTEL_*`` variables ask for, or None (tracing off). ``service``
    is the ``service.name`` unless ``OTEL_SERVICE_NAME`` names one. Raises
    :class:`~loopmesh.errors.ConfigError` for what loopmesh cannot honour."""
    if (environ("OTEL_SDK_DISABLED", env) or "").strip().lower() == "true":
        return None
    exporters = [e.strip() for e in (environ("OTEL_TRACES_EXPORTER", env) or "otlp").split(",")]
    if "none" in exporters:
        return None
    if set(exporters) - {"otlp"}:
        raise ConfigError("OTEL_TRACES_EXPORTER", f"{exporters}: only `otlp` or `none`")
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = environ(var, env)
        if protocol is not None:
            if protocol.strip() != "http/protobuf":
                raise ConfigError(var, f"{protocol!r}: loopmesh exports `http/protobuf` only")
            break
    var = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    endpoint = environ(var, env)
    if endpoint is None:
        var = "OTEL_EXPORTER_OTLP_ENDPOINT"
        base = environ(var, env)
        if base is None:
            return None
        endpoint = base.rstrip("/") + "/v1/traces"
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(var, f"{endpoint!r} is not an http:// or https:// URL")
    name = environ("OTEL_SERVICE_NAME", env) or service
    return TraceSettings(endpoint=endpoint.strip(), service_name=name)


def setup(service: str, env: Mapping[str, str] | None = None) -> Callable[[], None]:
    """Install a tracer provider exporting to the ``OTEL_*`` endpoint, if one is set;
    return the function that flushes and shuts it down (a no-op when tracing is off)."""
    global _tracer, _propagator
    settings = trace_settings(service, env)
    if settings is None:
        return _nothing
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as exc:
        raise ConfigError(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            f"tracing needs the OpenTelemetry SDK ({exc.name} is missing): "
            "pip install 'loopmesh[otel]'",
        ) from None
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class KeyedIds(RandomIdGenerator):
        """Random ids, except a root span's trace id while :func:`span` sets one."""

        def generate_trace_id(self) -> int:
            return _root_trace.get() or super().generate_trace_id()

    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: settings.service_name}),
        id_generator=KeyedIds(),
        shutdown_on_exit=False,
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.endpoint)))
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("loopmesh")
    _propagator = TraceContextTextMapPropagator()

    def shutdown() -> None:
        global _tracer
        _tracer = None
        provider.shutdown()

    return shutdown


def _nothing() -> None:
    return None


def enabled() -> bool:
    """Whether this process traces (:func:`setup` found an endpoint)."""
    return _tracer is not None


def span(
    name: str,
    *,
    kind: Kind = "internal",
    attributes: Mapping[str, Any] | None = None,
    carrier: Mapping[str, str] | None = None,
    root_key: str | None = None,
) -> contextlib.AbstractContextManager[Span | None]:
    """A span made current for the block: a child of the ``traceparent`` in ``carrier``
    when given (message or HTTP headers), else of the current span. A root span (the
    carrier has no usable ``traceparent``) with a ``root_key`` takes the trace id
    :func:`root_trace_id` gives it, so the same work started again in any process joins
    the same trace. Yields None while tracing is off. An exception leaving the block
    marks the span as failed."""
    if _tracer is None:
        return NO_SPAN
    return _span(_tracer, name, kind, attributes, carrier, root_key)


@contextlib.contextmanager
def _span(
    tracer: Tracer,
    name: str,
    kind: Kind,
    attributes: Mapping[str, Any] | None,
    carrier: Mapping[str, str] | None,
    root_key: str | None,
) -> Iterator[Span]:
    from opentelemetry.trace import SpanKind

    context = None
    if carrier is not None:
        context = _propagator.extract(carrier)  # a malformed traceparent is ignored
    started = tracer.start_as_current_span(
        name, context=context, kind=SpanKind[kind.upper()], attributes=attributes
    )
    with contextlib.ExitStack() as stack:
        token = _root_trace.set(root_trace_id(root_key) if root_key is not None else None)
        try:
            current_span = stack.enter_context(started)  # the span is made here
        finally:
            _root_trace.reset(token)
        yield current_span


def tool_result(span: Span | None, result: ToolResult) -> None:
    """Mark an ``execute_tool`` span whose call did not succeed (``error.type`` is the
    result's error code); both sides of a call use this."""
    if span is None or result.status == "ok":
        return
    from opentelemetry.trace import Status, StatusCode

    error = result.error
    span.set_attribute("error.type", error.code if error is not None else result.status)
    span.set_status(Status(StatusCode.ERROR, error.message if error else result.status))


def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current span's ``traceparent`` (and ``tracestate``) to ``headers``."""
    if _tracer is not None:
        _propagator.inject(headers)


def forward(incoming: Mapping[str, str]) -> dict[str, str]:
    """The trace headers to send on: the current span's while tracing is on, else the
    caller's ``traceparent`` and ``tracestate`` when they are well formed (a service
    that does not trace keeps its caller's trace whole)."""
    out: dict[str, str] = {}
    if _tracer is not None:
        _propagator.inject(out)
        return out
    parent = incoming.get(TRACEPARENT)
    if parent is not None and valid_traceparent(parent):
        out[TRACEPARENT] = parent
        state = incoming.get(TRACESTATE)
        if state is not None and _TRACESTATE.fullmatch(state):
            out[TRACESTATE] = state
    return out


def valid_traceparent(value: str) -> bool:
    """Whether ``value`` is a W3C ``traceparent`` a tracer would accept: lowercase hex
    fields, not version ``ff``, and neither id all zeros."""
    if not _TRACEPARENT.fullmatch(value):
        return False
    version, trace_id, span_id = value[:2], value[3:35], value[36:52]
    return version != "ff" and trace_id != "0" * 32 and span_id != "0" * 16


def current() -> object | None:
    """The current trace context, to carry to another task (None while off)."""
    if _tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


def attached(trace_context: object | None) -> contextlib.AbstractContextManager[None]:
    """Make a context from :func:`current` the current one for the block."""
    if trace_context is None:
        return NO_SPAN
    return _attached(trace_context)


@contextlib.contextmanager
def _attached(trace_context: object) -> Iterator[None]:
    from opentelemetry import context

    token = context.attach(trace_context)  # type: ignore[arg-type]
    try:
        yield
    finally:
        context.detach(token)
