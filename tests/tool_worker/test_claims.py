"""Claims on a replicated effects bucket: of two deliveries of one call at once, one
runs it; a later delivery, or a new message of the same call id, takes it over."""

import pytest

from loopmesh.jetstream import Publisher
from loopmesh.testing.durable import SUBJECTS, connect_fast, provision_short
from tool_worker.claims import Claims

pytestmark = pytest.mark.slow


async def test_one_delivery_of_a_call_claims_it_and_a_later_one_takes_it_over(nats_cluster):
    nc = await connect_fast(nats_cluster.url)
    publisher = Publisher(nc)
    try:
        await provision_short(nc, replicas=3)
        a = await Claims.open(nc, publisher, SUBJECTS, "worker-a")
        b = await Claims.open(nc, publisher, SUBJECTS, "worker-b")
        assert await a.take("c1", seq=5, delivery=1)
        assert not await b.take("c1", seq=5, delivery=1)  # the same delivery, twice at once
        assert await a.take("c1", seq=5, delivery=1)  # a's own claim (a retried write)
        assert await b.take("c1", seq=5, delivery=2)  # redelivered: a died or stalled
        assert not await a.take("c1", seq=5, delivery=2)
        assert not await a.take("c1", seq=5, delivery=1)  # a stale delivery
        assert await a.take("c1", seq=9, delivery=1)  # published again: a new message
    finally:
        await publisher.close()
        await nc.close()


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
