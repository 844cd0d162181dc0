"""Which webhook a turn has, when its ``loop_start`` was read elsewhere: by another
replica still storing it, by a process that died holding it, or by one whose write of
it failed. The later events of the turn wait for it; none is dropped as webhook-less."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client

from loopmesh.jetstream import Publisher
from loopmesh.kv import open_kv
from loopmesh.provision import ensure_consumer
from loopmesh.testing.durable import SUBJECTS, connect_fast, provision_short, wait_for
from schemas import Webhook, turn_msg_id
from schemas.events import LoopStart, decode_event
from schemas.streams import webhooks_consumer
from tests.conftest import BOTH, Durable
from webhooks.targets import Targets

from .conftest import consumer_settled, delivering, publish, settings, turn_events
from .receiver import receiving


async def _set_max_msg_size(client: Client, stream: str, size: int) -> None:
    js = client.jetstream()
    config = (await js.stream_info(stream)).config
    config.max_msg_size = size
    await js.update_stream(config)


async def test_a_webhook_whose_first_write_failed_is_stored_when_its_loop_start_comes_back(
    nc: Client, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The first write fails (the bucket refuses it, as a leader election would time it
    out); the loop_start is handed back and stored on its next delivery, so a restarted
    service finds the webhook when the turn ends."""
    bucket = f"KV_{SUBJECTS.webhooks_bucket}"
    caplog.set_level(logging.WARNING, logger="loopmesh.webhooks")
    async with receiving() as receiver:
        start, end = turn_events("t1", Webhook(url=receiver.url))
        await _set_max_msg_size(nc, bucket, 8)  # every write of a webhook refused
        async with delivering(nats_url, settings()):
            await publish(nc, start)
            await wait_for(
                lambda: "webhook of turn t1 not stored" in caplog.text, what="a failed write"
            )
            await _set_max_msg_size(nc, bucket, -1)
            await wait_for(lambda: consumer_settled(nc), what="the loop_start settled")

        kv = await open_kv(nc.jetstream(), Publisher(nc), SUBJECTS.webhooks_bucket)
        stored = await kv.entry(turn_msg_id("acme", "s1", "t1"))
        assert stored is not None and stored.value is not None
        assert msgspec.json.decode(stored.value, type=Webhook) == start.webhook

        async with delivering(nats_url, settings()):  # a restart: nothing in memory
            (seq,) = await publish(nc, end)
            await receiver.wait(lambda r: len(r.delivered) == 1, "the loop_end", timeout=10)
    assert receiver.delivered[0].headers["webhook-id"].endswith(f"-{seq}")


@pytest.fixture
async def mesh(durable: Durable) -> AsyncIterator[Client]:
    """A client of ``durable`` (one server, or the R3 cluster), provisioned to match."""
    client = await connect_fast(durable.url)
    try:
        await provision_short(client, replicas=durable.replicas)
        yield client
    finally:
        await client.close()


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_a_loop_end_read_while_another_replica_stores_its_loop_start_is_delivered(
    mesh: Client, durable: Durable
) -> None:
    """Replica A (here the test, on the same durable consumer) holds the turn's
    loop_start, not stored yet, when replica B reads the turn's loop_end."""
    nc, nats_url = mesh, durable.url
    js = nc.jetstream()
    replica_a = await js.pull_subscribe_bind(SUBJECTS.webhooks_consumer, SUBJECTS.events_stream)
    async with receiving() as receiver:
        start, end = turn_events("t1", Webhook(url=receiver.url))
        await publish(nc, start)
        (held,) = await replica_a.fetch(1, timeout=5)
        (seq,) = await publish(nc, end)
        async with delivering(nats_url, settings()) as replica_b:
            assert replica_b._targets is not None
            targets = replica_b._targets
            await wait_for(lambda: targets.reads >= 1, what="B looked the turn up")
            # A stores the webhook, then acks its loop_start
            kv = await open_kv(js, Publisher(nc), SUBJECTS.webhooks_bucket)
            stored = decode_event(held.data)
            assert isinstance(stored, LoopStart)
            await Targets(kv).record(stored)
            await held.ack_sync()
            await receiver.wait(lambda r: len(r.delivered) == 1, "the loop_end", timeout=10)
            await wait_for(lambda: consumer_settled(nc), what="every event settled")
    assert receiver.delivered[0].headers["webhook-id"].endswith(f"-{seq}")
    assert msgspec.json.decode(receiver.delivered[0].body)["type"] == "loop_end"


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_two_replicas_deliver_each_turns_loop_end_once(
    mesh: Client, durable: Durable
) -> None:
    async with receiving() as receiver:
        hook = Webhook(url=receiver.url)
        async with delivering(durable.url, settings()), delivering(durable.url, settings()):
            ends = []
            for i in range(12):
                ends += (await publish(mesh, *turn_events(f"t{i}", hook, session=f"s{i}")))[1:]
            await receiver.wait(lambda r: len(r.delivered) == 12, "every loop_end", timeout=30)
            await wait_for(lambda: consumer_settled(mesh), timeout=30, what="every event settled")
    sequences = sorted(int(r.headers["webhook-id"].rsplit("-", 1)[1]) for r in receiver.requests)
    assert sequences == sorted(ends)


async def test_a_loop_start_held_by_a_process_that_died_still_gives_its_turn_a_delivery(
    nc: Client, nats_url: str
) -> None:
    """A process fetched the loop_start and died before storing it: the loop_start comes
    back after the consumer's AckWait, and the turn's loop_end, read meanwhile by the
    next process, waits for it."""
    short = msgspec.structs.replace(webhooks_consumer(SUBJECTS), ack_wait_s=2.0)
    await ensure_consumer(nc.jetstream(), short)
    dead = await nc.jetstream().pull_subscribe_bind(
        SUBJECTS.webhooks_consumer, SUBJECTS.events_stream
    )
    async with receiving() as receiver:
        start, end = turn_events("t1", Webhook(url=receiver.url))
        await publish(nc, start)
        await dead.fetch(1, timeout=5)  # never acked: the process is gone
        (seq,) = await publish(nc, end)
        async with delivering(nats_url, settings()):
            await receiver.wait(lambda r: len(r.delivered) == 1, "the loop_end", timeout=15)
            await wait_for(lambda: consumer_settled(nc), what="every event settled")
    assert receiver.delivered[0].headers["webhook-id"].endswith(f"-{seq}")
