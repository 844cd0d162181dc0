"""``loopmesh.nats.reset``: a connection dropped with a TCP reset, then reconnected. It
reads nats-py's ``Client._transport`` (pinned 2.16): these fail when that moves."""

import httpx

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
    """The fallback: no socket to reset (here, none open), a plain reconnect."""
    nc = await connect(NatsSettings(url=nats_server.url, reconnect_wait_s=0.05))
    try:
        await nats_server.stop()
        await wait_for(lambda: not nc.is_connected, timeout=30)
        assert not await reset(nc)
        await nats_server.start()
        await wait_for(lambda: nc.is_connected, timeout=30)
    finally:
        await nc.close()
