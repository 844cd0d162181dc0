"""The Grafana dashboards: generated JSON is current, every PromQL metric is one loopmesh
exports, and against a real Prometheus scraping every service every query has data."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loopmesh.ports import free_port
from loopmesh.testing.durable import Proc, worker_env
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto, error

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "k8s" / "grafana"
#: kube-state-metrics series (documented in docs/OBSERVABILITY.md), not loopmesh's.
EXTERNAL = re.compile(r"^kube_")
_WORDS = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_NOT_METRICS = {
    "sum", "by", "rate", "increase", "histogram_quantile", "le", "or", "and", "without",
}  # fmt: skip


def queries() -> list[str]:
    found = []
    for path in sorted(GRAFANA.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets") or []:
                if "expr" in target:
                    found.append(target["expr"])
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names of a PromQL expression: words that are not functions, keywords,
    labels (inside braces or by-lists) or quoted strings."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"by \([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    names = {w for w in _WORDS.findall(text) if w not in _NOT_METRICS}
    return {n for n in names if not re.fullmatch(r"[0-9.]+", n)}


def exported_families() -> set[str]:
    """Every sample name the code's registries can expose."""
    from prometheus_client import REGISTRY, CollectorRegistry

    import loop_worker.engine.llm
    import loop_worker.service  # noqa: F401
    import tool_worker.service  # noqa: F401
    from gateway.app import Metrics
    from loopmesh.exporter import EventMetrics

    names: set[str] = set()
    gateway, events = CollectorRegistry(), CollectorRegistry()
    Metrics(gateway)
    EventMetrics(events)
    for registry in (REGISTRY, gateway, events):
        for family in registry.collect():
            base = family.name
            kind = family.type
            names.add(base)
            if kind == "counter":
                names.add(base + "_total")
            if kind == "histogram":
                names.update(base + s for s in ("_bucket", "_sum", "_count"))
    names.add("loopmesh_tool_pool_backlog")  # the exporter's gauge, made per Exporter
    return names


def test_the_committed_dashboards_are_what_the_generator_makes():
    done = subprocess.run(
        [sys.executable, str(GRAFANA / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_every_metric_in_the_dashboards_is_exported():
    exported = exported_families()
    used = {n for e in queries() for n in metric_names(e)}
    assert used, "no queries found"
    missing = sorted(n for n in used if n not in exported and not EXTERNAL.match(n))
    assert not missing, f"dashboards query metrics nothing exports: {missing}"


async def wait_ready(url: str, proc: Proc | None, timeout: float = 60) -> None:
    async with httpx.AsyncClient() as client, asyncio.timeout(timeout):
        while True:
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if proc is not None and proc.proc is not None and proc.proc.returncode is not None:
                raise AssertionError(f"{url}: process ended:\n{proc.output()}")
            await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_every_dashboard_query_returns_data_from_a_real_prometheus(nats_server, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("SKIPPED LOUDLY: no `prometheus` binary (apt-get install prometheus)")
    ports = {name: free_port() for name in ("loop", "tool", "gateway", "exporter", "prom")}
    url = nats_server.url
    procs: list[Proc] = []
    prom = None
    async with FakeLLM(default=auto()) as llm:
        try:
            env = {
                **worker_env(url, llm.base_url, metrics_port=ports["loop"]),
                "LOOPMESH_LLM__MAX_RETRIES": "2",
                # the fleet's rate limits, far above this load: every call is granted
                "LOOPMESH_LLM__LIMITS": '{"models": {"fake-model": {"rpm": 100000}}}',
                "LOOPMESH_LLM__BACKOFF_INITIAL_S": "0.05",
                "LOOPMESH_LLM__FALLBACK_MODELS": '["fallback-model"]',
            }
            nats_env = {"LOOPMESH_NATS__URL": url}
            services = [
                (Proc("-m", "loopmesh", "tool-worker",
                      env={**nats_env, "LOOPMESH_TOOL_WORKER__METRICS_PORT": str(ports["tool"])}),
                 ports["tool"]),
                (Proc("-m", "loopmesh", "loop-worker", env=env), ports["loop"]),
                (Proc("-m", "loopmesh", "gateway",
                      env={**nats_env, "LOOPMESH_GATEWAY__PORT": str(ports["gateway"]),
                           "LOOPMESH_GATEWAY__NO_AUTH": "true"}),
                 ports["gateway"]),
                (Proc("-m", "loopmesh", "exporter", "--metrics-port", str(ports["exporter"]),
                      env=nats_env), ports["exporter"]),
            ]  # fmt: skip
            for proc, port in services:
                procs.append(await proc.start())
                await wait_ready(f"http://127.0.0.1:{port}/metrics", proc)
            config = tmp_path / "prometheus.yml"
            targets = ", ".join(f"'127.0.0.1:{ports[n]}'" for n in ("loop", "tool", "gateway"))
            config.write_text(
                "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                "scrape_configs:\n"
                f"  - job_name: services\n    static_configs: [{{targets: [{targets}]}}]\n"
                "  - job_name: exporter\n"
                f"    static_configs: [{{targets: ['127.0.0.1:{ports['exporter']}']}}]\n"
            )
            prom = await asyncio.create_subprocess_exec(
                binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{ports['prom']}",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            base = f"http://127.0.0.1:{ports['prom']}"
            await wait_ready(f"{base}/-/ready", None)

            # A 429 that pauses the model, retries, then a fallback (a 429 and two 503s,
            # max_retries 2), a tool call, a tool error.
            llm.script(
                error(429, "slow down", retry_after=0.2), error(503, "busy"), error(503, "busy")
            )
            tasks = [
                'call calculator {"expression": "6*7"}',
                'call calculator {"expression": "1/0"}',
                "hello",
            ]
            for task in tasks:
                run = Proc("-m", "loopmesh", "run", "--nats-url", url, "--timeout", "60", task)
                await run.start()
                assert await asyncio.wait_for(run.proc.wait(), 90) == 0, run.output()  # type: ignore[union-attr]
                await run.close()

            pending = {e for e in queries() if not any(EXTERNAL.match(n) for n in metric_names(e))}
            deadline = time.monotonic() + 90
            async with httpx.AsyncClient() as client:
                while pending and time.monotonic() < deadline:
                    for expr in sorted(pending):
                        query = expr.replace("$__rate_interval", "5m")
                        r = await client.get(f"{base}/api/v1/query", params={"query": query})
                        body = r.json()
                        assert body["status"] == "success", (query, body)
                        if body["data"]["result"]:
                            pending.discard(expr)
                    if pending:
                        await asyncio.sleep(1)
            logs = "\n".join(p.output() for p in procs)
            assert not pending, f"queries without data: {sorted(pending)}\n{logs}"
        finally:
            if prom is not None:
                prom.terminate()
                await asyncio.wait_for(prom.wait(), 30)
            for proc in reversed(procs):
                await proc.terminate()
                await proc.close()
