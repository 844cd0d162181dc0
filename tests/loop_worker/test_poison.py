"""Turns that cannot run end in the dead-letter stream, and never wedge the consumer;
waiting for a session's order is not a failed delivery. A real nats-server each."""

import asyncio
import json

from loopmesh.testing.durable import SUBJECTS, provision_short, wait_for
from tests.loop_worker.durable import Watch, count_task, send_turn, turn, turns_left


async def dead_letters(nc) -> list[tuple[bytes, dict[str, str]]]:
    js = nc.jetstream()
    info = await js.stream_info(SUBJECTS.deadletter_stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(SUBJECTS.deadletter_stream, seq)
        out.append((msg.data or b"", dict(msg.headers or {})))
    return out


async def test_a_turn_waiting_behind_a_long_turn_of_its_session_is_not_given_up(mesh, tmp_path):
    """w1 runs t1 for 3 s; w2 holds t2 meanwhile. Before, t2 was handed back every
    ``order_wait_s`` (0.1 s) and each hand-back was a delivery: with two allowed, t2
    was given up after about two seconds."""
    # AckWait and leases far longer than t1: a loaded machine's stalls must not cost w1
    # its lease of the session (with 2 s, w2 then ran t1 and no hand-back was counted)
    await provision_short(mesh.nc, lease_ttl_s=10)
    long = {"ack_wait_s": 10.0, "lease_ttl_s": 10.0}
    await mesh.tool_worker()
    w1 = await mesh.loop_worker(
        "w1", max_active_turns=1, max_waiting_turns=0, max_deliveries=2, **long
    )
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "n", "first", seconds=3.0)))
        await watch.wait("loop_start", "t1")
        w2 = await mesh.loop_worker("w2", order_wait_s=0.1, max_deliveries=2, **long)
        await send_turn(mesh.nc, turn("t2", count_task(tmp_path / "n", "second")))
        end = await watch.wait("loop_end", "t2", timeout=30)
    assert end.reason == "task_completion"
    assert (tmp_path / "n").read_text() == "first\nsecond\n"
    assert w2.service.stats["handed_back"] == 0 and w2.service.stats["finished"] == 1
    assert w1.service.stats["finished"] == 1
    assert not watch.of("error")
    info = await mesh.nc.jetstream().consumer_info(
        SUBJECTS.turns_stream, SUBJECTS.tenant_consumer("acme")
    )
    assert info.num_redelivered == 0


async def test_poison_turns_are_dead_lettered_and_the_consumer_keeps_serving(mesh):
    await mesh.loop_worker()
    js = mesh.nc.jetstream()
    poison = [
        (SUBJECTS.turn("acme", "s1"), b"{not json"),
        (SUBJECTS.turn("acme", "s1"), b'{"id": "bad id", "tenant": "acme", "session": "s1"}'),
        (SUBJECTS.turn("acme", "s1"), b'{"id": "t0", "tenant": "acme", "session": "s1"}'),
        (f"{SUBJECTS.prefix}.turns.acme.s1.deeper", b'{"id": "t9", "input": "x"}'),
        (SUBJECTS.turn("acme", "s1"), json.dumps({"id": "big", "input": "x" * 700_000}).encode()),
    ]
    async with Watch(mesh.nc) as watch:
        for subject, body in poison:
            await js.publish(subject, body)
        await send_turn(mesh.nc, turn("t1", "say hello"))
        end = await watch.wait("loop_end", "t1", timeout=15)
        assert end.reason == "task_completion"  # served after the poison, in order
        await wait_for(lambda: len(watch.of("loop_end")) == 5, what="a loop_end per refusal")
    # a turn's loop_end goes out before its ack, and a refusal's before its ack: the
    # stream empties a moment after the last loop_end, not with it
    await _until_empty(mesh.nc)
    records = sorted(await dead_letters(mesh.nc), key=lambda r: int(r[1]["Loopmesh-Seq"]))
    assert [(h["Loopmesh-Subject"], body) for body, h in records] == poison
    reasons = [h["Loopmesh-Reason"].partition(":")[0] for _, h in records]
    assert reasons == ["invalid_message"] * 3 + ["invalid_subject", "invalid_message"]
    assert [int(h["Loopmesh-Seq"]) for _, h in records] == [1, 2, 3, 4, 5]
    refused = [e.turn_id for e in watch.of("loop_end") if e.reason == "error"]
    assert sorted(refused) == ["big", "t0", "unknown", "unknown"]  # the 4th names no session
    errors = watch.of("error")
    assert [e.code for e in errors] == ["invalid_message"] * 4
    assert any("malformed JSON" in e.message for e in errors)


#: The advisory a term publishes (a loop worker buries a turn another client termed).
TERMINATED = "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.>"


async def test_a_refused_turn_is_acked_so_no_advisory_buries_it_a_second_time(mesh):
    """A refused turn is recorded and announced by the worker that refused it, then
    acked. It used to be termed: the term's advisory reached the dead-letter consumer,
    and on a replicated stream that still held the turn a worker buried it again,
    announcing a second ``error`` and ``loop_end``."""
    await mesh.loop_worker()
    terms = await mesh.nc.subscribe(TERMINATED)
    async with Watch(mesh.nc) as watch:
        body = b'{"id": "t0", "tenant": "acme", "session": "s1"}'  # no input
        await mesh.nc.jetstream().publish(SUBJECTS.turn("acme", "s1"), body)
        await send_turn(mesh.nc, turn("t1", "say hello"))
        await watch.wait("loop_end", "t1", timeout=15)
    await _until_empty(mesh.nc)
    await mesh.nc.flush()
    assert terms.pending_msgs == 0, "a refused turn was termed"
    assert [e.code for e in watch.of("error")] == ["invalid_message"]
    assert len(await dead_letters(mesh.nc)) == 1


class CrashingLLM:
    """An LLM whose every call escapes the engine's error handling (a cancellation
    leaking from a library), so the worker hands the turn back each time."""

    def __init__(self) -> None:
        self.calls = 0

    async def complete(self, messages, **kw):
        self.calls += 1
        raise asyncio.CancelledError


async def test_a_turn_that_fails_every_delivery_is_dead_lettered_after_max_deliveries(mesh):
    llm = CrashingLLM()
    await mesh.loop_worker(llm=llm, max_deliveries=3)
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", "say hello"))
        end = await watch.wait("loop_end", "t1", timeout=20)
        await _until_empty(mesh.nc)
        await send_turn(mesh.nc, turn("t2", "say hello", session="s2"))  # still serving
        await wait_for(lambda: llm.calls > 3, what="t2's delivery")
    assert end.reason == "error" and "3 times" in (end.error or "")
    [error] = watch.of("error", "t1")
    assert error.code == "dead_letter" and error.fatal
    assert len(watch.of("loop_end", "t1")) == 1
    records = await dead_letters(mesh.nc)  # t2 of s2 may be there too by now
    [(body, headers)] = [r for r in records if r[1]["Loopmesh-Subject"].endswith(".s1")]
    assert headers["Loopmesh-Deliveries"] == "3" and b'"id":"t1"' in body


async def _until_empty(nc) -> None:
    async def empty() -> bool:
        return await turns_left(nc) == 0

    await wait_for(empty, timeout=10, what="the turns stream to be empty")
