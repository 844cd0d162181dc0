"""Which webhook a turn has, when its ``loop_start`` was read elsewhere: by another
replica still storing it, by a process that died holding it, or by one whose write of
it failed. The later events of the turn wait for it; none is dropped as webhook-less."""

from __future__ import annotations

import logging

import msgspec
import pytest
from nats.aio.client import Client

from loopmesh.jetstream import Publisher
from loopmesh.kv import open_kv
from loopmesh.provision import ensure_consumer
from loopmesh.testing.durable import SUBJECTS, wait_for
from schemas import Webhook, turn_msg_id
from schemas.streams import webhooks_consumer

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
