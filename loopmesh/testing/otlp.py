"""A real OTLP/HTTP traces receiver on loopback, for tests and the bench.

It accepts ``POST /v1/traces`` with a protobuf ``ExportTraceServiceRequest`` (gzip or
not), as the OpenTelemetry SDK's ``OTLPSpanExporter`` sends it, decodes it with
``opentelemetry-proto`` and keeps every span with its resource's ``service.name``::

    with OtlpReceiver() as otlp:       # env: OTEL_EXPORTER_OTLP_ENDPOINT=otlp.url
        ...
        spans = await otlp.wait(lambda spans: len(spans) >= 3, timeout=60)

It runs in a thread, so a service in the test's own process can export to it too.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

KINDS = {
    ProtoSpan.SPAN_KIND_INTERNAL: "internal",
    ProtoSpan.SPAN_KIND_SERVER: "server",
    ProtoSpan.SPAN_KIND_CLIENT: "client",
    ProtoSpan.SPAN_KIND_PRODUCER: "producer",
    ProtoSpan.SPAN_KIND_CONSUMER: "consumer",
}


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, ids as lowercase hex (``parent_id`` empty for a root)."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any] = field(default_factory=dict)
    status_code: int = 0


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest``."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        service=service,
                        name=s.name,
                        kind=KINDS.get(s.kind, "unspecified"),
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        status_code=s.status.code,
                    )
                )
    return out


class OtlpReceiver:
    """``url`` is the base to give as ``OTEL_EXPORTER_OTLP_ENDPOINT``."""

    def __init__(self) -> None:
        self._bodies: list[bytes] = []
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                with receiver._lock:  # decoded when read: the handler stays cheap
                    receiver._bodies.append(body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def received(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._lock:
            bodies, self._bodies = self._bodies, []
        for body in bodies:
            self._spans.extend(decode(body))
        return list(self._spans)

    async def wait(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 60.0
    ) -> list[ReceivedSpan]:
        """The spans received, once ``done`` holds for them; AssertionError after
        ``timeout`` seconds, listing what did arrive."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.received()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                seen = [(s.service, s.name, s.kind) for s in spans]
                raise AssertionError(f"spans still missing after {timeout}s; received {seen}")
            await asyncio.sleep(0.05)
