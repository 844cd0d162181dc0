import asyncio
import os
import signal

import pytest

from loop_worker.errors import LeaseLostError
from loop_worker.sink import JetStreamEvents
from loopmesh.testing.durable import (
    SUBJECTS,
    connect_fast,
    provision_short,
    stream_events,
    wait_for,
)
from schemas import encode
from schemas.events import (
    ContentDelta,
    LLMRequest,
    LoopEnd,
    LoopStart,
    ToolResultEvent,
    tool_event_msg_id,
)
from tests.conftest import BOTH_SHARED
from tests.loop_worker.durable import record_replies

pytestmark = pytest.mark.parametrize("durable", BOTH_SHARED, indirect=True)  # R1 and R3

BARRIERS = "one server only: on a replicated events stream every event asks for its ack"


@pytest.fixture
async def nc(durable):
    client = await connect_fast(durable.url)
    try:
        await provision_short(client, replicas=durable.replicas)
        yield client
    finally:
        await client.close()


async def started(sink: JetStreamEvents) -> JetStreamEvents:
    """As the service starts it: on a replicated stream it asks for every event's ack."""
    await sink.start()
    return sink


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


async def test_emit_returns_before_the_ack_and_flush_stores_every_event_in_order(durable, nc):
    """On the cluster every event asks for its ack, and still none is waited for; the
    node paused is the sink's, one that does not lead the events stream."""
    node = await durable.follower(SUBJECTS.events_stream)
    assert node.pid is not None
    client = await connect_fast(node.url)
    try:
        sink = await started(JetStreamEvents(client, SUBJECTS))
        sink.begin("acme.s1.t1")
        os.kill(node.pid, signal.SIGSTOP)  # the server acks nothing until it continues
        try:
            async with asyncio.timeout(10):  # an emit that waited for its ack would not return
                for event in run_events():
                    await sink.emit(event)
            assert sink.pending("acme.s1.t1") == 6  # none stored yet
        finally:
            os.kill(node.pid, signal.SIGCONT)
        await sink.flush("acme.s1.t1")
        assert sink.pending("acme.s1.t1") == 0
    finally:
        await client.close()
    stored = await stream_events(nc, "acme", "s1")
    assert [e.type for e, _ in stored] == [
        "loop_start", "llm_request", "content_delta", "content_delta", "tool_result", "loop_end"
    ]  # fmt: skip
    assert [e.text for e, _ in stored if isinstance(e, ContentDelta)] == ["hel", "lo"]


async def test_a_replayed_iteration_does_not_duplicate_its_events(nc):
    first = await started(JetStreamEvents(nc, SUBJECTS))
    for event in run_events()[:4]:  # the worker dies here
        await first.emit(event)
    await first.flush()
    second = await started(JetStreamEvents(nc, SUBJECTS))  # another worker replays iteration 1
    second.begin("acme.s1.t1", delivery=2)
    for event in run_events():
        await second.emit(event)
    await second.flush("acme.s1.t1")
    stored = await stream_events(nc, "acme", "s1")
    assert [e.type for e, _ in stored] == [
        "loop_start", "llm_request", "content_delta", "content_delta", "tool_result", "loop_end"
    ]  # fmt: skip


async def test_a_resumed_loop_start_is_kept_and_loop_end_is_stored_once(nc):
    sink = await started(JetStreamEvents(nc, SUBJECTS))
    sink.begin("acme.s1.t1", delivery=2)
    await sink.emit(run_events(resumed_at=1)[0])
    for _ in range(2):
        await sink.emit(run_events()[-1])
    await sink.flush()
    stored = await stream_events(nc, "acme", "s1")
    assert [(e.type, h["Nats-Msg-Id"]) for e, h in stored] == [
        ("loop_start", "acme.s1.t1:loop_start:r2"),
        ("loop_end", "acme.s1.t1:loop_end"),
    ]


async def test_a_loop_end_is_stored_by_flush_not_by_emit(nc):
    """The service flushes after the turn's last checkpoint: a worker that dies between
    its ``loop_end`` and that checkpoint must leave no ``loop_end`` in the stream, or
    the next delivery would resume a turn its readers saw end."""
    sink = await started(JetStreamEvents(nc, SUBJECTS))
    sink.begin("acme.s1.t1")
    for event in run_events():
        await sink.emit(event)
    if sink.acks_each:  # the cluster: every event but the loop_end gets its ack
        await wait_for(lambda: sink.pending("acme.s1.t1") <= 1)
    else:  # one server stores a connection's messages in order: all before this one
        other = LoopStart(tenant="acme", session="s1", turn_id="t2")
        subject = SUBJECTS.event("acme", "s1", "loop_start")
        await nc.jetstream().publish(subject, encode(other), headers={"Nats-Msg-Id": "t2"})
    stored = [e.type for e, _ in await stream_events(nc, "acme", "s1") if e.turn_id == "t1"]
    assert stored == ["loop_start", "llm_request", "content_delta", "content_delta", "tool_result"]
    await sink.flush("acme.s1.t1")
    stored = [e.type for e, _ in await stream_events(nc, "acme", "s1") if e.turn_id == "t1"]
    assert stored[-1] == "loop_end"


async def test_a_flush_before_the_last_checkpoint_stores_all_but_the_loop_end(nc):
    """What a checkpoint waits for on a cluster: the events it stands for, not the
    ``loop_end``, which must not be stored before the checkpoint that ends the turn."""
    sink = await started(JetStreamEvents(nc, SUBJECTS))
    sink.begin("acme.s1.t1")
    for event in run_events():
        await sink.emit(event)
    await sink.flush("acme.s1.t1", end=False)
    assert sink.pending("acme.s1.t1") == 1
    stored = [e.type for e, _ in await stream_events(nc, "acme", "s1")]
    assert stored == ["loop_start", "llm_request", "content_delta", "content_delta", "tool_result"]
    await sink.flush("acme.s1.t1")
    assert [e.type for e, _ in await stream_events(nc, "acme", "s1")] == [*stored, "loop_end"]


async def test_tool_outcome_events_share_the_tool_workers_msg_id(nc):
    sink = await started(JetStreamEvents(nc, SUBJECTS))
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


async def test_flush_stores_events_emitted_while_the_server_was_down(durable, nc):
    """On the cluster, the node that leads the events stream is down."""
    client = await connect_fast(durable.url)
    try:
        sink = await started(JetStreamEvents(client, SUBJECTS))
        await durable.stop(SUBJECTS.events_stream)
        for event in run_events():
            await sink.emit(event)
        await durable.start()
        await sink.flush()
        stored = await stream_events(client, "acme", "s1")
    finally:
        await client.close()
    assert len(stored) == 6


async def test_a_turn_that_may_no_longer_write_keeps_its_events_unpublished(nc):
    """The loop worker's fence: once the turn's lease lapsed by the worker's clock, its
    events do not go to the client, and a flush raises instead of publishing them."""
    may_write = {"acme.s1.t1": True}
    sink = await started(JetStreamEvents(nc, SUBJECTS, writable=may_write.__getitem__))
    sink.begin("acme.s1.t1")
    events = run_events()
    await sink.emit(events[0])
    await sink.flush("acme.s1.t1")
    may_write["acme.s1.t1"] = False  # the lease lapsed
    for event in events[1:]:
        await sink.emit(event)
    assert sink.pending("acme.s1.t1") == 5
    with pytest.raises(LeaseLostError):
        await sink.flush("acme.s1.t1")
    assert [e.type for e, _ in await stream_events(nc, "acme", "s1")] == ["loop_start"]
    may_write["acme.s1.t1"] = True  # renewed after all: the flush stores them, in order
    await sink.flush("acme.s1.t1")
    stored = await stream_events(nc, "acme", "s1")
    assert [e.type for e, _ in stored] == [e.type for e in events]


async def test_events_emitted_while_reconnecting_are_not_left_in_the_clients_buffer(durable, nc):
    """nats-py keeps what is published while it reconnects and sends it once back, however
    late: the sink publishes nothing then, and its flush publishes the events once the
    client is connected again."""
    url, node = durable.url, None  # on the cluster, only the node stopped: the client
    if durable.cluster is not None:  # waits for it (the one it connected to, though the
        # leader may have moved since)
        node = durable.cluster.node(await durable.cluster.leader_of(SUBJECTS.events_stream))
        url = node.url
    client = await connect_fast(url)
    try:
        sink = await started(JetStreamEvents(client, SUBJECTS))
        await durable.stop(SUBJECTS.events_stream, node=node)
        await wait_for(lambda: not client.is_connected, timeout=30)
        for event in run_events():
            await sink.emit(event)
        assert client.pending_data_size == 0
        await durable.start()
        await sink.flush()
        stored = await stream_events(client, "acme", "s1")
    finally:
        await client.close()
    assert len(stored) == 6


def many_events(turn: str, n: int):
    base = {"tenant": "acme", "session": "s1", "turn_id": turn}
    deltas = [ContentDelta(**base, iteration=1, text=str(i)) for i in range(n)]
    return [LoopStart(**base), *deltas, LoopEnd(**base, iteration=1, reason="task_completion")]


async def test_events_published_without_acks_are_all_stored_after_flush(nc):
    """On the cluster each is acked: still all stored, ``loop_end`` once."""
    sink = await started(JetStreamEvents(nc, SUBJECTS, barrier_every=4))
    sink.begin("acme.s1.t1")
    events = many_events("t1", 10)
    for event in events[:-1]:  # no loop_end: flush publishes the barrier itself
        await sink.emit(event)
    await sink.flush("acme.s1.t1")
    assert sink.pending("acme.s1.t1") == 0
    stored = await stream_events(nc, "acme", "s1")
    assert [e.text for e, _ in stored if isinstance(e, ContentDelta)] == [str(i) for i in range(10)]
    await sink.emit(events[-1])
    await sink.flush("acme.s1.t1")
    stored = await stream_events(nc, "acme", "s1")
    assert [e.type for e, _ in stored].count("loop_end") == 1
    assert len(stored) == 12


async def test_a_barriers_ack_vouches_for_the_events_before_it(durable, nc):
    if durable.kind == "cluster":
        pytest.skip(f"{BARRIERS} (test_sink_cluster.py)")
    sink = await started(JetStreamEvents(nc, SUBJECTS, barrier_every=1000))
    sink.begin("acme.s1.t1")
    replies = record_replies(nc)
    for event in many_events("t1", 20):
        await sink.emit(event)
    await sink.flush("acme.s1.t1")
    assert len(replies) == 22
    assert [r for r in replies if r] == replies[-1:]  # only loop_end asked for an ack
    assert len(await stream_events(nc, "acme", "s1")) == 22


async def test_events_lost_before_a_reconnect_are_published_again_once(durable, nc):
    if durable.kind == "cluster":
        pytest.skip(f"{BARRIERS}: none goes out unacked, to be lost")
    client = await connect_fast(durable.url)
    try:
        sink = await started(JetStreamEvents(client, SUBJECTS, barrier_every=1000))
        sink.begin("acme.s1.t1")
        events = many_events("t1", 6)
        publish = client.publish
        lost: list[str] = []

        async def losing(subject, payload=b"", reply="", headers=None):
            if not reply and len(lost) < 3:  # as if the old connection ate them
                lost.append(subject)
                return
            await publish(subject, payload, reply=reply, headers=headers)

        client.publish = losing  # type: ignore[method-assign]
        for event in events[:4]:
            await sink.emit(event)
        reconnected = client.stats["reconnects"] + 1
        await durable.restart()
        await wait_for(
            lambda: client.stats["reconnects"] >= reconnected and client.is_connected,
            what="the reconnect",
        )
        for event in events[4:]:
            await sink.emit(event)
        await sink.flush("acme.s1.t1")
        stored = await stream_events(client, "acme", "s1")
    finally:
        await client.close()
    assert len(lost) == 3
    ids = [h["Nats-Msg-Id"] for _, h in stored]
    t1 = "acme.s1.t1"
    expected = [f"{t1}:0:loop_start:0", *(f"{t1}:1:content_delta:{i}" for i in range(6))]
    expected.append(f"{t1}:loop_end")
    assert sorted(ids) == sorted(expected)  # none missing, none twice
    assert ids[-1] == f"{t1}:loop_end"  # stored after the events published again


async def test_unacked_events_are_bounded_in_bytes(durable, nc):
    if durable.kind == "cluster":
        pytest.skip(BARRIERS)
    sink = await started(JetStreamEvents(nc, SUBJECTS, barrier_every=1000))
    sink.begin("acme.s1.t1")
    replies = record_replies(nc)
    base = {"tenant": "acme", "session": "s1", "turn_id": "t1", "iteration": 1}
    for text in ("a", "b" * 40_000, "c" * 40_000, "d"):
        await sink.emit(ContentDelta(**base, text=text))
    assert [bool(r) for r in replies] == [False, False, True, False]  # 64 KB reached
    await sink.flush("acme.s1.t1")
    assert len(await stream_events(nc, "acme", "s1")) == 4
