"""A durable pull consumer's deliveries are handed over as they arrive: a fetch neither
waits for its batch to fill nor for its pull requests to expire, never asks for more
than the room it is given, pulls again when a request expires, and what it was given
and not taken goes back to the consumer on close."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from loopmesh.pull import Pull
from loopmesh.testing.durable import connect_fast, wait_for

STREAM, CONSUMER = "WORK", "workers"
HOUR_S = 3600.0  # a request or a fetch that lasts longer than any test


@pytest.fixture
async def nc(nats_server) -> AsyncIterator[Client]:
    client = await connect_fast(nats_server.url)
    js = client.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=["work.>"], retention="workqueue"))
    await js.add_consumer(
        STREAM,
        ConsumerConfig(durable_name=CONSUMER, ack_policy=AckPolicy.EXPLICIT, ack_wait=HOUR_S),
    )
    try:
        yield client
    finally:
        await client.close()


async def publish(nc: Client, *names: str) -> None:
    for name in names:
        await nc.jetstream().publish(f"work.{name}", name.encode())


async def pending(nc: Client) -> int:
    """Messages the consumer has not delivered to anyone."""
    return (await nc.jetstream().consumer_info(STREAM, CONSUMER)).num_pending


async def test_a_delivery_is_handed_over_before_the_batch_fills_or_the_request_expires(nc):
    async with Pull(nc, STREAM, CONSUMER, expires_s=HOUR_S) as pull:
        fetching = asyncio.ensure_future(pull.fetch(64, timeout=HOUR_S))
        await wait_for(lambda: pull.outstanding == 64, what="a pull request for 64")
        await publish(nc, "a")
        got = await asyncio.wait_for(fetching, timeout=30)  # not the hour it may wait
        assert [m.data for m in got] == [b"a"]
        await publish(nc, "b", "c")
        taken = []
        while len(taken) < 2:
            taken += await asyncio.wait_for(pull.fetch(63, timeout=HOUR_S), timeout=30)
        assert sorted(m.data for m in taken) == [b"b", b"c"]
        assert pull.stats["requests"] == 1  # the first request, still open, delivered all


async def test_it_never_holds_more_than_the_room_it_is_given(nc):
    """An owner with room for 3 is delivered 3 of 10; the other 7 stay with the
    consumer, for anyone."""
    await publish(nc, *(f"m{i}" for i in range(10)))
    async with Pull(nc, STREAM, CONSUMER, expires_s=HOUR_S) as pull:
        held = []
        while len(held) < 3:
            held += await pull.fetch(3 - len(held), timeout=30)
        assert len(held) == 3
        await wait_for(lambda: pull.outstanding == 0, what="no request left open")
        assert await pending(nc) == 7
        other = await nc.jetstream().pull_subscribe_bind(CONSUMER, STREAM)
        rest = await other.fetch(10, timeout=5)
        assert len(rest) == 7
        assert {m.data for m in held} | {m.data for m in rest} == {
            f"m{i}".encode() for i in range(10)
        }


async def test_a_request_that_expires_is_made_again_within_the_fetch(nc):
    async with Pull(nc, STREAM, CONSUMER, expires_s=0.1) as pull:
        fetching = asyncio.ensure_future(pull.fetch(8, timeout=HOUR_S))
        await wait_for(lambda: pull.stats["ended"] >= 2, what="two requests expired")
        assert not fetching.done()
        await publish(nc, "late")
        got = await asyncio.wait_for(fetching, timeout=30)
        assert [m.data for m in got] == [b"late"]
        assert pull.stats["requests"] > pull.stats["ended"] >= 2


async def test_what_was_delivered_and_not_taken_goes_back_on_close(nc):
    """The consumer's AckWait is an hour: a delivery dropped on close would not come
    back within the test; nakked, it goes to the next puller at once."""
    pull = Pull(nc, STREAM, CONSUMER, expires_s=HOUR_S)
    await pull.start()
    await pull.fetch(4, timeout=1)  # a request for 4 is open; nothing to take yet
    await publish(nc, "w", "x", "y", "z")
    await wait_for(lambda: pull.outstanding == 0, what="all four delivered")
    taken = await pull.fetch(1, timeout=30)
    assert len(taken) == 1
    await pull.close()
    await pull.close()  # idempotent
    other = await nc.jetstream().pull_subscribe_bind(CONSUMER, STREAM)
    back: list = []
    while len(back) < 3:
        back += await other.fetch(3 - len(back), timeout=30)
    assert sorted(m.data for m in back + taken) == [b"w", b"x", b"y", b"z"]
    assert all(m.metadata.num_delivered == 2 for m in back)
