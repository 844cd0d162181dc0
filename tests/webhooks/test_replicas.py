"""Two replicas of the service on one durable consumer, on one server and on the R3
cluster: a turn's loop_start read by one and its loop_end by the other."""

from __future__ import annotations

import msgspec
import pytest
from nats.aio.client import Client

from loopmesh.jetstream import Publisher
from loopmesh.kv import open_kv
from loopmesh.testing.durable import SUBJECTS, provision_short, wait_for
from schemas import Webhook
from schemas.events import LoopStart, decode_event
from tests.conftest import BOTH_SHARED, Durable, durable_nc
from webhooks.targets import Targets

from .conftest import consumer_settled, delivering, publish, settings, turn_events
from .receiver import receiving

pytestmark = pytest.mark.parametrize("durable", BOTH_SHARED, indirect=True)  # R1 and R3

nc = durable_nc()


@pytest.fixture
async def mesh(nc: Client, durable: Durable) -> Client:
    await provision_short(nc, replicas=durable.replicas)
    return nc


async def test_a_loop_end_read_while_another_replica_stores_its_loop_start_is_delivered(
    mesh: Client, durable: Durable
) -> None:
    """Replica A (here the test, on the same durable consumer) holds the turn's
    loop_start, not stored yet, when replica B reads the turn's loop_end."""
    js = mesh.jetstream()
    replica_a = await js.pull_subscribe_bind(SUBJECTS.webhooks_consumer, SUBJECTS.events_stream)
    async with receiving() as receiver:
        start, end = turn_events("t1", Webhook(url=receiver.url))
        await publish(mesh, start)
        (held,) = await replica_a.fetch(1, timeout=5)
        (seq,) = await publish(mesh, end)
        async with delivering(durable.url, settings()) as replica_b:
            assert replica_b._targets is not None
            targets = replica_b._targets
            await wait_for(lambda: targets.reads >= 1, what="B looked the turn up")
            # A stores the webhook, then acks its loop_start
            kv = await open_kv(js, Publisher(mesh), SUBJECTS.webhooks_bucket)
            stored = decode_event(held.data)
            assert isinstance(stored, LoopStart)
            await Targets(kv).record(stored)
            await held.ack_sync()
            await receiver.wait(lambda r: len(r.delivered) == 1, "the loop_end", timeout=10)
            await wait_for(lambda: consumer_settled(mesh), what="every event settled")
    assert receiver.delivered[0].headers["webhook-id"].endswith(f"-{seq}")
    assert msgspec.json.decode(receiver.delivered[0].body)["type"] == "loop_end"


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
