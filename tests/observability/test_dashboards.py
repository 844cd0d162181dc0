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
from typing import Any

import httpx
import nats
import pytest

from loopmesh.ports import free_port
from loopmesh.testing.durable import Proc, wait_for, worker_env
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto, error
from loopmesh.turns import publish_turn
from schemas import Subjects, Turn, new_id
from tests.turns_consumers import tenant_consumer

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "k8s" / "grafana"
#: kube-state-metrics series (documented in docs/OBSERVABILITY.md), not loopmesh's.
EXTERNAL = re.compile(r"^kube_")
_WORDS = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
#: The exporter's per-tenant turns gauges: data once a tenant has its own turns consumer.
TENANT_BACKLOG = {"loopmesh_turns_waiting", "loopmesh_turns_backlog"}
SUBJECTS = Subjects()
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
    from nats.aio.client import Client
    from prometheus_client import REGISTRY, CollectorRegistry

    import loop_worker.engine.llm
    import loop_worker.service  # noqa: F401
    import tool_worker.service  # noqa: F401
    from gateway.app import Metrics
    from loopmesh.exporter import Exporter, ExporterSettings
    from loopmesh.settings import NatsSettings

    names: set[str] = set()
    gateway, events = CollectorRegistry(), CollectorRegistry()
    Metrics(gateway)
    Exporter(Client(), NatsSettings(), ExporterSettings(), events)  # never connected
    for registry in (REGISTRY, gateway, events):
        for family in registry.collect():
            base = family.name
            kind = family.type
            names.add(base)
            if kind == "counter":
                names.add(base + "_total")
            if kind == "histogram":
                names.update(base + s for s in ("_bucket", "_sum", "_count"))
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


async def query(client: httpx.AsyncClient, base: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result (``$__rate_interval`` read as 5m)."""
    query = expr.replace("$__rate_interval", "5m")
    body = (await client.get(f"{base}/api/v1/query", params={"query": query})).json()
    assert body["status"] == "success", (query, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


async def until_data(
    client: httpx.AsyncClient, base: str, exprs: set[str], deadline: float
) -> set[str]:
    """Query ``exprs`` every second until each has returned data or ``deadline``
    seconds have passed; those that returned none."""
    pending = set(exprs)
    end = time.monotonic() + deadline
    while pending and time.monotonic() < end:
        for expr in sorted(pending):
            if await query(client, base, expr):
                pending.discard(expr)
        if pending:
            await asyncio.sleep(1)
    return pending


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
            per_tenant = {e for e in pending if metric_names(e) & TENANT_BACKLOG}
            assert per_tenant, "no dashboard query of the tenants' turns backlog"
            async with httpx.AsyncClient() as client:
                missing = await until_data(client, base, pending - per_tenant, deadline=90)
                logs = "\n".join(p.output() for p in procs)
                assert not missing, f"queries without data: {sorted(missing)}\n{logs}"

                # Turns waiting per tenant: with the loop worker gone, two of acme's turns
                # wait in acme's own consumer (made after them: it counts them at once).
                await procs[1].terminate()  # the loop worker
                nc = await nats.connect(url)
                try:
                    js = nc.jetstream()
                    for _ in range(2):
                        turn = Turn(id=new_id(), tenant="acme", session=new_id(), input="hi")
                        await publish_turn(js, SUBJECTS, turn)
                    await tenant_consumer(js, SUBJECTS, "acme")
                finally:
                    await nc.close()
                missing = await until_data(client, base, per_tenant, deadline=90)
                assert not missing, f"queries without data: {sorted(missing)}"

                async def acme_waits_two() -> bool:  # (the worker's own tenant has a series)
                    waiting = await query(client, base, "sum by (tenant) (loopmesh_turns_waiting)")
                    return {r["metric"]["tenant"]: r["value"][1] for r in waiting}.get(
                        "acme"
                    ) == "2"

                await wait_for(acme_waits_two, timeout=90, every=1.0, what="acme's 2 turns waiting")
        finally:
            if prom is not None:
                prom.terminate()
                await asyncio.wait_for(prom.wait(), 30)
            for proc in reversed(procs):
                await proc.terminate()
                await proc.close()
