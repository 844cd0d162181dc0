"""The durable loop worker, in-process: workers and a tool worker as tasks on one real
nats-server, each with its own client, against the fake OpenAI-compatible server."""

import asyncio

import pytest

from loop_worker.controls import send_control
from loopmesh.provision import provision
from loopmesh.testing.durable import (
    SUBJECTS,
    kv_entry,
    kv_read,
    stream_events,
    wait_for,
)
from loopmesh.testing.fake_replies import text
from schemas import (
    ApprovalDecision,
    Cancel,
    Pause,
    Resume,
    SessionSnapshot,
    decode,
    encode,
)
from schemas.events import ContentDelta, LoopEnd
from schemas.streams import definitions
from tests.conftest import BOTH
from tests.loop_worker.durable import (
    Watch,
    count_task,
    fake_pool,
    mesh_on,
    register_tool,
    send_turn,
    spec,
    turn,
    turns_left,
)


@pytest.fixture
async def mesh(durable):
    async with mesh_on(durable.url, replicas=durable.replicas) as mesh:
        yield mesh


both = pytest.mark.parametrize("durable", BOTH, indirect=True)  # also on the R3 cluster


@both
async def test_a_turn_runs_to_its_end_and_is_acked_once_its_events_are_stored(mesh, tmp_path):
    await mesh.tool_worker()
    await mesh.loop_worker()
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "n")))
        end = await watch.wait("loop_end", "t1")
    assert isinstance(end, LoopEnd) and end.reason == "task_completion"
    assert (tmp_path / "n").read_text() == "a\n"
    await _until(lambda: turns_left(mesh.nc), 0, timeout=5)
    stored = [e.type for e, _ in await stream_events(mesh.nc, "acme", "s1")]
    assert stored.count("loop_end") == 1 and stored[:2] == ["turn_accepted", "loop_start"]
    assert stored.count("tool_result") == 2  # count, then task_completion
    value = await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "acme.s1")  # the leader's
    snapshot = decode(value or b"", SessionSnapshot)
    assert snapshot.status == "idle" and snapshot.turn_id == "t1"
    assert await kv_read(mesh.nc, SUBJECTS.leases_bucket, "acme.s1") is None  # released


@both
async def test_two_turns_sent_at_once_to_one_session_run_in_order(mesh, tmp_path):
    await mesh.tool_worker()
    await mesh.loop_worker("w1")
    await mesh.loop_worker("w2")
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "n", "first", seconds=0.3)))
        await send_turn(mesh.nc, turn("t2", count_task(tmp_path / "n", "second")))
        await watch.wait("loop_end", "t2")
    order = [(e.type, e.turn_id) for e in watch.events if e.type in ("loop_start", "loop_end")]
    assert order == [
        ("loop_start", "t1"), ("loop_end", "t1"), ("loop_start", "t2"), ("loop_end", "t2")
    ]  # fmt: skip
    assert (tmp_path / "n").read_text() == "first\nsecond\n"


async def test_a_sessions_next_turn_on_the_same_worker_starts_from_what_it_kept(mesh):
    """No read of the session when this worker ran its last turn and nobody held it
    since; the conversation carries on whole either way."""
    w1 = await mesh.loop_worker("w1")
    async with Watch(mesh.nc) as watch:
        for t in ("t1", "t2"):
            await send_turn(mesh.nc, turn(t, f"say {t}"))
            await watch.wait("loop_end", t)
        await w1.stop()
        await mesh.loop_worker("w2")
        await send_turn(mesh.nc, turn("t3", "say t3"))
        await watch.wait("loop_end", "t3")
    said = [m["content"] for m in mesh.fake.requests[-1]["messages"] if m["role"] == "user"]
    assert said[:2] == ["say t1", "say t2"] and said[2].endswith("say t3")
    assert w1.service.stats["warm"] == 1 and mesh.running[-1].service.stats["warm"] == 0


async def test_a_turns_first_run_marks_its_calls_as_first_attempts(mesh):
    """(Redelivered turns' calls are not marked: ``test_dispatch.py``.)"""

    async def counted(request) -> str:
        return "counted"

    await register_tool(mesh.nc, spec("count"))
    async with fake_pool(mesh.nc, counted) as ran:
        await mesh.loop_worker("w1")
        async with Watch(mesh.nc) as watch:
            await send_turn(mesh.nc, turn("t1", 'call local__count {"label": "a"}'))
            await watch.wait("loop_end", "t1")
    assert [(r.tool, r.first_attempt) for r in ran] == [("count", True)]


@both
async def test_a_turn_published_again_over_its_own_checkpoint_runs_no_call_twice(mesh, tmp_path):
    """Its first delivery resumes the checkpoint a dead run of the same turn id left, so
    its calls are not first attempts: the recorded effect answers the call, though the
    stream no longer remembers the call's id."""
    js = mesh.nc.jetstream()
    await provision(
        js,
        definitions(
            SUBJECTS,
            lease_ttl_s=2,
            duplicate_window_s=1,
            replicas=mesh.replicas,
        ),
    )
    await mesh.tool_worker()
    first = await mesh.loop_worker("w1")
    task = turn("t1", count_task(tmp_path / "n", "a", seconds=1.0))
    await send_turn(mesh.nc, task)
    await wait_for(lambda: (tmp_path / "n").exists(), timeout=5, what="the call")
    first.task.cancel()  # the worker dies mid-call, its checkpoint holding the call
    await asyncio.gather(first.task, return_exceptions=True)
    await first.client.close()
    await _until(lambda: _messages(js, SUBJECTS.tools_stream), 0, timeout=10)  # recorded
    await js.purge_stream(SUBJECTS.turns_stream)  # the dead run's turn is gone
    await asyncio.sleep(1.2)  # past the duplicate windows
    await mesh.loop_worker("w2")
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, task)  # published again: a first delivery
        end = await watch.wait("loop_end", "t1", timeout=15)
    assert end.reason == "task_completion"
    assert (tmp_path / "n").read_text() == "a\n"


async def _messages(js, stream: str) -> int:
    return (await js.stream_info(stream)).state.messages


async def test_turns_of_one_tenant_over_its_limit_wait(mesh, tmp_path):
    await mesh.tool_worker()
    await mesh.loop_worker(tenant_max_active=1)
    async with Watch(mesh.nc, session="s1") as w1, Watch(mesh.nc, session="s2") as w2:
        await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "a", seconds=0.3)))
        await send_turn(mesh.nc, turn("t2", count_task(tmp_path / "b", seconds=0.3), session="s2"))
        end1, end2 = await w1.wait("loop_end", "t1"), await w2.wait("loop_end", "t2")
    start1, start2 = w1.of("loop_start", "t1")[0], w2.of("loop_start", "t2")[0]
    assert start2.ts >= end1.ts or start1.ts >= end2.ts  # one after the other


async def test_a_cancel_during_a_streamed_llm_reply_ends_the_turn_and_cuts_the_reply(mesh):
    mesh.fake.script(text("word " * 400, chunk_size=5, delay_s=0.25))  # a 100 s reply
    await mesh.loop_worker()
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", "write a long essay"))
        await watch.wait("content_delta", "t1", count=3)
        await mesh.nc.publish(
            SUBJECTS.control("acme", "s1"),
            b'{"type": "cancel", "tenant": "acme", "session": "s1", "reason": "enough"}',
        )
        end = await watch.wait("loop_end", "t1", timeout=30)  # not at the reply's end
    assert isinstance(end, LoopEnd) and end.reason == "cancelled"
    assert len(watch.of("content_delta")) < 400
    await mesh.fake.wait_disconnects(1, timeout=30)  # the stream was hung up


async def test_pause_holds_the_turn_at_an_iteration_boundary_and_resume_goes_on(mesh, tmp_path):
    await mesh.tool_worker()
    await mesh.loop_worker()
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "n", seconds=0.5)))
        await watch.wait("tool_call", "t1")
        await send_control(mesh.nc, SUBJECTS, Pause(tenant="acme", session="s1"))
        await watch.wait("paused", "t1")
        assert not watch.of("loop_end")
        await send_control(mesh.nc, SUBJECTS, Resume(tenant="acme", session="s1"))
        await watch.wait("resumed", "t1")
        end = await watch.wait("loop_end", "t1")
    assert end.reason == "task_completion"


async def test_an_approval_arriving_while_the_worker_runs_lets_the_call_through(mesh, tmp_path):
    await mesh.tool_worker()
    await mesh.loop_worker()
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "g", tool="guarded")))
        asked = await watch.wait("approval_required", "t1")
        decision = ApprovalDecision(
            tenant="acme", session="s1", call_id=asked.call_id, approved=True
        )
        await mesh.nc.publish(SUBJECTS.control("acme", "s1"), _json(decision))
        end = await watch.wait("loop_end", "t1")
    assert end.reason == "task_completion"
    assert (tmp_path / "g").read_text() == "a\n"


@both
async def test_an_approval_sent_while_no_worker_runs_is_seen_after_the_restart(mesh, tmp_path):
    await mesh.tool_worker()
    first = await mesh.loop_worker("w1", drain_timeout_s=0.2)
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "g", tool="guarded")))
        asked = await watch.wait("approval_required", "t1")
        await first.stop()  # hands the turn back
        decision = ApprovalDecision(
            tenant="acme", session="s1", call_id=asked.call_id, approved=True
        )
        await send_control(mesh.nc, SUBJECTS, decision)
        await mesh.loop_worker("w2")
        end = await watch.wait("loop_end", "t1")
    assert end.reason == "task_completion"
    assert (tmp_path / "g").read_text() == "a\n"
    assert [e.resumed for e in watch.of("loop_start")] == [False, True]
    assert len(watch.of("turn_accepted")) == 1  # said once, not again on resume


async def test_a_cancel_sent_while_no_worker_runs_ends_the_turn_when_it_is_picked_up(
    mesh, tmp_path
):
    await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "n")))
    await send_control(
        mesh.nc, SUBJECTS, Cancel(tenant="acme", session="s1", turn_id="t1", reason="nope")
    )
    async with Watch(mesh.nc) as watch:
        await mesh.tool_worker()
        await mesh.loop_worker()
        # the watch starts after the publish: the turn's events come after it anyway
        end = await watch.wait("loop_end", "t1")
    assert end.reason == "cancelled"
    assert not (tmp_path / "n").exists()


async def test_a_stopping_worker_finishes_its_turn_within_the_drain_deadline(mesh, tmp_path):
    await mesh.tool_worker()
    worker = await mesh.loop_worker(drain_timeout_s=10)
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "n", seconds=0.5)))
        await watch.wait("tool_call", "t1")
        await worker.stop()
        end = await watch.wait("loop_end", "t1")
    assert end.reason == "task_completion"
    assert await turns_left(mesh.nc) == 0


@both
async def test_a_turn_handed_back_on_stop_is_resumed_by_another_worker(mesh, tmp_path):
    await mesh.tool_worker()
    first = await mesh.loop_worker("w1", drain_timeout_s=0.1)
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "n", seconds=1.0)))
        await watch.wait("tool_call", "t1")
        await first.stop()
        await mesh.loop_worker("w2")
        end = await watch.wait("loop_end", "t1")
    assert end.reason == "task_completion"
    assert (tmp_path / "n").read_text() == "a\n"  # the call was awaited, not run again
    assert len(watch.of("loop_end")) == 1


@both
async def test_a_nats_server_restart_mid_turn_does_not_stop_the_turn(mesh, durable, tmp_path):
    """On the cluster, the node that leads the turns stream is restarted."""
    await mesh.tool_worker()
    await mesh.loop_worker()
    await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "n", seconds=1.0)))
    await _until_file(tmp_path / "n")
    await durable.restart()
    ends = await _wait_stored(mesh.nc, "loop_end", timeout=20)
    assert [e.reason for e in ends] == ["task_completion"]
    assert (tmp_path / "n").read_text() == "a\n"


async def test_an_invalid_turn_is_dropped_and_the_next_one_runs(mesh, tmp_path):
    await mesh.tool_worker()
    await mesh.loop_worker()
    js = mesh.nc.jetstream()
    await js.publish(SUBJECTS.turn("acme", "s1"), b'{"id": "bad id"}')
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "n")))
        end = await watch.wait("loop_end", "t1")
    assert end.reason == "task_completion"


async def test_many_sessions_run_at_once_in_one_worker(mesh):
    await mesh.loop_worker(max_active_turns=32)
    async with Watch(mesh.nc, session="m0") as first:
        for i in range(40):
            await send_turn(mesh.nc, turn(f"t{i}", "say hi", session=f"m{i}"))
        await first.wait("loop_end", "t0")
    await _until(lambda: turns_left(mesh.nc), 0, timeout=15)
    deltas = [e for e, _ in await stream_events(mesh.nc, "acme", "m39")]
    assert deltas[-1].type == "loop_end"
    assert not any(isinstance(e, ContentDelta) and not e.text for e in deltas)


@both
async def test_a_worker_whose_lease_is_taken_stops_the_turn_and_keeps_nothing(mesh, tmp_path):
    """A worker that stalled past its lease TTL finds the lease taken at its next
    renewal: it drops the turn's events, writes no checkpoint, neither acks nor naks."""
    await mesh.tool_worker()
    worker = await mesh.loop_worker()
    leases = await mesh.nc.jetstream().key_value(SUBJECTS.leases_bucket)
    counter = tmp_path / "n"

    async def checkpoint() -> int:  # the session's revision, as the bucket's leader has it
        entry = await kv_entry(mesh.nc, SUBJECTS.sessions_bucket, "acme.s1")
        assert entry is not None
        return entry.revision

    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", count_task(counter, seconds=1.5)))
        await wait_for(counter.exists, timeout=10, what="the slow tool to start")
        before = await checkpoint()
        await leases.put("acme.s1", b'{"owner": "intruder", "turn_id": "t1"}')  # taken over
        await wait_for(lambda: worker.service.stats["lost"] == 1, timeout=5, what="the loss")
        intruder = await kv_read(mesh.nc, SUBJECTS.leases_bucket, "acme.s1")  # left alone
        assert intruder == b'{"owner": "intruder", "turn_id": "t1"}'  # (it expires with the TTL)
        # The tool's result arrives: nothing may follow from it. The tool worker replies
        # before it acks the call; the worker's own flush makes sure the reply reached it;
        # stopping the worker drains whatever it would still publish.
        await _until(lambda: _messages(mesh.nc.jetstream(), SUBJECTS.tools_stream), 0)
        await watch.wait("tool_result", "t1")
        await worker.client.flush()
        await worker.stop()
        assert not watch.of("loop_end", "t1")
    stored = [e.type for e, _ in await stream_events(mesh.nc, "acme", "s1")]
    assert "tool_result" in stored and "loop_end" not in stored
    assert stored[stored.index("tool_result") + 1 :] == []  # nothing after the result
    assert await checkpoint() == before  # no checkpoint after the loss
    assert await turns_left(mesh.nc) == 1  # not acked: it is the new holder's to finish


# -- helpers ------------------------------------------------------------------------------


def _json(obj) -> bytes:

    return encode(obj)


async def _until(probe, expected, timeout: float = 10.0):
    async def reached() -> bool:
        return (await probe()) == expected

    await wait_for(reached, timeout=timeout, what=f"{expected}")


async def _until_file(path, timeout: float = 10.0):
    await wait_for(path.exists, timeout=timeout, what=f"{path} to exist")


async def _wait_stored(nc, type_: str, *, timeout: float):
    async with asyncio.timeout(timeout):
        while True:
            try:
                events = [e for e, _ in await stream_events(nc, "acme", "s1")]
            except Exception:
                events = []
            found = [e for e in events if e.type == type_]
            if found:
                return found
            await asyncio.sleep(0.05)
