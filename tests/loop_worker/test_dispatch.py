import asyncio
import time

import msgspec
import pytest

from loop_worker.dispatch import NatsToolDispatcher
from loopmesh.jetstream import Publisher
from loopmesh.testing.durable import SUBJECTS, drained, provision_short, wait_for
from schemas import ToolCallRequest, ToolResult, catalog_key, encode
from tests.loop_worker.durable import fake_pool, register_tool, spec


def request(call_id: str = "t1-1-0", tool: str = "echo", **kw) -> ToolCallRequest:
    return ToolCallRequest(
        call_id=call_id, tenant="acme", session="s1", turn_id="t1", iteration=1,
        server="local", tool=tool, arguments=kw or {"text": "hi"},
    )  # fmt: skip


async def echo(req: ToolCallRequest) -> str:
    return str(req.arguments.get("text", ""))


@pytest.fixture
async def dispatcher(nc):
    await provision_short(nc)
    await register_tool(nc, spec("echo"))
    async with NatsToolDispatcher(nc, SUBJECTS, grace_s=0.5, effect_poll_s=0.2) as d:
        yield d


async def serve(nc, dispatcher, tool_spec) -> None:
    """Register a tool and wait for the dispatcher's catalog to hold it: a call made
    before the catalog's watch delivers the new entry is an `unknown_tool`."""
    await register_tool(nc, tool_spec)
    key = catalog_key(tool_spec.server, tool_spec.name)
    assert await dispatcher.catalog.wait_for(lambda c: c.get(key) is not None, 30), key


async def test_tools_lists_the_catalog_and_sees_new_entries_as_they_are_put(nc, dispatcher):
    assert [t.name for t in await dispatcher.tools()] == ["echo"]
    await register_tool(nc, spec("other", pool="slow"))
    assert await dispatcher.catalog.wait_for(lambda c: c.get("local.other") is not None, 5)
    assert sorted(t.name for t in await dispatcher.tools()) == ["echo", "other"]


async def test_a_call_goes_to_the_pool_named_in_the_catalog_with_the_call_id_as_msg_id(
    nc, dispatcher
):
    await serve(nc, dispatcher, spec("ping", pool="fast"))
    async with fake_pool(nc, echo, pool="fast") as ran:
        result = await dispatcher.call(request("t1-1-0", tool="ping", text="pong"))
    assert result.status == "ok" and result.content == "pong"
    assert [r.call_id for r in ran] == ["t1-1-0"]
    # acked off the work queue (the pool replies first, then acks: a moment after)
    await drained(nc, SUBJECTS.tools_stream)


async def test_an_unknown_tool_is_an_error_result_and_nothing_is_published(nc, dispatcher):
    result = await dispatcher.call(request(tool="nope"))
    assert result.status == "error" and result.error and result.error.code == "unknown_tool"
    info = await nc.jetstream().stream_info(SUBJECTS.tools_stream)
    assert info.state.last_seq == 0


async def test_a_recorded_effect_is_returned_without_running_the_tool_again(nc, dispatcher):
    effects = await nc.jetstream().key_value(SUBJECTS.effects_bucket)
    await effects.put("t1-1-0", encode(ToolResult(call_id="t1-1-0", content="from before")))
    result = await dispatcher.call(request())
    assert result.content == "from before"
    info = await nc.jetstream().stream_info(SUBJECTS.tools_stream)
    assert info.state.last_seq == 0


async def test_a_lost_reply_is_recovered_from_the_effect_record(nc, dispatcher):
    async with fake_pool(nc, echo, reply=False) as ran:
        # The call may wait 120 s: only the effect poll can answer it within the deadline.
        async with asyncio.timeout(30):
            slow = msgspec.structs.replace(request(text="quiet"), timeout_s=120)
            result = await dispatcher.call(slow)
    assert result.status == "ok" and result.content == "quiet" and len(ran) == 1


async def test_a_call_nobody_serves_times_out_by_its_deadline(nc, dispatcher):
    await serve(nc, dispatcher, spec("stuck", pool="nobody", timeout_s=0.3))
    started = time.monotonic()
    async with asyncio.timeout(30):
        result = await dispatcher.call(request(tool="stuck"))
    assert result.status == "timeout" and result.error and result.error.code == "timeout"
    assert time.monotonic() - started >= 0.7  # not before timeout 0.3 + grace 0.5


async def test_the_same_call_published_twice_runs_once(nc, dispatcher):
    calls = 0
    gate = asyncio.Event()

    async def slow(req: ToolCallRequest) -> str:
        nonlocal calls
        calls += 1
        await gate.wait()
        return "done"

    async with fake_pool(nc, slow) as ran:
        first = asyncio.create_task(dispatcher.call(request()))
        async with NatsToolDispatcher(nc, SUBJECTS, grace_s=0.5, effect_poll_s=0.1) as other:
            second = asyncio.create_task(other.call(request()))  # a resumed turn's repeat
            await wait_for(lambda: bool(ran), what="the tool to start")
            gate.set()
            results = await asyncio.gather(first, second)
    assert [r.content for r in results] == ["done", "done"]
    assert calls == 1


async def test_cancelling_a_call_ends_the_wait_at_once(nc, dispatcher):
    await serve(nc, dispatcher, spec("stuck", pool="nobody", timeout_s=30))
    task = asyncio.create_task(dispatcher.call(request(tool="stuck")))
    await wait_for(
        lambda: bool(dispatcher._waiting) or task.done(), timeout=30, what="the call to wait"
    )
    assert not task.done(), task.result()  # it ended without waiting: say how
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):  # the call itself would wait 30 s
            await task
    assert not dispatcher._waiting


class LossyPublisher(Publisher):
    """Drops the acks of the first ``lose`` tool-call publishes (as a reconnect would)."""

    def __init__(self, nc, lose: int = 1) -> None:
        super().__init__(nc)
        self.lose = lose
        self.tool_publishes: list[str] = []
        self._lost_tokens: set[str] = set()

    async def _send(self, subject, payload, headers, ack):
        future = await super()._send(subject, payload, headers, ack)
        if subject.startswith(f"{SUBJECTS.prefix}.tools."):
            self.tool_publishes.append(headers["Nats-Msg-Id"])
            if self.lose:
                self.lose -= 1
                self._lost_tokens.add(str(self._n))
        return future

    async def _on_reply(self, msg) -> None:
        if msg.subject.rpartition(".")[2] in self._lost_tokens:
            return  # the ack never arrives
        await super()._on_reply(msg)


async def test_a_publish_whose_ack_is_lost_is_published_again_and_runs_once(nc, dispatcher):
    publisher = LossyPublisher(nc)
    async with NatsToolDispatcher(
        nc, SUBJECTS, grace_s=0.5, effect_poll_s=0.1, publisher=publisher
    ) as lossy:
        call = asyncio.create_task(lossy.call(request(text="again")))
        # nobody serves the pool yet: no reply, no ack -> the request goes out again
        await wait_for(lambda: len(publisher.tool_publishes) >= 2, what="a second publish")
        async with fake_pool(nc, echo) as ran:
            result = await call
    assert result.status == "ok" and result.content == "again"
    assert set(publisher.tool_publishes) == {"t1-1-0"}  # the same Nats-Msg-Id each time
    assert [r.call_id for r in ran] == ["t1-1-0"]  # the stream kept one copy
    info = await nc.jetstream().stream_info(SUBJECTS.tools_stream)
    assert info.state.last_seq == 1


@pytest.mark.parametrize("fenced", [False, True], ids=["holding", "lapsed"])
async def test_a_turn_whose_lease_lapsed_sends_no_copy_of_its_request(nc, dispatcher, fenced):
    """The copy a lost ack would send goes out only while the turn may write (the
    service's fence): a worker cut off past its lease's lapse publishes nothing more."""
    publisher = LossyPublisher(nc, lose=10)  # no ack ever: each poll would send a copy
    may_write = {"acme.s1.t1": True}
    async with NatsToolDispatcher(
        nc, SUBJECTS, grace_s=0.5, effect_poll_s=0.1, publisher=publisher,
        writable=lambda key: may_write[key],
    ) as lossy:  # fmt: skip
        call = asyncio.create_task(lossy.call(request(text="again")))
        await wait_for(lambda: len(publisher.tool_publishes) >= 1, what="the first publish")
        may_write["acme.s1.t1"] = not fenced
        await asyncio.sleep(1.0)  # ten polls, each of which would publish a copy
        sent = len(publisher.tool_publishes)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    assert (sent == 1) if fenced else (sent > 2), sent


async def test_the_reply_is_not_held_up_by_a_missing_ack(nc, dispatcher):
    publisher = LossyPublisher(nc)
    async with (
        NatsToolDispatcher(
            nc, SUBJECTS, grace_s=0.5, effect_poll_s=60.0, publisher=publisher
        ) as lossy,
        fake_pool(nc, echo) as ran,
        asyncio.timeout(20),  # held up, it would wait for the poll or the deadline (30 s)
    ):
        result = await lossy.call(request(text="fast"))
    assert result.content == "fast" and len(ran) == 1
    assert publisher.tool_publishes == ["t1-1-0"]  # never published again


async def test_a_first_run_marks_its_calls_first_attempt_and_a_resumed_run_does_not(nc):
    """The tool worker skips the effect read for first attempts: only a turn's first
    run may say so, only when the dispatcher does not read effects first itself, and
    only while the worker surely holds the session (``unlapsed``)."""
    await provision_short(nc)
    await register_tool(nc, spec("echo"))
    held = {"t1": True, "t2": False}
    async with (
        NatsToolDispatcher(
            nc, SUBJECTS, grace_s=0.5, effects_first=False,
            unlapsed=lambda r: held[r.turn_id],
        ) as fresh,
        NatsToolDispatcher(nc, SUBJECTS, grace_s=0.5) as careful,
        fake_pool(nc, echo) as ran,
    ):  # fmt: skip
        await fresh.call(request("t1-1-0"))
        fresh.resuming("acme.s1.t1")
        await fresh.call(request("t1-2-0"))
        fresh.resuming("acme.s1.t1", False)
        await fresh.call(request("t1-3-0"))
        await fresh.call(msgspec.structs.replace(request("t2-1-0"), turn_id="t2"))
        await careful.call(request("t1-4-0"))
    assert [(r.call_id, r.first_attempt) for r in ran] == [
        ("t1-1-0", True), ("t1-2-0", False), ("t1-3-0", True), ("t2-1-0", False),
        ("t1-4-0", False),
    ]  # fmt: skip
