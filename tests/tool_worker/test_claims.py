"""Claims on a replicated effects bucket: of two deliveries of one call at once, one
runs it; a later delivery, or a new message of the same call id, takes it over once the
claim has gone unrenewed for AckWait."""

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from loopmesh.cluster import NatsCluster
from loopmesh.jetstream import KV, Publisher
from loopmesh.provision import has_msg_ttl, provision
from loopmesh.testing.durable import SUBJECTS, connect_fast, provision_short, wait_for
from schemas import definitions
from tool_worker import Registry
from tool_worker.claims import Claim, Claims

from .harness import Requester, redeliver_after, running, wait_settled
from .test_redelivery import Gated

pytestmark = pytest.mark.slow

ACK_WAIT = 1.0


@pytest.fixture
async def two(nats_cluster: NatsCluster) -> AsyncIterator[tuple[Claims, Claims, Publisher]]:
    """The claims of two workers, ``a`` and ``b``, on the cluster's effects bucket."""
    nc = await connect_fast(nats_cluster.url)
    publisher = Publisher(nc)
    try:
        await provision_short(nc, replicas=3)
        a = await Claims.open(nc, publisher, SUBJECTS, "worker-a", ack_wait_s=ACK_WAIT)
        b = await Claims.open(nc, publisher, SUBJECTS, "worker-b", ack_wait_s=ACK_WAIT)
        yield a, b, publisher
    finally:
        await publisher.close()
        await nc.close()


async def test_a_later_delivery_takes_a_claim_over_only_once_it_has_aged(two):
    a, b, _ = two
    assert await a.take("c1", seq=5, delivery=1)
    assert not await b.take("c1", seq=5, delivery=1)  # the same delivery, twice at once
    # delivered again at once by a new consumer leader, while a runs it
    assert not await b.take("c1", seq=5, delivery=2)
    assert not await b.take("c1", seq=9, delivery=1)  # a new message, as fresh
    await asyncio.sleep(ACK_WAIT + 0.1)  # a died: its claim ages
    assert await b.take("c1", seq=5, delivery=2)  # redelivered after AckWait
    assert not await a.take("c1", seq=5, delivery=2)
    assert not await a.take("c1", seq=5, delivery=1)  # a stale delivery
    await asyncio.sleep(ACK_WAIT + 0.1)
    assert await a.take("c1", seq=9, delivery=1)  # published again: a new message


async def test_a_claim_renewed_while_its_call_runs_is_not_taken_over(two):
    a, b, publisher = two
    assert await a.take("c1", seq=5, delivery=1)
    for _ in range(6):  # the call runs for 3 AckWaits, renewed each half
        await asyncio.sleep(ACK_WAIT / 2)
        await a.renew(older_than=ACK_WAIT / 3)
        assert not await b.take("c1", seq=5, delivery=2)
    a.end("c1")  # the call ended: no more renewals
    await a.renew()
    await asyncio.sleep(ACK_WAIT + 0.1)
    assert await b.take("c1", seq=5, delivery=3)
    # a worker whose claim was taken over gives it up, and overwrites nothing
    assert await a.take("c2", seq=6, delivery=1)
    await asyncio.sleep(ACK_WAIT + 0.1)
    assert await b.take("c2", seq=6, delivery=2)
    await a.renew()
    await a.renew()
    kv = KV(publisher, SUBJECTS.effects_bucket, leader=True)
    entry = await kv.entry("claim.c2")
    assert entry is not None and entry.value is not None
    assert msgspec.json.decode(entry.value, type=Claim).worker == "worker-b"


async def test_on_one_server_no_claim_is_written(nats_server, nc):
    await provision_short(nc)
    publisher = Publisher(nc)
    try:
        claims = await Claims.open(nc, publisher, SUBJECTS, "worker-a")
        assert await claims.take("c1", seq=5, delivery=1)
        assert await claims.take("c1", seq=5, delivery=1)
        info = await nc.jetstream().stream_info(f"KV_{SUBJECTS.effects_bucket}")
        assert info.state.messages == 0
    finally:
        await publisher.close()


async def test_a_call_delivered_to_another_worker_while_it_runs_runs_once(nats_cluster):
    """The consumer delivers a running call again (its in-progress acks lost, as when
    its leader is killed: the chaos suite saw two workers start one call 13 ms apart on
    nats-server 2.10). The other worker finds the claim renewed and leaves the call to
    the worker running it, which answers and acks it."""
    nc = await connect_fast(nats_cluster.url)
    other = await connect_fast(nats_cluster.url)
    js = nc.jetstream()
    slow = Gated()
    try:
        await provision(js, definitions(SUBJECTS, replicas=3), msg_ttl=has_msg_ttl(nc))
        async with (
            Requester(nc) as requester,
            running(nc, Registry([slow.tool]), ack_wait_s=30.0) as a,
            running(other, Registry([slow.tool]), ack_wait_s=30.0) as b,
        ):
            # The lost in-progress acks, made by hand: the workers send them every 10 s
            # (and renew their claims) while the consumer redelivers after 1 s.
            await redeliver_after(js, 1.0)
            req = requester.request("local", "slow")
            await requester.publish(req)
            await wait_for(lambda: slow.runs == 1, timeout=30, what="the first run")
            left = lambda: a.stats["left"] + b.stats["left"]  # noqa: E731
            await wait_for(lambda: left() >= 1, timeout=30, what="a delivery to the other")
            assert slow.runs == 1
            slow.gate.set()
            result = await requester.result(req.call_id, timeout=30)
            assert (result.status, result.content) == ("ok", "done")
            await wait_settled(js, "the call acked")
        assert slow.runs == 1 and a.stats["calls"] + b.stats["calls"] == 1
    finally:
        await other.close()
        await nc.close()
