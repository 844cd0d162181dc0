"""A call delivered again while it still runs on the worker that has it (the cluster
stalled past AckWait, so the in-progress acks did not get through) runs once."""

from __future__ import annotations

import asyncio
import dataclasses

from nats.aio.client import Client
from nats.js import JetStreamContext

from loopmesh.testing.durable import wait_for
from tool_worker import Registry, to_tool, tool

from .harness import SUBJECTS, Requester, running


async def test_a_call_delivered_again_while_it_runs_runs_once_and_every_delivery_is_acked(
    nc: Client, js: JetStreamContext, requester: Requester
) -> None:
    gate = asyncio.Event()
    runs = 0

    @tool(name="slow")
    async def slow() -> str:
        nonlocal runs
        runs += 1
        await gate.wait()
        return "done"

    # The stall, made by hand: the worker sends in-progress acks every 10 s (its AckWait
    # is 30 s) while the consumer redelivers after 1 s.
    async with running(nc, Registry([to_tool(slow)]), ack_wait_s=30.0) as worker:
        durable = SUBJECTS.pool_consumer("default")
        info = await js.consumer_info(SUBJECTS.tools_stream, durable)
        await js.add_consumer(SUBJECTS.tools_stream, dataclasses.replace(info.config, ack_wait=1.0))
        req = requester.request("local", "slow")
        await requester.publish(req)
        await wait_for(lambda: worker.stats["joined"] >= 1, timeout=30, what="a redelivery")
        assert runs == 1
        gate.set()
        result = await requester.result(req.call_id, timeout=30)
        assert (result.status, result.content) == ("ok", "done")

        async def settled() -> bool:
            info = await js.consumer_info(SUBJECTS.tools_stream, durable)
            return info.num_ack_pending == 0 and info.num_pending == 0

        await wait_for(settled, timeout=30, what="every delivery acked")
        info = await js.consumer_info(SUBJECTS.tools_stream, durable)
        assert info.delivered.stream_seq == 1 and info.delivered.consumer_seq >= 2
    assert runs == 1 and worker.stats["calls"] == 1
