"""The shared feed: one ordered consumer per session per gateway process, fanned out
to every client of the session, with resumes handed over by sequence."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
from nats.aio.client import Client

from gateway.server import GatewayServer
from loopmesh.testing.durable import wait_for
from loopmesh.testing.sse import Message, messages
from tests.gateway.conftest import ACME_KEY, GLOBEX_KEY, auth, publish


async def ids(response: httpx.Response, n: int, *, timeout: float = 30.0) -> list[int]:
    got: list[int] = []
    async with asyncio.timeout(timeout):
        async for m in messages(response):
            assert m.event != "cut", m.data
            got.append(int(m.id or 0))
            if len(got) == n:
                break
    return got


def feed_of(gw: GatewayServer, tenant: str = "acme", session: str = "s1"):
    assert gw.gateway is not None
    return gw.gateway.fanout._feeds.get((tenant, session))


async def test_many_clients_on_one_session_share_one_feed_and_get_identical_sequences(
    gateway: GatewayServer, client: httpx.AsyncClient, nc: Client
):
    await client.post("/v1/sessions", json={"session": "s1"})
    async with contextlib.AsyncExitStack() as stack:
        streams = [
            await stack.enter_async_context(client.stream("GET", "/v1/sessions/s1/events"))
            for _ in range(12)
        ]
        assert all(r.status_code == 200 for r in streams)
        feed = feed_of(gateway)
        assert feed is not None and len(feed.listeners) == 12  # one consumer for all twelve
        assert gateway.gateway is not None and gateway.gateway.fanout.feeds() == 1
        seqs = await publish(nc, 40)
        got = await asyncio.gather(*(ids(r, 40) for r in streams))
    assert all(g == seqs for g in got)
    await wait_for(lambda: feed_of(gateway) is None, what="the feed outlived its last client")


async def test_a_client_resuming_while_events_flow_misses_none_and_gets_none_twice(
    gateway: GatewayServer, client: httpx.AsyncClient, nc: Client
):
    await client.post("/v1/sessions", json={"session": "s1"})
    total = 400
    async with client.stream("GET", "/v1/sessions/s1/events", params={"since": 0}) as live:
        seen: list[int] = []
        results: list[tuple[int, list[int]]] = []

        async def watch() -> None:
            async for m in messages(live):
                seen.append(int(m.id or 0))
                if len(seen) == total:
                    return

        async def resume_while_flowing() -> None:
            # resume at several points while the publisher runs: each time the shared
            # feed is ahead of the resumed id, so the hand-over is exercised
            for at in (20, 90, 170, 260):
                await wait_for(
                    lambda at=at: len(seen) > at, timeout=30, what="events stopped flowing"
                )
                last = seen[at]
                headers = {"Last-Event-ID": str(last)}
                async with (
                    httpx.AsyncClient(
                        base_url=gateway.url, headers=auth(ACME_KEY), timeout=30
                    ) as c2,
                    c2.stream("GET", "/v1/sessions/s1/events", headers=headers) as r,
                ):
                    want = total - (at + 1)
                    results.append((last, await ids(r, want, timeout=60)))

        watching = asyncio.create_task(watch())
        publishing = asyncio.create_task(publish(nc, total))
        await resume_while_flowing()
        seqs = await publishing
        await asyncio.wait_for(watching, 60)
    assert seen == seqs
    assert len(results) == 4
    for last, got in results:
        assert got == [s for s in seqs if s > last]


async def test_a_slow_client_is_cut_while_the_others_read_everything(gateway_at, nc: Client):
    big = "y" * 64 * 1024
    async with (
        gateway_at(stream_buffer=8) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY), timeout=30) as c,
    ):
        await c.post("/v1/sessions", json={"session": "s1"})
        async with (
            c.stream("GET", "/v1/sessions/s1/events") as stalled,
            c.stream("GET", "/v1/sessions/s1/events") as r1,
            c.stream("GET", "/v1/sessions/s1/events") as r2,
        ):
            feed = feed_of(gw)
            assert feed is not None and len(feed.listeners) == 3
            readers = [asyncio.create_task(ids(r, 300, timeout=120)) for r in (r1, r2)]
            seqs = await publish(nc, 300, text=big)
            got = await asyncio.gather(*readers)
            # every event reached both readers while the stalled client had read nothing;
            # by then the feed had already dropped it (cut), and only it
            assert got == [seqs, seqs]
            assert len(feed.listeners) == 2
            tail: list[Message] = []
            async with asyncio.timeout(60):
                async for m in messages(stalled):
                    tail.append(m)
        assert tail[-1].event == "cut"
        delivered = [int(m.id or 0) for m in tail[:-1]]
        assert delivered == seqs[: len(delivered)] and len(delivered) < len(seqs)
        assert tail[-1].json()["last_id"] == delivered[-1]


async def test_two_tenants_sessions_of_the_same_name_have_separate_feeds(
    gateway: GatewayServer, client: httpx.AsyncClient, nc: Client
):
    async with httpx.AsyncClient(base_url=gateway.url, headers=auth(GLOBEX_KEY)) as globex:
        await client.post("/v1/sessions", json={"session": "s1"})
        await globex.post("/v1/sessions", json={"session": "s1"})
        async with (
            client.stream("GET", "/v1/sessions/s1/events") as mine,
            globex.stream("GET", "/v1/sessions/s1/events") as theirs,
        ):
            assert gateway.gateway is not None and gateway.gateway.fanout.feeds() == 2
            g1 = await publish(nc, 3, tenant="globex")
            a = await publish(nc, 3)
            g2 = await publish(nc, 1, tenant="globex")
            assert await ids(mine, 3) == a
            assert await ids(theirs, 4) == g1 + g2


async def test_a_client_that_stops_reading_is_closed_after_the_send_timeout(gateway_at, nc: Client):
    big = "z" * 64 * 1024
    async with (
        gateway_at(max_streams_per_key=1, send_timeout_s=0.5, stream_buffer=4) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=auth(ACME_KEY), timeout=30) as c,
    ):
        await c.post("/v1/sessions", json={"session": "s1"})
        async with c.stream("GET", "/v1/sessions/s1/events") as stalled:
            assert stalled.status_code == 200
            await publish(nc, 200, text=big)  # far more than the socket buffers hold
            # the stalled stream keeps the key's only slot until the gateway gives up on
            # its blocked send; then a new stream is let in
            deadline = time.monotonic() + 30
            while True:
                async with c.stream("GET", "/v1/sessions/s1/events") as r:
                    status = r.status_code
                if status == 200:
                    break
                assert status == 429, status
                assert time.monotonic() < deadline, "the stalled stream was never closed"
                await asyncio.sleep(0.05)
