"""A tool worker's own metrics (the process registry, served at its ``/metrics``).

The exporter counts tool calls from events (by tool and server); only the worker knows
its pool, so calls by pool, and calls in flight, are counted here.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from loopmesh.exporter import LATENCY_BUCKETS

CALLS = Counter(
    "loopmesh_tool_worker_calls",
    "Tool calls run by this worker, by tool, server, pool and status (ok, error, timeout)",
    ["gen_ai_tool_name", "server", "pool", "status"],
)
DURATION = Histogram(
    "loopmesh_tool_worker_call_duration_seconds",
    "Tool call duration measured by the worker that ran it",
    ["gen_ai_tool_name", "server", "pool"],
    buckets=LATENCY_BUCKETS,
)
IN_FLIGHT = Gauge("loopmesh_tool_calls_in_flight", "Tool calls running in this worker", ["pool"])
