"""Each Deployment's probes, asked of the real service running with the settings the
rendered pod would read (the ConfigMap's TOML and the container's variables), on a real
nats-server. Only the NATS URL, the replicas (one server here, three in the cluster) and
the port number change: a test cannot take a fixed port on a shared machine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec

from gateway.server import GatewayServer
from loop_worker import cli as loop_cli
from loopmesh import exporter
from loopmesh.ports import free_port
from loopmesh.server import NatsServer
from loopmesh.settings import load
from loopmesh.testing.fake_llm import FakeLLM
from nats_agents import service as nats_agents
from tool_worker import cli as tool_cli
from webhooks import cli as webhooks_cli

from .render import Doc, container_config, of_kind, render, service_of

DEADLINE_S = 60.0


def with_port(config: Any, table: str, field: str, port: int, nats_url: str) -> Any:
    section = msgspec.structs.replace(getattr(config, table), **{field: port})
    nats = msgspec.structs.replace(config.nats, url=nats_url, replicas=1)
    return msgspec.structs.replace(config, nats=nats, **{table: section})


@contextlib.asynccontextmanager
async def running(
    docs: list[Doc], deployment: Doc, tmp_path: Path, nats_url: str, llm: FakeLLM
) -> AsyncIterator[tuple[int, asyncio.Task[None] | None]]:
    """The Deployment's service, in this process; yields the port its probes ask, and
    the worker's task (None for the gateway, which is up once entered)."""
    config = container_config(docs, deployment, tmp_path)
    port = free_port()
    stop = asyncio.Event()
    service = service_of(deployment)
    if service == "gateway":
        keys = json.dumps([{"sha256": "0" * 64, "tenant": "acme"}])  # the Secret's shape
        api_keys = load(type(config), env={"LOOPMESH_GATEWAY__API_KEYS": keys}).gateway.api_keys
        config = with_port(config, "gateway", "port", port, nats_url)
        gateway = msgspec.structs.replace(config.gateway, api_keys=api_keys)
        async with GatewayServer(msgspec.structs.replace(config, gateway=gateway)):
            yield port, None
        return
    if service == "exporter":
        config = with_port(config, "exporter", "metrics_port", port, nats_url)
        task = asyncio.create_task(exporter.serve(config, stop))
    elif service == "webhooks":
        config = with_port(config, "webhooks", "metrics_port", port, nats_url)
        task = asyncio.create_task(webhooks_cli.serve(config, stop))
    elif service == "nats-agents":
        config = with_port(config, "nats_agents", "metrics_port", port, nats_url)
        task = asyncio.create_task(nats_agents.serve(config, stop))
    elif service == "loop-worker":
        config = with_port(config, "loop_worker", "metrics_port", port, nats_url)
        llm_settings = msgspec.structs.replace(config.llm, base_url=llm.base_url, api_key="x")
        task = asyncio.create_task(
            loop_cli.serve(msgspec.structs.replace(config, llm=llm_settings), stop)
        )
    else:
        config = with_port(config, "tool_worker", "metrics_port", port, nats_url)
        task = asyncio.create_task(tool_cli.serve(config, stop, provision=True))
    try:
        yield port, task
    finally:
        stop.set()
        await task


async def probe(
    http: httpx.AsyncClient, url: str, task: asyncio.Task[None] | None, *, retry: bool = False
) -> int:
    """The probe's answer once the service listens (connection refused until then); with
    ``retry``, its first 200 if one comes, as the kubelet repeats a startup probe."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            status = (await http.get(url)).status_code
            if status == 200 or not retry or time.monotonic() > deadline:
                return status
            await asyncio.sleep(0.05)
        except httpx.ConnectError:
            if task is not None and task.done():
                task.result()  # the service failed: its error
                raise AssertionError(f"the service behind {url} stopped") from None
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens at {url} after {DEADLINE_S}s") from None
            await asyncio.sleep(0.05)


async def test_every_probe_answers_ok_from_the_real_service(
    tmp_path: Path, nats_server: NatsServer, fake_llm: FakeLLM
) -> None:
    docs = render("base")
    deployments = of_kind(docs, "Deployment")
    assert {service_of(d) for d in deployments} == {
        "gateway", "loop-worker", "tool-worker", "exporter", "webhooks", "nats-agents",
    }  # fmt: skip
    # The workers first: they provision the streams that the gateway's /readyz and the
    # exporter's consumer want, and the agents bucket the protocol host serves.
    deployments.sort(key=lambda d: service_of(d) in ("gateway", "exporter", "nats-agents"))
    async with contextlib.AsyncExitStack() as stack, httpx.AsyncClient() as http:
        for deployment in deployments:
            port, task = await stack.enter_async_context(
                running(docs, deployment, tmp_path, nats_server.url, fake_llm)
            )
            container = deployment["spec"]["template"]["spec"]["containers"][0]
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                path = container[kind]["httpGet"]["path"]
                url = f"http://127.0.0.1:{port}{path}"
                status = await probe(http, url, task, retry=kind == "startupProbe")
                assert status == 200, (deployment["metadata"]["name"], kind, path, status)
