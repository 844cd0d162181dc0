"""Generate loopmesh's Grafana dashboards (JSON in this folder) with grafana-foundation-sdk.

    python k8s/grafana/generate.py          # rewrite the JSON files
    python k8s/grafana/generate.py --check  # exit 1 if a committed file is stale

Every PromQL query uses metrics that loopmesh exports (docs/OBSERVABILITY.md), except
``kube_*`` series, which come from kube-state-metrics. ``$__rate_interval`` is Grafana's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

HERE = Path(__file__).resolve().parent
PROM = DataSourceRef(type_val="prometheus", uid="${datasource}")
INFINITY = DataSourceRef(type_val="yesoreyeram-infinity-datasource", uid="${infinity}")
RATE = "$__rate_interval"


class InfinityQuery(cogvariants.Dataquery):
    """A query of the Infinity datasource (the SDK has no builder for this plugin)."""

    def __init__(self, url: str, ref_id: str = "A") -> None:
        self.url = url
        self.ref_id = ref_id

    def to_json(self) -> dict[str, object]:
        return {
            "refId": self.ref_id,
            "datasource": INFINITY.to_json(),
            "type": "json",
            "source": "url",
            "format": "table",
            "parser": "backend",
            "url": self.url,
            "url_options": {"method": "GET", "data": ""},
            "root_selector": "",
            "columns": [
                {"selector": "seq", "text": "seq", "type": "number"},
                {"selector": "ts", "text": "time", "type": "timestamp_epoch_s"},
                {"selector": "type", "text": "type", "type": "string"},
                {"selector": "session", "text": "session", "type": "string"},
                {"selector": "turn_id", "text": "turn", "type": "string"},
                {"selector": "iteration", "text": "iteration", "type": "number"},
                {"selector": "tool", "text": "tool", "type": "string"},
                {"selector": "reason", "text": "reason", "type": "string"},
                {"selector": "code", "text": "code", "type": "string"},
            ],
        }


class Infinity(cogbuilder.Builder[InfinityQuery]):
    def __init__(self, url: str) -> None:
        self._internal = InfinityQuery(url)

    def build(self) -> InfinityQuery:
        return self._internal


def q(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref)


def p(quantile: float, metric: str, by: str) -> str:
    return f"histogram_quantile({quantile}, sum by (le, {by}) (rate({metric}_bucket[{RATE}])))"


def ts(title: str, unit: str, *queries: prometheus.Dataquery, w: int = 12) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).datasource(PROM).unit(unit).span(w).height(8)
    for query in queries:
        panel = panel.with_target(query)
    return panel


def variables(builder: dashboard.Dashboard, infinity: bool = False) -> dashboard.Dashboard:
    builder = builder.with_variable(
        dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    )
    if infinity:
        builder = builder.with_variable(
            dashboard.DatasourceVariable("infinity")
            .label("Infinity")
            .type("yesoreyeram-infinity-datasource")
        )
    return builder


def agent_overview() -> dashboard.Dashboard:
    d = dashboard.Dashboard("loopmesh: Agent overview").uid("loopmesh-agents")
    d = variables(d.tags(["loopmesh"]).refresh("30s").time("now-1h", "now"))
    return (
        d.with_row(dashboard.Row("Turns"))
        .with_panel(
            ts(
                "Turns by outcome (loop_end reason)",
                "ops",
                q(f"sum by (outcome) (rate(loopmesh_turns_total[{RATE}]))", "{{outcome}}"),
            )
        )
        .with_panel(
            ts(
                "Turns by tenant",
                "ops",
                q(f"sum by (tenant) (rate(loopmesh_turns_total[{RATE}]))", "{{tenant}}"),
            )
        )
        .with_panel(
            ts(
                "Iterations per turn",
                "short",
                q(p(0.5, "loopmesh_turn_iterations", "job"), "p50", "A"),
                q(p(0.95, "loopmesh_turn_iterations", "job"), "p95", "B"),
            )
        )
        .with_panel(
            ts(
                "In flight: turns and tool calls",
                "short",
                q("sum(loopmesh_loop_turns_active)", "turns", "A"),
                q("sum(loopmesh_tool_calls_in_flight)", "tool calls", "B"),
            )
        )
        .with_panel(
            ts(
                "Turns waiting per tenant",
                "short",
                q("sum by (tenant) (loopmesh_turns_waiting)", "waiting {{tenant}}", "A"),
                q("sum by (tenant) (loopmesh_turns_backlog)", "backlog {{tenant}}", "B"),
            )
        )
        .with_panel(
            ts(
                "Turns backlog and loop-worker replicas",
                "short",
                q("sum(loopmesh_turns_backlog_total)", "backlog, all tenants", "A"),
                q(
                    'sum(kube_deployment_status_replicas_available{deployment="loop-worker"})',
                    "replicas",
                    "B",
                ),
            )
        )
        .with_row(dashboard.Row("Durability"))
        .with_panel(
            ts(
                "Redeliveries and resumes",
                "ops",
                q(
                    f"sum(rate(loopmesh_loop_turn_redeliveries_total[{RATE}]))",
                    "turns delivered again",
                    "A",
                ),
                q(
                    f"sum(rate(loopmesh_turn_resumes_total[{RATE}]))",
                    "turns resumed from a checkpoint",
                    "B",
                ),
            )
        )
        .with_panel(
            ts(
                "Session leases: held and conflicts",
                "short",
                q("sum(loopmesh_leases_held)", "held", "A"),
                q(
                    f"sum(increase(loopmesh_lease_conflicts_total[{RATE}]))",
                    "conflicts (refused: another worker held the session)",
                    "B",
                ),
            )
        )
        .with_row(dashboard.Row("LLM"))
        .with_panel(
            ts(
                "LLM latency by model (p50, p95)",
                "s",
                q(
                    p(0.5, "gen_ai_client_operation_duration_seconds", "gen_ai_request_model"),
                    "p50 {{gen_ai_request_model}}",
                    "A",
                ),
                q(
                    p(0.95, "gen_ai_client_operation_duration_seconds", "gen_ai_request_model"),
                    "p95 {{gen_ai_request_model}}",
                    "B",
                ),
            )
        )
        .with_panel(
            ts(
                "Time to first chunk by model (p95)",
                "s",
                q(
                    p(
                        0.95,
                        "gen_ai_client_operation_time_to_first_chunk_seconds",
                        "gen_ai_request_model",
                    ),
                    "{{gen_ai_request_model}}",
                ),
            )
        )
        .with_panel(
            ts(
                "Output tokens per second by model",
                "short",
                q(
                    "sum by (gen_ai_request_model) (rate(gen_ai_client_token_usage_sum"
                    f'{{gen_ai_token_type="output"}}[{RATE}]))',
                    "{{gen_ai_request_model}}",
                ),
            )
        )
        .with_panel(
            ts(
                "Retries and fallbacks",
                "ops",
                q(f"sum by (what) (rate(loopmesh_retries_total[{RATE}]))", "retry {{what}}", "A"),
                q(
                    f"sum by (gen_ai_request_model) (rate(loopmesh_llm_fallbacks_total[{RATE}]))",
                    "fallback to {{gen_ai_request_model}}",
                    "B",
                ),
            )
        )
        .with_row(dashboard.Row("LLM rate limits ([llm.limits])"))
        .with_panel(
            ts(
                "Wait for the rate limits by model (p50, p95)",
                "s",
                q(
                    p(0.5, "loopmesh_llm_limit_wait_seconds", "gen_ai_request_model"),
                    "p50 {{gen_ai_request_model}}",
                    "A",
                ),
                q(
                    p(0.95, "loopmesh_llm_limit_wait_seconds", "gen_ai_request_model"),
                    "p95 {{gen_ai_request_model}}",
                    "B",
                ),
            )
        )
        .with_panel(
            ts(
                "Requests waiting at the rate-limit leader",
                "short",
                q(
                    "sum by (gen_ai_request_model) (loopmesh_llm_limit_waiting)",
                    "{{gen_ai_request_model}}",
                ),
            )
        )
        .with_panel(
            ts(
                "Tokens granted by the rate limits, by model",
                "short",
                q(
                    "sum by (gen_ai_request_model) "
                    f"(rate(loopmesh_llm_limit_tokens_granted_total[{RATE}]))",
                    "{{gen_ai_request_model}}",
                ),
            )
        )
        .with_panel(
            ts(
                "Provider 429s and the pauses they started, by model",
                "ops",
                q(
                    "sum by (gen_ai_request_model) "
                    f"(rate(loopmesh_llm_rate_limited_total[{RATE}]))",
                    "429 {{gen_ai_request_model}}",
                    "A",
                ),
                q(
                    f"sum by (gen_ai_request_model) (rate(loopmesh_llm_pauses_total[{RATE}]))",
                    "paused {{gen_ai_request_model}}",
                    "B",
                ),
            )
        )
        .with_row(dashboard.Row("Tools"))
        .with_panel(
            ts(
                "Tool latency by tool (p95)",
                "s",
                q(
                    p(0.95, "gen_ai_execute_tool_duration_seconds", "gen_ai_tool_name"),
                    "{{gen_ai_tool_name}}",
                ),
            )
        )
        .with_panel(
            ts(
                "Tool error rate by tool",
                "percentunit",
                q(
                    f"sum by (gen_ai_tool_name) (rate(loopmesh_tool_errors_total[{RATE}]))"
                    f" / sum by (gen_ai_tool_name) (rate(loopmesh_tool_calls_total[{RATE}]))",
                    "{{gen_ai_tool_name}}",
                ),
            )
        )
        .with_panel(
            ts(
                "Tool-pool backlog and worker replicas",
                "short",
                q("sum by (pool) (loopmesh_tool_pool_backlog)", "backlog {{pool}}", "A"),
                q(
                    "sum by (deployment) (kube_deployment_status_replicas_available"
                    '{deployment=~"tool-worker-.*"})',
                    "replicas {{deployment}}",
                    "B",
                ),
            )
        )
        .with_panel(
            ts(
                "Tool calls by tool, server and pool",
                "ops",
                q(
                    "sum by (gen_ai_tool_name, server, pool) "
                    f"(rate(loopmesh_tool_worker_calls_total[{RATE}]))",
                    "{{pool}}/{{server}}.{{gen_ai_tool_name}}",
                ),
            )
        )
    )


def events() -> dashboard.Dashboard:
    d = dashboard.Dashboard("loopmesh: Events").uid("loopmesh-events")
    d = variables(d.tags(["loopmesh"]).refresh("30s").time("now-1h", "now"), infinity=True)
    return (
        d.with_panel(
            ts(
                "Event rate by type",
                "ops",
                q(f"sum by (type) (rate(loopmesh_events_total[{RATE}]))", "{{type}}"),
                w=24,
            )
        )
        .with_panel(
            ts(
                "Errors and timeouts",
                "short",
                q(
                    "sum by (type) (increase(loopmesh_events_total"
                    f'{{type=~"error|tool_error|tool_timeout"}}[{RATE}]))',
                    "{{type}}",
                ),
            )
        )
        .with_panel(
            ts(
                "Tool errors by code",
                "short",
                q(
                    "sum by (gen_ai_tool_name, code) "
                    f"(increase(loopmesh_tool_errors_total[{RATE}]))",
                    "{{gen_ai_tool_name}} {{code}}",
                ),
            )
        )
        .with_panel(
            table.Panel()
            .title("Latest events")
            .description(
                "The gateway's /v1/events/latest through the Infinity datasource "
                "(docs/OBSERVABILITY.md)"
            )
            .datasource(INFINITY)
            .with_target(Infinity("/v1/events/latest?limit=100"))
            .span(24)
            .height(12)
        )
    )


DASHBOARDS = {"agent-overview.json": agent_overview, "events.json": events}


def render(make: object) -> str:
    built = make().build()  # type: ignore[operator]
    return json.dumps(built, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a JSON file is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, make in DASHBOARDS.items():
        path, text = HERE / name, render(make)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python k8s/grafana/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
