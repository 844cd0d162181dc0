"""Scale from zero, on a real nats-server: a pool provisioned ahead of its workers
keeps its tools offered and its backlog visible while no worker runs, and the first
worker to start (as KEDA would start one) serves the waiting call."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

from loop_worker import cli as loop_cli
from loop_worker.catalog import Catalog
from loop_worker.config import LoopWorkerConfig
from loop_worker.engine.settings import LLMSettings
from loopmesh.provision import provision
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import stream_events, wait_for
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import tool_calls
from loopmesh.turns import publish_turn
from schemas import Subjects, Turn, definitions, new_id
from schemas.events import LoopEnd, ToolResultEvent
from tests.conftest import skip_without_msg_ttl
from tool_worker import cli as tool_cli
from tool_worker.config import ToolWorkerConfig, ToolWorkerSettings

from .test_keda_lag import keda_lags

SUBJECTS = Subjects()
CATALOG_TTL_S = 2.0
DEADLINE_S = 60.0
COLD = ToolWorkerSettings(
    pool="cold",
    pinned=True,
    builtins=(),
    modules=("tests.tool_worker.sample_tools",),
    assign={"local": "cold"},
    pull_expires_s=1.0,
)
WARM = ToolWorkerSettings(
    pool="warm", builtins=("current_time",), assign={"local.current_time": "warm"}
)


async def serve_tools(url: str, settings: ToolWorkerSettings, stop: asyncio.Event) -> None:
    config = ToolWorkerConfig(nats=NatsSettings(url=url), tool_worker=settings)
    await tool_cli.serve(config, stop, provision=False)


async def test_a_pool_with_no_worker_keeps_its_tools_and_serves_its_backlog_once_one_starts(
    nats_server: NatsServer, nc: Client, fake_llm: FakeLLM
) -> None:
    await skip_without_msg_ttl(nats_server.url)
    # A catalog TTL short enough to see entries lapse within the test; the services
    # do not provision (they would set the default TTL back).
    await provision(nc.jetstream(), definitions(SUBJECTS, catalog_ttl_s=CATALOG_TTL_S))
    url = nats_server.url
    cold = ToolWorkerConfig(nats=NatsSettings(url=url), tool_worker=COLD)
    actions = await tool_cli.provision_only(cold, provision=False)
    assert "created consumer LOOPMESH_TOOLS/pool-cold" in actions

    async with Catalog(nc, SUBJECTS.catalog_bucket) as catalog:
        await catalog.loaded(timeout=DEADLINE_S)
        assert catalog.get("local.echo") is not None
        # A worker of an unpinned pool puts its tools, then goes: they lapse with the
        # TTL. The pinned pool's tools, which no worker ever refreshed, do not.
        stop_warm = asyncio.Event()
        warm = asyncio.create_task(serve_tools(url, WARM, stop_warm))
        assert await catalog.wait_for(lambda c: c.get("local.current_time") is not None, 30)
        stop_warm.set()
        await warm
        assert await catalog.wait_for(lambda c: c.get("local.current_time") is None, 30)
        spec = catalog.get("local.echo")
        assert spec is not None and spec.pinned and spec.pool == "cold"

    fake_llm.script(
        tool_calls(("local__echo", {"text": "forty-two"})),
        tool_calls(("task_completion", {"result": "The tool said forty-two."})),
    )
    llm = LLMSettings(base_url=fake_llm.base_url, api_key="test", model="fake-model")
    stop = asyncio.Event()
    loop_worker = asyncio.create_task(
        loop_cli.serve(LoopWorkerConfig(nats=NatsSettings(url=url), llm=llm), stop, provision=False)
    )
    tool_worker: asyncio.Task[None] | None = None
    try:
        turn = Turn(id=new_id(), tenant="acme", session=new_id(), input="echo forty-two")
        await publish_turn(nc.jetstream(), SUBJECTS, turn)

        # The model is offered the pool's tools while no worker of it runs ...
        await fake_llm.wait_requests(1, timeout=DEADLINE_S)
        offered = {t["function"]["name"] for t in fake_llm.requests[0].get("tools", [])}
        assert "local__echo" in offered, offered
        # ... and its call waits in the pool's backlog, where KEDA reads it.
        pool = (SUBJECTS.tools_stream, SUBJECTS.pool_consumer("cold"))

        async def backlog() -> bool:
            return (await keda_lags(nats_server)).get(pool) == 1

        await wait_for(backlog, timeout=DEADLINE_S, what="the call in pool-cold's backlog")
        info = await nc.jetstream().consumer_info(*pool)
        assert info.num_pending == 1 and info.num_ack_pending == 0
        assert not loop_worker.done()

        # A worker starts, as KEDA would start one, and serves the waiting call.
        tool_worker = asyncio.create_task(serve_tools(url, COLD, stop))

        async def ended() -> bool:
            events = [e for e, _ in await stream_events(nc, turn.tenant, turn.session)]
            return any(isinstance(e, LoopEnd) for e in events)

        await wait_for(ended, timeout=DEADLINE_S, what="the turn's loop_end")
        events = [e for e, _ in await stream_events(nc, turn.tenant, turn.session)]
        results = [e for e in events if isinstance(e, ToolResultEvent) and e.tool == "echo"]
        assert [r.content for r in results] == ["forty-two"]
        (end,) = [e for e in events if isinstance(e, LoopEnd)]
        assert end.reason == "task_completion"
        assert "forty-two" in str(fake_llm.requests[1]["messages"][-1])
        await wait_for(
            lambda: _drained(nats_server, pool), timeout=DEADLINE_S, what="pool-cold's lag at 0"
        )
    finally:
        stop.set()
        await asyncio.gather(loop_worker, *([tool_worker] if tool_worker else []))


async def _drained(server: NatsServer, key: tuple[str, str]) -> bool:
    return (await keda_lags(server)).get(key) == 0
