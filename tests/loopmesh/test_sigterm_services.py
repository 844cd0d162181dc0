"""SIGTERM to the gateway and the exporter as processes (the workers' drain is tested in
``tests/loop_worker/test_service_crash.py``): each stops, exits 0, and loses or repeats
nothing it had taken on."""

from __future__ import annotations

import asyncio
import contextlib
import re

import httpx
import pytest
from nats.js.errors import NotFoundError

from loopmesh.provision import provision_all
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import Proc, connect_fast
from schemas import Subjects

from .test_exporter import publish, turn

pytestmark = pytest.mark.slow

S = Subjects()
DEADLINE_S = 60.0  # a deadline to wait within, generous for a loaded machine
_URL = re.compile(r"(http://\S+)")


async def test_sigterm_stops_the_gateway_with_its_streams_closed_and_the_posted_turn_kept(
    nats_server: NatsServer,
):
    nc = await connect_fast(nats_server.url)
    await provision_all(nc, NatsSettings(url=nats_server.url))
    gateway = Proc(
        "-m", "loopmesh", "gateway", "--nats-url", nats_server.url, "--no-auth", "--port", "0"
    )
    try:
        await gateway.start()
        line = await gateway.wait_line("gateway   http")
        url = _URL.search(line).group(1)  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as client:
            assert (await client.post("/v1/sessions", json={"session": "s1"})).status_code == 201
            async with client.stream("GET", "/v1/sessions/s1/events?since=0") as stream:
                posted = await client.post("/v1/sessions/s1/turns", json={"input": "hello"})
                assert posted.status_code == 202
                assert await gateway.terminate(DEADLINE_S) == 0, gateway.output()
                async with asyncio.timeout(DEADLINE_S):  # the open stream ends, not hangs
                    with contextlib.suppress(httpx.HTTPError):
                        async for _ in stream.aiter_bytes():
                            pass
        info = await nc.jetstream().stream_info(S.turns_stream)
        assert info.state.messages == 1  # the accepted turn is kept for the workers
    finally:
        await gateway.close()
        await nc.close()


async def test_sigterm_stops_the_exporter_with_all_it_counted_acked(nats_server: NatsServer):
    nc = await connect_fast(nats_server.url)
    await provision_all(nc, NatsSettings(url=nats_server.url))
    js = nc.jetstream()

    def exporter() -> Proc:
        return Proc("-m", "loopmesh", "exporter", "--nats-url", nats_server.url,
                    "--metrics-port", "0")  # fmt: skip

    async def scrape(proc: Proc) -> str:
        line = await proc.wait_line("exporter  metrics at")
        url = _URL.search(line).group(1)  # type: ignore[union-attr]
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            return (await client.get(url)).text

    async def consumed(n: int) -> None:
        async with asyncio.timeout(DEADLINE_S):
            while True:
                try:
                    info = await js.consumer_info(S.events_stream, "metrics-exporter")
                except NotFoundError:  # the exporter makes it once it runs
                    info = None
                if info and info.delivered.stream_seq >= n and not info.num_ack_pending:
                    return
                await asyncio.sleep(0.1)

    first, second = exporter(), exporter()
    try:
        await publish(nc, *turn("s1", 1000.0))
        await first.start("exporter  metrics at")
        await consumed(6)
        assert await first.terminate(DEADLINE_S) == 0, first.output()

        await publish(nc, *turn("s2", 2000.0))
        await second.start("exporter  metrics at")
        await consumed(12)
        text = await scrape(second)
        # the second process counts the second turn only: nothing lost, nothing twice
        assert 'loopmesh_events_total{type="loop_start"} 1.0' in text, text
    finally:
        await first.close()
        await second.close()
        await nc.close()
