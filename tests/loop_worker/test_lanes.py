"""A tenant's two lanes on real workers, on one server and on the R3 cluster: a
consumer made before the lanes (one filter for both) is narrowed to the interactive lane
by the first worker that sees it, the batch lane's made at the tenant's first batch
turn, and every turn it held, delivered or not, still runs."""

from __future__ import annotations

import json

import pytest
from nats.js.api import ConsumerInfo
from nats.js.errors import NotFoundError

from loopmesh.provision import ensure_consumer
from loopmesh.testing.durable import SUBJECTS, drained, wait_for
from schemas.streams import ConsumerDef
from tests.conftest import BOTH
from tests.loop_worker.durable import mesh_on, send_turn, turn

pytestmark = pytest.mark.parametrize("durable", BOTH, indirect=True)


async def test_a_consumer_of_both_lanes_is_narrowed_and_keeps_its_turns(durable):
    async with mesh_on(durable.url, replicas=durable.replicas) as mesh:
        js, stream = mesh.nc.jetstream(), SUBJECTS.turns_stream
        old = SUBJECTS.tenant_consumer("acme")
        await ensure_consumer(  # as loop workers made it before the lanes
            js,
            ConsumerDef(
                stream=stream, durable=old, filter_subject=SUBJECTS.tenant_turns("acme"),
                ack_wait_s=1.0,
            ),
        )  # fmt: skip
        ended: list[str] = []

        async def on_end(msg) -> None:
            ended.append(json.loads(msg.data)["turn_id"])

        sub = await mesh.nc.subscribe("loopmesh.events.acme.*.loop_end", cb=on_end)
        for k in range(3):
            await send_turn(mesh.nc, turn(f"t{k}", "say hi", session=f"s{k}"))
        taken = await js.pull_subscribe_bind(old, stream)
        [held] = await taken.fetch(1)  # a worker of before took t0, and died
        assert json.loads(held.data)["id"] == "t0"

        await mesh.loop_worker()
        await wait_for(lambda: {"t0", "t1", "t2"} <= set(ended), timeout=30, what="every turn")
        interactive: ConsumerInfo = await js.consumer_info(stream, old)
        assert interactive.config.filter_subject == SUBJECTS.lane_turns("acme")
        batch_consumer = SUBJECTS.tenant_consumer("acme", "batch")
        with pytest.raises(NotFoundError):  # made at the tenant's first batch turn
            await js.consumer_info(stream, batch_consumer)

        await send_turn(mesh.nc, turn("t3", "say hi", session="s0", priority="batch"))
        await wait_for(lambda: "t3" in ended, timeout=30, what="the batch turn")
        batch = await js.consumer_info(stream, batch_consumer)
        assert batch.config.filter_subject == SUBJECTS.lane_turns("acme", "batch")
        await drained(mesh.nc, stream)
        await sub.unsubscribe()
    assert sorted(set(ended)) == ["t0", "t1", "t2", "t3"]
