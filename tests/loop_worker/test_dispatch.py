import asyncio
import time

import pytest

from loop_worker.dispatch import NatsToolDispatcher
from schemas import ToolCallRequest, ToolResult, encode
from tests.loop_worker.durable import (
    SUBJECTS,
    fake_pool,
    provision_short,
    register_tool,
    spec,
    wait_for,
)


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


async def test_tools_lists_the_catalog_and_sees_new_entries_on_reload(nc, dispatcher):
    assert [t.name for t in await dispatcher.tools()] == ["echo"]
    await register_tool(nc, spec("other", pool="slow"))
    await dispatcher.reload()
    assert sorted(t.name for t in await dispatcher.tools()) == ["echo", "other"]


async def test_a_call_goes_to_the_pool_named_in_the_catalog_with_the_call_id_as_msg_id(
    nc, dispatcher
):
    await register_tool(nc, spec("ping", pool="fast"))
    async with fake_pool(nc, echo, pool="fast") as ran:
        result = await dispatcher.call(request("t1-1-0", tool="ping", text="pong"))
    assert result.status == "ok" and result.content == "pong"
    assert [r.call_id for r in ran] == ["t1-1-0"]
    msgs = await nc.jetstream().stream_info(SUBJECTS.tools_stream)
    assert msgs.state.messages == 0  # acked off the work queue


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
        started = time.monotonic()
        result = await dispatcher.call(request(text="quiet"))
    assert result.content == "quiet" and len(ran) == 1
    assert time.monotonic() - started < 2.0


async def test_a_call_nobody_serves_times_out_by_its_deadline(nc, dispatcher):
    await register_tool(nc, spec("stuck", pool="nobody", timeout_s=0.3))
    started = time.monotonic()
    result = await dispatcher.call(request(tool="stuck"))
    assert result.status == "timeout" and result.error and result.error.code == "timeout"
    assert 0.7 <= time.monotonic() - started < 2.0  # timeout 0.3 + grace 0.5


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
    await register_tool(nc, spec("stuck", pool="nobody", timeout_s=30))
    task = asyncio.create_task(dispatcher.call(request(tool="stuck")))
    await wait_for(lambda: bool(dispatcher._waiting), what="the call to wait")
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 0.1
    assert not dispatcher._waiting
