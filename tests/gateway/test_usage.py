"""Budgets and usage on real services: a turn stops at its token budget with reason
``budget``; the exporter counts every call's usage from the events into the usage
ledger, ``GET /v1/usage`` agrees with the events, and a tenant past its daily ceiling
gets no more LLM calls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from loop_worker.engine.settings import BudgetSettings, LoopSettings
from loopmesh.exporter import Exporter, ExporterSettings
from loopmesh.settings import NatsSettings, Price
from loopmesh.testing.durable import stream_events, wait_for
from loopmesh.testing.fake_llm import tool_calls
from loopmesh.testing.fake_stream import message_tokens
from schemas.events import BudgetReached, LLMResponse
from tests.gateway.conftest import ACME_KEY, auth
from tests.loop_worker.durable import Mesh, Watch, mesh_on, send_turn, turn

PRICES = {"fake-model": Price(input=2.0, output=8.0)}
ECHO = ("local__echo", {"text": "x" * 400})  # each reply about 100 tokens out
DONE = ("task_completion", {"result": "done"})


@pytest.fixture
async def mesh(nats_url: str) -> AsyncIterator[Mesh]:
    async with mesh_on(nats_url, provisioned=True) as mesh:
        await mesh.tool_worker()
        yield mesh


@pytest.fixture
async def exporter(mesh: Mesh, nats_url: str) -> AsyncIterator[Exporter]:
    settings = ExporterSettings(metrics_port=0, durable="usage-test")
    exporter = Exporter(mesh.nc, NatsSettings(url=nats_url), settings, CollectorRegistry(), PRICES)
    stop = asyncio.Event()
    task = asyncio.create_task(exporter.run(stop))
    try:
        yield exporter
    finally:
        stop.set()
        await task


async def usage(client: httpx.AsyncClient) -> dict:
    r = await client.get("/v1/usage", params={"days": 1})
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_turn_stops_at_its_token_budget_and_usage_agrees_with_the_events(
    mesh: Mesh, exporter: Exporter, client: httpx.AsyncClient
) -> None:
    mesh.fake.script(tool_calls(ECHO), tool_calls(ECHO), tool_calls(ECHO), tool_calls(DONE))
    # the prompt counts about 1,000 tokens a call, a call uses about 700: two fit
    budget = BudgetSettings(turn_tokens=2_500)
    await mesh.loop_worker(loop=LoopSettings(max_iterations=6, budget=budget))
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", "echo a lot"))
        end = await watch.wait("loop_end", "t1", timeout=30)
    assert end.reason == "budget"
    [reached] = watch.of("budget_reached")
    assert isinstance(reached, BudgetReached) and reached.ceiling == "turn_tokens"
    assert reached.spent + reached.needed > 2_500 and reached.over > 0
    assert len(mesh.fake.requests) == 2  # the call that would pass it was not made
    # the ledger counted every call from the events: /v1/usage agrees with them
    responses = [e for e, _ in await stream_events(mesh.nc, "acme", "s1")]
    calls = [e for e in responses if isinstance(e, LLMResponse) and e.usage is not None]
    tokens = sum(e.usage.prompt_tokens + e.usage.completion_tokens for e in calls)
    cost = sum(
        PRICES["fake-model"].of(e.usage.prompt_tokens, e.usage.completion_tokens) for e in calls
    )

    async def counted() -> bool:
        return (await usage(client))["calls"] == len(calls)

    await wait_for(counted, timeout=20, what="the exporter to count every call")
    body = await usage(client)
    assert body["tokens"] == tokens and body["cost"] == pytest.approx(cost)
    [day] = body["days"]
    [line] = day["lines"]
    assert (line["agent"], line["model"], line["calls"]) == ("default", "fake-model", len(calls))
    assert line["prompt_tokens"] + line["completion_tokens"] == tokens
    # another tenant sees none of it
    other = await client.get("/v1/usage", headers=auth("globex-secret-key-2"))
    assert other.json()["calls"] == 0 and other.json()["days"] == []


async def test_a_tenant_past_its_daily_ceiling_gets_no_more_calls(
    mesh: Mesh, exporter: Exporter, client: httpx.AsyncClient
) -> None:
    mesh.fake.script(tool_calls(DONE))
    budget = BudgetSettings(tenant_daily_tokens=1_200)  # one call, then its next would pass it
    loop = LoopSettings(max_iterations=6, budget=budget)
    await mesh.loop_worker(loop=loop, usage_read_every_s=0)  # no second-old reads
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", "echo"))
        first = await watch.wait("loop_end", "t1", timeout=30)

        async def counted() -> bool:
            return (await usage(client))["calls"] == 1

        await wait_for(counted, timeout=20, what="the first turn's usage in the ledger")
        asked = len(mesh.fake.requests)
        await send_turn(mesh.nc, turn("t2", "echo again"))
        second = await watch.wait("loop_end", "t2", timeout=30)
    assert first.reason == "task_completion"
    assert second.reason == "budget" and len(mesh.fake.requests) == asked
    reached = [e for e in watch.of("budget_reached") if e.turn_id == "t2"]
    assert reached and reached[0].ceiling == "tenant_daily_tokens"


@pytest.fixture
async def client(gateway_at) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        gateway_at(rate_per_s=1000, rate_burst=1000) as gateway,  # the tests poll it
        httpx.AsyncClient(base_url=gateway.url, headers=auth(ACME_KEY)) as c,
    ):
        yield c


async def test_cached_prompt_tokens_are_counted_priced_and_shown_in_usage(
    mesh: Mesh, nats_url: str, client: httpx.AsyncClient
) -> None:
    assert mesh.fake is not None
    mesh.fake.prompt_cache = True  # reports the leading messages it saw before as cached
    prices = {"fake-model": Price(input=2.0, cached_input=0.5, output=8.0)}
    settings = ExporterSettings(metrics_port=0, durable="usage-cached")
    exporter = Exporter(mesh.nc, NatsSettings(url=nats_url), settings, CollectorRegistry(), prices)
    stop = asyncio.Event()
    task = asyncio.create_task(exporter.run(stop))
    try:
        await mesh.loop_worker()
        async with Watch(mesh.nc) as watch:
            for n in (1, 2, 3):  # one session, turn after turn: each prompt begins as before
                mesh.fake.script(tool_calls(ECHO), tool_calls(DONE))
                await send_turn(mesh.nc, turn(f"t{n}", f"echo a lot, take {n}"))
                await watch.wait("loop_end", f"t{n}", timeout=30)
        events = [e for e, _ in await stream_events(mesh.nc, "acme", "s1")]
        calls = [e for e in events if isinstance(e, LLMResponse) and e.usage is not None]
        cached = [e.usage.cached_tokens for e in calls]
        assert cached[0] == 0 and all(c > 0 for c in cached[1:])  # the first call had no cache
        sent = [r["messages"] for r in mesh.fake.requests]
        # a turn's second call begins as its first did: all of the first is cached
        assert cached[1] == sum(message_tokens(m) for m in sent[0])
        # turn 3 begins as turn 2 did up to turn 2's user message (turn 2 sent it with the
        # plan around it; it is stored as the user wrote it)
        upto = next(i for i, m in enumerate(sent[4]) if m["content"] == "echo a lot, take 2")
        assert cached[4] == sum(message_tokens(m) for m in sent[4][:upto])

        async def counted() -> bool:
            return (await usage(client))["calls"] == len(calls)

        await wait_for(counted, timeout=20, what="the exporter to count every call")
        body = await usage(client)
        assert body["cached_tokens"] == sum(cached) > 0
        [day] = body["days"]
        assert day["cached_tokens"] == sum(cached) == day["lines"][0]["cached_tokens"]
        cost = sum(
            prices["fake-model"].of(
                e.usage.prompt_tokens, e.usage.completion_tokens, e.usage.cached_tokens
            )
            for e in calls
        )
        uncached = sum(
            prices["fake-model"].of(e.usage.prompt_tokens, e.usage.completion_tokens) for e in calls
        )
        assert body["cost"] == pytest.approx(cost) and cost < uncached
    finally:
        stop.set()
        await task
