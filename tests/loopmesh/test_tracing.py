"""loopmesh.tracing: which OTEL_* variables turn tracing on, and what is refused; the
caller's traceparent passed on while this process does not trace."""

from __future__ import annotations

import pytest

from loopmesh import tracing
from loopmesh.errors import ConfigError

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_no_endpoint_means_tracing_is_off():
    assert tracing.trace_settings("svc", {}) is None
    assert tracing.trace_settings("svc", {"OTEL_SERVICE_NAME": "x"}) is None
    stop = tracing.setup("svc", {})
    stop()
    assert not tracing.enabled()


def test_the_base_endpoint_gets_the_traces_path_and_the_traces_endpoint_is_used_as_is():
    base = tracing.trace_settings("svc", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"})
    assert base == tracing.TraceSettings(endpoint="http://c:4318/v1/traces", service_name="svc")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://t.example/otlp/traces",
        "OTEL_SERVICE_NAME": "agents",
    }
    assert tracing.trace_settings("svc", env) == tracing.TraceSettings(
        endpoint="https://t.example/otlp/traces", service_name="agents"
    )


@pytest.mark.parametrize(
    "extra",
    [
        {"OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_SDK_DISABLED": "true"},
        {"OTEL_SDK_DISABLED": "TRUE"},
    ],
)
def test_an_exporter_of_none_or_a_disabled_sdk_turns_tracing_off(extra):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", **extra}
    assert tracing.trace_settings("svc", env) is None


@pytest.mark.parametrize(
    ("extra", "var"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "ftp://c/x"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
    ],
)
def test_what_loopmesh_cannot_honour_is_refused_naming_the_variable(extra, var):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", **extra}
    with pytest.raises(ConfigError) as caught:
        tracing.trace_settings("svc", env)
    assert caught.value.source == var


def test_while_off_a_well_formed_traceparent_is_passed_on_and_a_bad_one_dropped():
    assert not tracing.enabled()
    assert tracing.forward({}) == {}
    assert tracing.forward({"traceparent": PARENT, "tracestate": "a=1"}) == {
        "traceparent": PARENT,
        "tracestate": "a=1",
    }
    for bad in (
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero span id
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # version ff
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # uppercase
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nX: y",
    ):
        assert tracing.forward({"traceparent": bad, "tracestate": "a=1"}) == {}, bad
    assert tracing.forward({"traceparent": PARENT, "tracestate": "a=1\n"}) == {
        "traceparent": PARENT
    }
