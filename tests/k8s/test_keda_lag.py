"""KEDA's view of the backlog, on a real nats-server.

The tool pools' ScaledObjects of overlays/keda name a stream and a durable consumer.
Here the real tool workers start (each creates its pool's consumer, as in a cluster),
stop, and tool calls pile up behind them. The test then asks the monitoring endpoint
what KEDA's ``nats-jetstream`` scaler asks (``GET /jsz?acc=$G&consumers=true&config=true``,
lag = ``num_pending + num_ack_pending`` of the named consumer) and finds every named
consumer holding its backlog; once the workers are back, the lag drains to zero.

The loop workers take turns through one consumer per tenant, which that scaler cannot
add up: their ScaledObject reads ``loopmesh_turns_backlog_total`` from the exporter's
``/metrics`` (``metrics-api``, Prometheus text). Here tenants' consumers hold turns,
waiting and held, the real exporter runs, and the test reads its ``/metrics`` at the
trigger's path the way KEDA does, finding every tenant's turns counted and, as they are
acked, the total draining to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from loopmesh.exporter import ExporterConfig, ExporterSettings, serve
from loopmesh.ports import free_port
from loopmesh.provision import provision_all
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from loopmesh.turns import publish_turn
from schemas import Subjects, ToolCallRequest, Turn, call_id, encode, new_id
from tests.turns_consumers import tenant_consumer
from tool_worker import cli as tool_cli
from tool_worker.config import ToolWorkerConfig, ToolWorkerSettings

from .render import named, of_kind, render

SUBJECTS = Subjects()  # the base ConfigMap's [nats] prefix (checked in test_manifests)
CALLS = 7
DEADLINE_S = 60.0


def scaled_consumers() -> dict[tuple[str, str], str]:
    """(stream, consumer) of every nats-jetstream ScaledObject in overlays/keda → the
    tool pool its target Deployment serves."""
    docs = render("overlays/keda")
    found: dict[tuple[str, str], str] = {}
    for scaled in of_kind(docs, "ScaledObject"):
        (trigger,) = scaled["spec"]["triggers"]
        if trigger["type"] != "nats-jetstream":
            continue
        assert trigger["metadata"]["account"] == "$G"
        target = named(docs, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
        args = target["spec"]["template"]["spec"]["containers"][0]["args"]
        pool = args[args.index("--pool") + 1]
        found[(trigger["metadata"]["stream"], trigger["metadata"]["consumer"])] = pool
    return found


def loop_worker_trigger() -> dict[str, str]:
    """The metadata of the loop workers' metrics-api trigger in overlays/keda."""
    scaled = named(render("overlays/keda"), "ScaledObject", "loop-worker")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "metrics-api"
    meta: dict[str, str] = trigger["metadata"]
    return meta


async def keda_lags(server: NatsServer, account: str = "$G") -> dict[tuple[str, str], int]:
    """Every consumer's lag as KEDA's nats-jetstream scaler computes it."""
    async with httpx.AsyncClient() as http:
        response = await http.get(
            f"{server.monitor_url}/jsz",
            params={"acc": account, "consumers": "true", "config": "true"},
        )
    response.raise_for_status()
    lags = {}
    for details in response.json().get("account_details", []):
        if details["name"] != account:
            continue
        for stream in details.get("stream_detail", []):
            for consumer in stream.get("consumer_detail", []):
                key = (stream["name"], consumer["name"])
                lags[key] = consumer["num_pending"] + consumer["num_ack_pending"]
    return lags


def metrics_api_value(body: str, value_location: str) -> float | None:
    """The value KEDA's metrics-api scaler takes from a Prometheus text body (``format:
    prometheus``): the metric named by ``value_location``, its first sample whose
    labels match the location's (a bare name matches any); None where KEDA finds none
    (an error to it, which its ``fallback`` answers)."""
    assert "{" not in value_location, "a location with labels: match them here too"
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == value_location:
                return float(sample.value)
    return None


def parsed_as_keda_parses(body: str) -> None:
    """The whole body through Prometheus' Go text parser (``expfmt.TextParser``, which
    KEDA parses it with): ``promtool check metrics`` exits 1 on a body it cannot parse
    (3 is lint advice, which KEDA does not read)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("SKIPPED LOUDLY: no `promtool` (apt-get install prometheus) to parse "
                    "the exporter's /metrics as KEDA's Go parser does")  # fmt: skip
    done = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, text=True
    )
    assert done.returncode in (0, 3) and "parsing error" not in done.stderr, done.stderr


async def wait_for(
    server: NatsServer, done: Callable[[dict[tuple[str, str], int]], bool]
) -> dict[tuple[str, str], int]:
    """Poll /jsz (it offers no event to await) until ``done(lags)``; fail after the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while not done(lags := await keda_lags(server)):
        if time.monotonic() > deadline:
            raise AssertionError(f"after {DEADLINE_S}s, /jsz still shows {lags}")
        await asyncio.sleep(0.1)
    return lags


@contextlib.asynccontextmanager
async def workers(server: NatsServer, pools: list[str]) -> AsyncIterator[list[asyncio.Task[None]]]:
    """One real tool worker per pool, until the block ends."""
    nats = NatsSettings(url=server.url)
    stop = asyncio.Event()
    services: list[Callable[[], Awaitable[None]]] = []
    for pool in pools:
        settings = ToolWorkerSettings(pool=pool, builtins=("calculator",), pull_expires_s=1.0)
        config = ToolWorkerConfig(nats=nats, tool_worker=settings)
        services.append(lambda config=config: tool_cli.serve(config, stop, provision=True))
    tasks = [asyncio.create_task(service()) for service in services]
    try:
        yield tasks
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_every_pools_scaled_object_sees_its_backlog(nats_server: NatsServer, nc: Client):
    expected = scaled_consumers()
    pools = sorted(expected.values())
    assert pools, "no ScaledObject for a tool pool"

    # The workers start as in the cluster and create their consumers, then go away.
    async with workers(nats_server, pools) as tasks:
        await wait_for(
            nats_server, lambda lags: set(expected) <= set(lags) or any(t.done() for t in tasks)
        )
        assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]

    js = nc.jetstream()
    for p, pool in enumerate(pools):
        for i in range(CALLS):
            call = ToolCallRequest(
                call_id=call_id("acme", "s1", "t1", 1, p * CALLS + i), tenant="acme",
                session="s1", turn_id="t1", iteration=1, server="local", tool="calculator",
                arguments={"expression": "6*7"},
            )  # fmt: skip
            await js.publish(
                SUBJECTS.tool(pool, "local", "calculator"),
                encode(call),
                headers={"Nats-Msg-Id": call.call_id},
            )

    want: dict[tuple[str, str], Any] = dict.fromkeys(expected, CALLS)
    lags = await keda_lags(nats_server)
    assert {key: lags.get(key) for key in expected} == want

    # The backlog is the one the workers drain: with them back, every lag goes to zero.
    async with workers(nats_server, pools):
        await wait_for(nats_server, lambda lags: all(lags[key] == 0 for key in expected))


async def test_the_loop_workers_scaled_object_reads_every_tenants_backlog_from_the_exporter(
    nats_server: NatsServer, nc: Client
) -> None:
    trigger = loop_worker_trigger()
    assert trigger["format"] == "prometheus"
    nats = NatsSettings(url=nats_server.url)
    await provision_all(nc, nats)
    js = nc.jetstream()
    # one consumer named as the workers name it, one with a hashed name
    names = {
        "acme": await tenant_consumer(js, SUBJECTS, "acme"),
        "globex": await tenant_consumer(js, SUBJECTS, "globex", name="turns-5d41402a"),
    }
    published = {"acme": 5, "globex": 3, "initech": 2}  # initech: no consumer yet
    for tenant, n in published.items():
        for _ in range(n):
            turn = Turn(id=new_id(), tenant=tenant, session=new_id(), input="hello")
            await publish_turn(js, SUBJECTS, turn)
    subs = {
        t: await js.pull_subscribe_bind(name, SUBJECTS.turns_stream) for t, name in names.items()
    }
    held = await subs["acme"].fetch(2, timeout=5)  # a worker holds them: num_ack_pending

    port = free_port()
    settings = ExporterSettings(metrics_port=port, backlog_interval_s=0.2)
    stop = asyncio.Event()
    exporter = asyncio.create_task(serve(ExporterConfig(nats=nats, exporter=settings), stop))
    url = urlsplit(trigger["url"])
    # KEDA asks the exporter's Service; here the exporter listens on loopback.
    scrape = f"http://127.0.0.1:{port}{url.path}"

    async def keda_reads(want: float) -> str:
        """Poll the exporter until KEDA would read ``want``; the body it read."""
        deadline = time.monotonic() + DEADLINE_S
        async with httpx.AsyncClient() as http:
            while True:
                assert not exporter.done(), exporter.result()
                with contextlib.suppress(httpx.TransportError):
                    response = await http.get(scrape)
                    body = response.text
                    if metrics_api_value(body, trigger["valueLocation"]) == want:
                        return body
                if time.monotonic() > deadline:
                    raise AssertionError(f"after {DEADLINE_S}s KEDA would not read {want}")
                await asyncio.sleep(0.1)

    try:
        # Every tenant with a consumer, waiting and held turns alike; initech not yet.
        body = await keda_reads(5 + 3)
        parsed_as_keda_parses(body)
        samples = {
            (s.name, s.labels.get("tenant")): s.value
            for family in text_string_to_metric_families(body)
            for s in family.samples
            if s.name in ("loopmesh_turns_waiting", "loopmesh_turns_backlog")
        }
        assert samples == {
            ("loopmesh_turns_waiting", "acme"): 3, ("loopmesh_turns_backlog", "acme"): 5,
            ("loopmesh_turns_waiting", "globex"): 3, ("loopmesh_turns_backlog", "globex"): 3,
        }  # fmt: skip
        # The nats-jetstream scaler, asked about one tenant's consumer, sees only its own.
        lags = await keda_lags(nats_server)
        assert lags[(SUBJECTS.turns_stream, names["acme"])] == 5

        # Workers take and finish every turn: the total KEDA reads drains to zero.
        for msg in held:
            await msg.ack()
        for tenant, sub in subs.items():
            left = published[tenant] - (len(held) if tenant == "acme" else 0)
            for msg in await sub.fetch(left, timeout=5):
                await msg.ack()
        await keda_reads(0)
    finally:
        stop.set()
        await exporter
        for sub in subs.values():
            await sub.unsubscribe()
