"""A turn given up on while no loop worker runs is dead-lettered when one comes back:
the give-up advisory waits in the advisories stream instead of being lost."""

from __future__ import annotations

import time

import nats.errors
import pytest

from loopmesh.provision import provision
from loopmesh.testing.durable import SUBJECTS, connect_fast, tenant_consumer_of, wait_for
from schemas import Turn, definitions
from tests.loop_worker.durable import Watch, mesh_on, send_turn

MAX_DELIVERIES = 2


@pytest.fixture
async def mesh(nats_server):
    nc = await connect_fast(nats_server.url)
    try:
        await provision(nc.jetstream(), definitions(SUBJECTS))
        await tenant_consumer_of(nc, "acme", ack_wait_s=1.0, max_deliver=MAX_DELIVERIES)
    finally:
        await nc.close()
    async with mesh_on(nats_server.url, provisioned=True) as mesh:
        yield mesh


async def messages(nc, stream: str) -> int:
    return (await nc.jetstream().stream_info(stream)).state.messages


async def test_a_turn_poisoned_while_no_loop_worker_listens_is_dead_lettered_later(mesh):
    nc, js = mesh.nc, mesh.nc.jetstream()
    turn = Turn(id="t1", tenant="acme", session="s1", input="hi", created_at=time.time())
    await send_turn(nc, turn)
    # A worker that takes the turn and dies each time, with no other loop worker around.
    crashing = await js.pull_subscribe_bind(SUBJECTS.tenant_consumer("acme"), SUBJECTS.turns_stream)
    deliveries = 0

    async def given_up() -> bool:
        nonlocal deliveries
        try:
            deliveries += len(await crashing.fetch(1, timeout=0.5))  # never acked
        except nats.errors.TimeoutError:
            pass
        return await messages(nc, SUBJECTS.advisories_stream) >= 1

    await wait_for(given_up, timeout=30, what="the max-deliveries advisory to be stored")
    await crashing.unsubscribe()
    assert deliveries == MAX_DELIVERIES
    assert await messages(nc, SUBJECTS.turns_stream) == 1  # nobody dead-lettered it yet
    assert await messages(nc, SUBJECTS.deadletter_stream) == 0

    async with Watch(nc) as watch:
        await mesh.loop_worker(max_deliveries=MAX_DELIVERIES, ack_wait_s=1.0)  # a worker is back
        end = await watch.wait("loop_end", "t1", timeout=30)
        [error] = watch.of("error", "t1")

    assert end.reason == "error" and f"{MAX_DELIVERIES} times" in (end.error or "")
    assert error.code == "dead_letter"
    record = await js.get_msg(SUBJECTS.deadletter_stream, 1)
    assert (record.headers or {})["Loopmesh-Deliveries"] == str(MAX_DELIVERIES)
    assert b'"id":"t1"' in (record.data or b"")

    async def all_handled() -> bool:
        turns = await messages(nc, SUBJECTS.turns_stream)
        return turns == 0 and await messages(nc, SUBJECTS.advisories_stream) == 0

    await wait_for(all_handled, timeout=30, what="the turn deleted and its advisory acked")
