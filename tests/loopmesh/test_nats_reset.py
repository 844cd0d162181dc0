"""``loopmesh.nats.reset``: a connection dropped with a TCP reset, then reconnected. It
reads nats-py's ``Client._transport`` (pinned 2.16): these fail when that moves."""

import asyncio

import httpx
import pytest

from loopmesh.nats import connect, reset
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import wait_for


async def connections(server) -> list[int]:
    async with httpx.AsyncClient() as http:
        connz = (await http.get(f"{server.monitor_url}/connz")).json()
    return [c["cid"] for c in connz["connections"]]


async def test_a_reset_drops_the_connection_and_the_client_reconnects(nats_server):
    nc = await connect(NatsSettings(url=nats_server.url, reconnect_wait_s=0.05))
    try:
        before = await connections(nats_server)
        assert await reset(nc)  # nats-py 2.16 shows its socket where reset looks
        await wait_for(lambda: nc.is_connected and nc.stats["reconnects"] == 1, timeout=30)
        after = await connections(nats_server)
        assert len(after) == 1 and after != before  # a new connection, the old one gone

        async def pong(msg) -> None:
            await msg.respond(b"pong")

        sub = await nc.subscribe("ping", cb=pong)
        assert (await nc.request("ping", b"", timeout=5)).data == b"pong"
        await sub.unsubscribe()
    finally:
        await nc.close()


async def test_a_client_already_reconnecting_is_left_to_it(nats_server):
    """Its socket is closed already (a second lease that lapsed during the reconnect a
    reset started): nothing to reset, and the client still reconnects."""
    nc = await connect(NatsSettings(url=nats_server.url, reconnect_wait_s=0.05))
    try:
        await nats_server.stop()
        await wait_for(lambda: not nc.is_connected, timeout=30)
        assert not await reset(nc)
        await nats_server.start()
        await wait_for(lambda: nc.is_connected, timeout=30)
    finally:
        await nc.close()


def test_a_reset_finds_the_socket_on_uvloop_too(nats_server):
    """The services run on uvloop (``[runtime] event_loop``), whose transports show
    their socket as uvloop's own object: it takes the linger option as well."""
    uvloop = pytest.importorskip("uvloop")

    async def reset_once() -> bool:
        nc = await connect(NatsSettings(url=nats_server.url, reconnect_wait_s=0.05))
        try:
            made = await reset(nc)
            await wait_for(lambda: nc.is_connected and nc.stats["reconnects"] == 1, timeout=30)
            return made
        finally:
            await nc.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(reset_once())
