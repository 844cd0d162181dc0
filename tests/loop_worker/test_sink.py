import time

from loop_worker.sink import JetStreamEvents
from schemas.events import (
    ContentDelta,
    LLMRequest,
    LoopEnd,
    LoopStart,
    ToolResultEvent,
    tool_event_msg_id,
)
from tests.loop_worker.durable import SUBJECTS, connect_fast, provision_short, stream_events


def run_events(turn: str = "t1", *, resumed_at: int | None = None):
    base = {"tenant": "acme", "session": "s1", "turn_id": turn}
    start = (
        LoopStart(**base, resumed=True, iteration=resumed_at)
        if resumed_at is not None
        else LoopStart(**base)
    )
    return [
        start,
        LLMRequest(**base, iteration=1),
        ContentDelta(**base, iteration=1, text="hel"),
        ContentDelta(**base, iteration=1, text="lo"),
        ToolResultEvent(**base, iteration=1, call_id="t1-1-0", content="ok"),
        LoopEnd(**base, iteration=1, reason="task_completion"),
    ]


async def test_emit_returns_before_the_ack_and_flush_stores_every_event_in_order(nc):
    await provision_short(nc)
    sink = JetStreamEvents(nc, SUBJECTS)
    sink.begin("t1")
    started = time.perf_counter()
    for event in run_events():
        await sink.emit(event)
    emitting = time.perf_counter() - started
    await sink.flush("t1")
    assert sink.pending("t1") == 0
    stored = await stream_events(nc, "acme", "s1")
    assert [e.type for e, _ in stored] == [
        "loop_start", "llm_request", "content_delta", "content_delta", "tool_result", "loop_end"
    ]  # fmt: skip
    assert [e.text for e, _ in stored if isinstance(e, ContentDelta)] == ["hel", "lo"]
    assert emitting < 0.05


async def test_a_replayed_iteration_does_not_duplicate_its_events(nc):
    await provision_short(nc)
    first = JetStreamEvents(nc, SUBJECTS)
    for event in run_events()[:4]:  # the worker dies here
        await first.emit(event)
    await first.flush()
    second = JetStreamEvents(nc, SUBJECTS)  # another worker replays iteration 1
    second.begin("t1", delivery=2)
    for event in run_events():
        await second.emit(event)
    await second.flush("t1")
    stored = await stream_events(nc, "acme", "s1")
    assert [e.type for e, _ in stored] == [
        "loop_start", "llm_request", "content_delta", "content_delta", "tool_result", "loop_end"
    ]  # fmt: skip


async def test_a_resumed_loop_start_is_kept_and_loop_end_is_stored_once(nc):
    await provision_short(nc)
    sink = JetStreamEvents(nc, SUBJECTS)
    sink.begin("t1", delivery=2)
    await sink.emit(run_events(resumed_at=1)[0])
    for _ in range(2):
        await sink.emit(run_events()[-1])
    await sink.flush()
    stored = await stream_events(nc, "acme", "s1")
    assert [(e.type, h["Nats-Msg-Id"]) for e, h in stored] == [
        ("loop_start", "t1:loop_start:r2"),
        ("loop_end", "t1:loop_end"),
    ]


async def test_tool_outcome_events_share_the_tool_workers_msg_id(nc):
    await provision_short(nc)
    sink = JetStreamEvents(nc, SUBJECTS)
    event = run_events()[4]
    msg_id = tool_event_msg_id("t1-1-0", "tool_result")
    from schemas import encode

    await nc.jetstream().publish(
        SUBJECTS.event("acme", "s1", "tool_result"), encode(event), headers={"Nats-Msg-Id": msg_id}
    )
    await sink.emit(event)
    await sink.flush()
    stored = await stream_events(nc, "acme", "s1")
    assert [h["Nats-Msg-Id"] for _, h in stored] == [msg_id]


async def test_flush_stores_events_emitted_while_the_server_was_down(nats_server, nc):
    await provision_short(nc)
    client = await connect_fast(nats_server.url)
    try:
        sink = JetStreamEvents(client, SUBJECTS)
        await nats_server.stop()
        for event in run_events():
            await sink.emit(event)
        await nats_server.start()
        await sink.flush()
        stored = await stream_events(client, "acme", "s1")
    finally:
        await client.close()
    assert len(stored) == 6
