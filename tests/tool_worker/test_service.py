"""The pool service against a real nats-server, worker in this process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo

from loopmesh.testing.durable import kv_read, wait_for
from schemas import ToolCallRequest, ToolResult, decode, encode
from schemas.events import ToolErrorEvent, ToolResultEvent, ToolTimeout, tool_event_msg_id
from tests.conftest import BOTH_SHARED, Durable, durable_nc
from tool_worker import Registry, load_module, to_tool, tool
from tool_worker.builtins import builtin_tools

from .harness import SUBJECTS, EventLog, Requester, running

pytestmark = pytest.mark.parametrize("durable", BOTH_SHARED, indirect=True)  # R1 and R3

IN_PROCESS = 10158  # JetStream: a message with this id is still being stored


nc = durable_nc()


@pytest.fixture
def replicas(durable: Durable) -> int:
    return durable.replicas


async def acked(js: JetStreamContext) -> ConsumerInfo:
    """The pool consumer's info once no delivery awaits its ack. (On a cluster, the
    worker's ack and this request reach the consumer's leader by different routes.)"""
    infos: list[ConsumerInfo] = []

    async def settled() -> bool:
        consumer = SUBJECTS.pool_consumer("default")
        infos.append(await js.consumer_info(SUBJECTS.tools_stream, consumer))
        return infos[-1].num_ack_pending == 0

    await wait_for(settled, what="no delivery awaiting its ack")
    return infos[-1]


def sample_registry() -> Registry:
    return Registry(
        [*builtin_tools(("calculator",)), *load_module("tests.tool_worker.sample_tools")]
    )


async def test_a_call_runs_and_the_result_comes_back_with_its_event(
    nc: Client, requester: Requester, events: EventLog
) -> None:
    async with running(nc, sample_registry()):
        result = await requester.call("local", "calculator", {"expression": "2 * (3 + 4)"})
        assert (result.status, result.content, result.server) == ("ok", "14", "local")
        event = await events.wait_for(lambda e: getattr(e, "call_id", None) == result.call_id)
    assert isinstance(event, ToolResultEvent)
    assert (event.tenant, event.session, event.turn_id, event.iteration) == ("t1", "s1", "turn1", 2)
    assert event.content == "14"


async def test_the_result_is_recorded_as_an_effect_before_the_ack(
    nc: Client, js: JetStreamContext, requester: Requester
) -> None:
    async with running(nc, sample_registry()):
        result = await requester.call("local", "echo", {"text": "hi"})
    recorded = await kv_read(nc, SUBJECTS.effects_bucket, result.call_id)  # the leader's
    assert recorded is not None and decode(recorded, ToolResult) == result
    info = await acked(js)
    assert info.num_pending == 0


async def test_the_same_call_id_twice_runs_the_tool_once(
    nc: Client, js: JetStreamContext, requester: Requester, tmp_path: Path
) -> None:
    log = tmp_path / "runs.txt"
    async with running(nc, sample_registry()):
        req = requester.request("local", "record", {"path": str(log), "tag": "once"})
        first = await requester.call("local", "record", req.arguments, call_id=req.call_id)
        # Past JetStream's duplicate window (a purge forgets msg ids), the request is
        # delivered again: the effect record answers it.
        await js.purge_stream(SUBJECTS.tools_stream)
        second = await requester.call("local", "record", req.arguments, call_id=req.call_id)
        # Within the window the stream itself drops the duplicate.
        ack = await requester.publish(req)
    assert ack.duplicate
    assert second == first
    assert log.read_text().count("once") == 2  # one start line, one done line: one run


async def test_the_effect_record_is_read_unless_the_request_is_a_first_attempt(
    nc: Client, js: JetStreamContext, requester: Requester
) -> None:
    """The first delivery of a request marked ``first_attempt`` runs without reading
    the record (there cannot be one); any other request or delivery reads it. A record
    planted under each call id shows which way each went."""
    effects = await js.key_value(SUBJECTS.effects_bucket)
    ids = {
        name: requester.request("local", "echo").call_id
        for name in ("unmarked", "first", "redelivered")
    }
    for call_id in ids.values():
        planted = ToolResult(call_id=call_id, content="recorded", server="local", tool="echo")
        await effects.put(call_id, encode(planted))
    async with running(nc, sample_registry()):
        unmarked = await requester.call("local", "echo", {"text": "ran"}, call_id=ids["unmarked"])
        first = await requester.call(
            "local", "echo", {"text": "ran"}, call_id=ids["first"], first_attempt=True
        )
    # A first attempt whose first delivery was handed back comes again: it reads.
    request = requester.request(
        "local", "echo", {"text": "ran"}, call_id=ids["redelivered"], first_attempt=True
    )
    await requester.publish(request)
    sub = await js.pull_subscribe_bind(SUBJECTS.pool_consumer("default"), SUBJECTS.tools_stream)
    [handed_back] = await sub.fetch(1, timeout=5)
    await handed_back.nak()
    await sub.unsubscribe()
    async with running(nc, sample_registry()):
        redelivered = await requester.result(ids["redelivered"])
    assert (unmarked.content, first.content, redelivered.content) == ("recorded", "ran", "recorded")


async def test_bad_arguments_come_back_as_a_tool_error_naming_the_field(
    nc: Client, requester: Requester, events: EventLog
) -> None:
    async with running(nc, sample_registry()):
        result = await requester.call("local", "sleep", {"seconds": "long"})
        event = await events.wait_for(lambda e: getattr(e, "call_id", None) == result.call_id)
    assert result.status == "error" and result.error is not None
    assert result.error.code == "invalid_arguments"
    assert "'long' is not of type 'number'" in result.error.message
    assert "$.seconds" in result.error.message
    assert isinstance(event, ToolErrorEvent) and event.code == "invalid_arguments"


async def test_unknown_tools_come_back_as_unknown_tool(
    nc: Client, requester: Requester, events: EventLog
) -> None:
    async with running(nc, sample_registry()):
        result = await requester.call("local", "nope", {})
        event = await events.wait_for(lambda e: getattr(e, "call_id", None) == result.call_id)
    assert result.error is not None and result.error.code == "unknown_tool"
    assert "'nope'" in result.error.message and "local.echo" in result.error.message
    assert isinstance(event, ToolErrorEvent) and event.code == "unknown_tool"


async def test_a_call_past_its_timeout_comes_back_as_a_tool_timeout(
    nc: Client, requester: Requester, events: EventLog
) -> None:
    async with running(nc, sample_registry()):
        result = await requester.call("local", "too_slow", {})
        by_request = await requester.call("local", "sleep", {"seconds": 5}, timeout_s=0.1)
        event = await events.wait_for(lambda e: getattr(e, "call_id", None) == result.call_id)
    assert result.status == "timeout" and result.error is not None
    assert result.error.code == "timeout" and "0.2s" in result.error.message
    assert by_request.status == "timeout"
    assert isinstance(event, ToolTimeout) and event.timeout_s == 0.2


async def test_tool_exceptions_come_back_with_their_message(
    nc: Client, requester: Requester, events: EventLog
) -> None:
    async with running(nc, sample_registry()):
        result = await requester.call("local", "explode", {"reason": "testing"})
        refused = await requester.call("local", "refuse", {})
        event = await events.wait_for(lambda e: getattr(e, "call_id", None) == result.call_id)
    assert result.error is not None and result.error.code == "tool_exception"
    assert result.error.message == "RuntimeError: exploded: testing"
    assert refused.error is not None and refused.error.code == "rejected"
    assert isinstance(event, ToolErrorEvent) and "exploded: testing" in event.message


async def test_events_carry_the_shared_message_id(
    nc: Client, js: JetStreamContext, requester: Requester, events: EventLog
) -> None:
    async with running(nc, sample_registry()):
        result = await requester.call("local", "echo", {"text": "x"})
        await events.wait_for(lambda e: getattr(e, "call_id", None) == result.call_id)
    subject = SUBJECTS.event("t1", "s1", "tool_result")
    headers = {"Nats-Msg-Id": tool_event_msg_id(result.call_id, "tool_result")}
    for _ in range(50):  # seen (published) before stored: on a cluster it may still be
        try:  # replicating, which the server answers 409 "duplicate message id is in process"
            ack = await js.publish(subject, b"{}", headers=headers)
            break
        except nats.js.errors.APIError as exc:
            if exc.err_code != IN_PROCESS:
                raise
            await asyncio.sleep(0.1)
    assert ack.duplicate  # the engine's copy of the event is dropped


async def test_an_undecodable_request_is_terminated_and_answered(
    nc: Client, js: JetStreamContext, requester: Requester
) -> None:
    async with running(nc, sample_registry()) as worker:
        req = requester.request("local", "echo", {"text": "x"})
        bad = b'{"call_id": "%s", "reply_to": "%s", "tenant": "no spaces allowed"}' % (
            req.call_id.encode(),
            req.reply_to.encode(),  # type: ignore[union-attr]
        )
        await requester.publish(req, payload=bad)
        result = await requester.result(req.call_id)
        assert result.status == "error" and result.error is not None
        assert result.error.code == "invalid_request"
        assert "ToolCallRequest" in result.error.message
        assert worker.stats["rejected"] == 1
    info = await acked(js)
    assert info.num_redelivered == 0


async def test_calls_longer_than_ack_wait_are_kept_with_in_progress_acks(
    nc: Client, js: JetStreamContext, requester: Requester, tmp_path: Path
) -> None:
    log = tmp_path / "runs.txt"
    # an in-progress ack goes out every ack_wait/3, the first up to 2/3 of AckWait after
    # the delivery: 3 s leaves a loaded machine a second of room (1 s left a third)
    async with running(nc, sample_registry(), ack_wait_s=3.0):
        result = await requester.call(
            "local", "record", {"path": str(log), "tag": "long", "seconds": 7.5}, timeout=30
        )
    assert result.status == "ok"
    info = await js.consumer_info(SUBJECTS.tools_stream, SUBJECTS.pool_consumer("default"))
    assert info.num_redelivered == 0
    assert log.read_text().count("long") == 2


async def test_concurrency_is_bounded_and_the_backlog_stays_in_the_stream(
    nc: Client, js: JetStreamContext, requester: Requester
) -> None:
    gate = asyncio.Event()
    three = asyncio.Event()
    running_now = 0
    peak = 0

    @tool(name="gate")
    async def wait_gate() -> str:
        nonlocal running_now, peak
        running_now += 1
        peak = max(peak, running_now)
        if running_now == 3:
            three.set()
        await gate.wait()
        running_now -= 1
        return "through"

    async with running(nc, Registry([to_tool(wait_gate)]), concurrency=3):
        reqs = [requester.request("local", "gate") for _ in range(10)]
        for req in reqs:
            await requester.publish(req)
        async with asyncio.timeout(10):
            await three.wait()
        # On a cluster the consumer's leader counts what is pending in its own replica of
        # the stream, which applies the last publishes a moment after they were acked.
        async with asyncio.timeout(10):
            while True:
                info = await js.consumer_info(
                    SUBJECTS.tools_stream, SUBJECTS.pool_consumer("default")
                )
                if info.num_pending + info.num_ack_pending == len(reqs):
                    break
                await asyncio.sleep(0.01)  # polling the consumer: no event says it caught up
        assert info.num_pending == 7 and info.num_ack_pending == 3
        gate.set()
        results = [await requester.result(r.call_id) for r in reqs]
    assert peak == 3
    assert {r.content for r in results} == {"through"}


async def test_stopping_finishes_in_flight_calls_and_naks_what_cannot_finish(
    nc: Client, js: JetStreamContext, requester: Requester
) -> None:
    both = asyncio.Event()
    started = 0

    @tool
    async def hold(seconds: float) -> str:
        nonlocal started
        started += 1
        if started == 2:
            both.set()
        await asyncio.sleep(seconds)
        return f"held {seconds}"

    async with running(nc, Registry([to_tool(hold)]), drain_timeout_s=0.5) as worker:
        quick = requester.request("local", "hold", {"seconds": 0.2})
        stuck = requester.request("local", "hold", {"seconds": 30})
        await requester.publish(quick)
        await requester.publish(stuck)
        async with asyncio.timeout(10):
            await both.wait()
    assert (await requester.result(quick.call_id)).content == "held 0.2"
    assert worker.stats["naked"] == 1
    # Handed back: the next puller gets it at once, not after AckWait (30 s).
    psub = await js.pull_subscribe_bind(
        SUBJECTS.pool_consumer("default"), stream=SUBJECTS.tools_stream
    )
    (msg,) = await psub.fetch(1, timeout=5)
    assert decode(msg.data, ToolCallRequest).call_id == stuck.call_id
    assert msg.metadata.num_delivered == 2
    await msg.ack()
