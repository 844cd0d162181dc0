"""A call delivered again while it still runs on the worker that has it (the cluster
stalled past AckWait, so the in-progress acks did not get through) runs once."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.js import JetStreamContext

from loopmesh.testing.durable import wait_for
from schemas import ToolResult, encode
from tool_worker import Registry, to_tool, tool

from .harness import SUBJECTS, Requester, redeliver_after, running, wait_settled


class Gated:
    """A tool ``slow`` that counts its runs and returns "done" once ``gate`` is set."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.runs = 0

        @tool(name="slow")
        async def slow() -> str:
            self.runs += 1
            await self.gate.wait()
            return "done"

        self.tool = to_tool(slow)


async def test_a_call_delivered_again_while_it_runs_runs_once_and_every_delivery_is_acked(
    nc: Client, js: JetStreamContext, requester: Requester
) -> None:
    slow = Gated()

    # The stall, made by hand: the worker sends in-progress acks every 10 s (its AckWait
    # is 30 s) while the consumer redelivers after 1 s.
    async with running(nc, Registry([slow.tool]), ack_wait_s=30.0) as worker:
        await redeliver_after(js, 1.0)
        req = requester.request("local", "slow")
        await requester.publish(req)
        await wait_for(lambda: worker.stats["joined"] >= 1, timeout=30, what="a redelivery")
        assert slow.runs == 1
        slow.gate.set()
        result = await requester.result(req.call_id, timeout=30)
        assert (result.status, result.content) == ("ok", "done")
        await wait_settled(js, "every delivery acked")
        info = await js.consumer_info(SUBJECTS.tools_stream, SUBJECTS.pool_consumer("default"))
        assert info.delivered.stream_seq == 1 and info.delivered.consumer_seq >= 2
    assert slow.runs == 1 and worker.stats["calls"] == 1


async def test_a_new_message_of_a_call_that_runs_here_is_answered_when_the_call_ends(
    nc: Client, js: JetStreamContext, requester: Requester
) -> None:
    """A resumed turn asks again (a new message, the same call id) while the first run
    has yet to be acked: the tool runs once and both messages are answered and acked.
    CI once caught the second message after the first run's reply and before its ack:
    it was acked with no answer, and its requester waited for good."""
    slow = Gated()

    async with running(nc, Registry([slow.tool])) as worker:
        req = requester.request("local", "slow")
        await requester.publish(req)
        await wait_for(lambda: slow.runs == 1, timeout=30, what="the first run")
        subject = SUBJECTS.tool("default", "local", "slow")
        await js.publish(subject, encode(req), headers={"Nats-Msg-Id": f"{req.call_id}-again"})
        await wait_for(lambda: worker.stats["joined"] >= 1, timeout=30, what="the second message")
        slow.gate.set()

        def answers() -> list[ToolResult]:
            return [r for r in requester.replies if r.call_id == req.call_id]

        await wait_for(lambda: len(answers()) >= 2, timeout=30, what="an answer to each message")
        assert [(r.status, r.content) for r in answers()] == [("ok", "done")] * 2
        await wait_settled(js, "both messages acked")
    assert slow.runs == 1 and worker.stats["calls"] == 1
