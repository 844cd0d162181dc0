"""KEDA's view of the backlog, on a real nats-server.

Each ScaledObject of overlays/keda names a stream and a durable consumer. Here the real
loop worker and tool workers start (each creates what it creates in a cluster), stop,
and work piles up behind them: turns with no loop worker, tool calls with no tool
worker. The test then asks the monitoring endpoint what KEDA's ``nats-jetstream``
scaler asks (``GET /jsz?acc=$G&consumers=true&config=true``, lag = ``num_pending +
num_ack_pending`` of the named consumer) and finds every named consumer holding its
backlog; once the workers are back, the lag drains to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from nats.aio.client import Client

from loop_worker import cli as loop_cli
from loop_worker.config import LoopWorkerConfig
from loop_worker.engine.settings import LLMSettings
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import text
from loopmesh.turns import publish_turn
from schemas import Subjects, ToolCallRequest, Turn, call_id, encode, new_id
from tool_worker import cli as tool_cli
from tool_worker.config import ToolWorkerConfig, ToolWorkerSettings

from .render import named, of_kind, render

SUBJECTS = Subjects()  # the base ConfigMap's [nats] prefix (checked in test_manifests)
TURNS = 5
CALLS = 7
DEADLINE_S = 60.0


def scaled_consumers() -> dict[tuple[str, str], str | None]:
    """(stream, consumer) of every ScaledObject in overlays/keda → the tool pool its
    target Deployment serves (None for the loop workers)."""
    docs = render("overlays/keda")
    found: dict[tuple[str, str], str | None] = {}
    for scaled in of_kind(docs, "ScaledObject"):
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "nats-jetstream"
        assert trigger["metadata"]["account"] == "$G"
        target = named(docs, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
        args = target["spec"]["template"]["spec"]["containers"][0]["args"]
        pool = args[args.index("--pool") + 1] if "--pool" in args else None
        found[(trigger["metadata"]["stream"], trigger["metadata"]["consumer"])] = pool
    return found


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
async def workers(
    server: NatsServer, llm: FakeLLM, pools: list[str]
) -> AsyncIterator[list[asyncio.Task[None]]]:
    """The real loop worker and one real tool worker per pool, until the block ends."""
    nats = NatsSettings(url=server.url)
    stop = asyncio.Event()
    llm_settings = LLMSettings(base_url=llm.base_url, api_key="test", model="fake-model")
    services: list[Callable[[], Awaitable[None]]] = [
        lambda: loop_cli.serve(LoopWorkerConfig(nats=nats, llm=llm_settings), stop)
    ]
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


async def test_every_scaled_object_sees_its_backlog(
    nats_server: NatsServer, nc: Client, fake_llm: FakeLLM
) -> None:
    expected = scaled_consumers()
    pools = sorted(p for p in expected.values() if p is not None)
    assert (SUBJECTS.turns_stream, SUBJECTS.turns_consumer) in expected
    assert pools, "no ScaledObject for a tool pool"
    fake_llm.default = text("done")

    # The workers start as in the cluster and create their consumers, then go away.
    async with workers(nats_server, fake_llm, pools) as tasks:
        await wait_for(
            nats_server, lambda lags: set(expected) <= set(lags) or any(t.done() for t in tasks)
        )
        assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]

    js = nc.jetstream()
    for _ in range(TURNS):
        turn = Turn(id=new_id(), tenant="acme", session=new_id(), input="hello")
        await publish_turn(js, SUBJECTS, turn)
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

    want: dict[tuple[str, str], Any] = {
        key: TURNS if pool is None else CALLS for key, pool in expected.items()
    }
    lags = await keda_lags(nats_server)
    assert {key: lags.get(key) for key in expected} == want

    # The backlog is the one the workers drain: with them back, every lag goes to zero.
    async with workers(nats_server, fake_llm, pools):
        await wait_for(nats_server, lambda lags: all(lags[key] == 0 for key in expected))
