import asyncio
import time

import pytest

from loop_worker.controls import Controls, send_control
from loopmesh.testing.durable import (
    SUBJECTS,
    kv_read,
    provision_short,
    stream_events,
    wait_for,
)
from schemas import ApprovalDecision, Cancel, Pause, Resume, Turn, encode
from schemas.events import Error
from tests.conftest import BOTH_SHARED, durable_nc

pytestmark = pytest.mark.parametrize("durable", BOTH_SHARED, indirect=True)  # R1 and R3


def turn(turn_id: str = "t1", **kw) -> Turn:
    kw = {"tenant": "acme", "session": "s1", "created_at": time.time(), **kw}
    return Turn(id=turn_id, input="hi", **kw)


nc = durable_nc()


@pytest.fixture
async def controls(nc, durable):
    await provision_short(nc, replicas=durable.replicas)
    controls = Controls(nc, SUBJECTS)
    await controls.start()
    yield controls
    await controls.close()


async def publish(nc, control) -> None:
    """A control as a plain NATS client (the gateway, another language) sends it."""
    await nc.publish(SUBJECTS.control(control.tenant, control.session), encode(control))
    await nc.flush()


async def test_a_cancel_reaches_the_running_turn_at_once(nc, controls):
    control = await controls.open(turn())
    routed: list[object] = []
    heard = asyncio.Event()
    controls.on_routed = lambda c: (routed.append(c), heard.set())
    cancel = Cancel(tenant="acme", session="s1", reason="stop")
    await publish(nc, cancel)
    await asyncio.wait_for(heard.wait(), 10)
    assert control.cancelled.is_set() and control.cancel_reason == "stop"
    assert routed == [cancel]  # by the live message itself, not a later read of the record


async def test_a_control_for_another_turn_is_ignored(nc, controls):
    control = await controls.open(turn("t1"))
    routed = asyncio.Event()
    controls.on_routed = lambda c: routed.set()
    await publish(nc, Cancel(tenant="acme", session="s1", turn_id="t0"))
    await publish(nc, Pause(tenant="acme", session="s1", turn_id="t1"))
    await asyncio.wait_for(routed.wait(), 10)
    assert control.paused and not control.cancelled.is_set()


async def test_pause_and_resume_reach_the_running_turn(nc, controls):
    control = await controls.open(turn())
    await publish(nc, Pause(tenant="acme", session="s1"))
    await wait_for(lambda: control.paused)
    await publish(nc, Resume(tenant="acme", session="s1"))
    await asyncio.wait_for(control.wait_running(), 10)


async def test_a_cancel_sent_while_no_worker_runs_the_turn_applies_when_it_starts(nc, controls):
    t1 = turn("t1")
    await publish(nc, Cancel(tenant="acme", session="s1", turn_id="t1", reason="late"))
    await wait_for(lambda: _recorded(nc, "acme.s1.turn.t1"), what="the control record")
    control = await controls.open(t1)
    assert control.cancelled.is_set() and control.cancel_reason == "late"
    await controls.close_turn(t1, control)
    nxt = await controls.open(turn("t2"))  # the session's next turn is not cancelled
    assert not nxt.cancelled.is_set()


async def test_interrupts_of_two_turns_keep_each_others_record_and_a_session_pause(nc, controls):
    """Recorded while neither turn runs: each turn finds its own interrupt when it
    starts, and the session-wide pause sent before them still holds for a turn it
    applies to."""
    pause = Pause(tenant="acme", session="s1", at=time.time())
    before = pause.at - 1
    await send_control(nc, SUBJECTS, pause)
    for turn_id in ("t1", "t2"):
        interrupt = Cancel(
            tenant="acme", session="s1", turn_id=turn_id, mode="interrupt", by_turn="t3"
        )
        await send_control(nc, SUBJECTS, interrupt)
    for turn_id in ("t1", "t2"):
        control = await controls.open(turn(turn_id, created_at=before))
        assert control.interruption is not None and control.interruption.by == "t3"
    assert (await controls.open(turn("t0", created_at=before))).paused


async def test_a_cancel_naming_no_turn_spares_turns_created_after_it(nc, controls):
    await send_control(nc, SUBJECTS, Cancel(tenant="acme", session="s1", at=time.time()))
    control = await controls.open(turn("t9"))
    assert not control.cancelled.is_set()


async def test_an_approval_recorded_while_no_worker_ran_is_found_by_wait_decision(nc, controls):
    """On the cluster, read from the bucket's leader: a follower's answer missed it in a
    few runs of a hundred."""
    decision = ApprovalDecision(tenant="acme", session="s1", call_id="t1-1-0", approved=True)
    await send_control(nc, SUBJECTS, decision)
    control = await controls.open(turn())
    got = await control.wait_decision("t1-1-0", timeout=10)
    assert got is not None and got.approved and got.call_id == "t1-1-0"
    assert await control.wait_decision("t1-1-1", timeout=0.05) is None


async def test_an_approval_arriving_while_waiting_wakes_the_wait(nc, controls):
    control = await controls.open(turn())
    waiter = asyncio.create_task(control.wait_decision("t1-1-0", timeout=30))
    await publish(
        nc, ApprovalDecision(tenant="acme", session="s1", call_id="t1-1-0", approved=False)
    )
    got = await asyncio.wait_for(waiter, 10)
    assert got is not None and got.approved is False


async def test_bad_control_messages_are_refused_with_an_error_event_on_their_session(nc, controls):
    control = await controls.open(turn())
    await nc.publish(SUBJECTS.control("acme", "s1"), b'{"type": "explode"}')
    await nc.publish(SUBJECTS.control("acme", "s1"), b"not json")
    newer = b'{"v": 99, "type": "cancel", "tenant": "acme", "session": "s1", "turn_id": "t1"}'
    await nc.publish(SUBJECTS.control("acme", "s1"), newer)
    errors = await _errors(nc, "acme", "s1", 3)
    assert not control.cancelled.is_set()  # the version-99 cancel did nothing
    await publish(nc, Cancel(tenant="acme", session="s1"))
    await asyncio.wait_for(control.cancelled.wait(), 10)
    by_code = sorted((e.code, e.turn_id) for e in errors)
    assert by_code == [
        ("invalid_message", "unknown"), ("invalid_message", "unknown"),
        ("unsupported_version", "t1"),
    ]  # fmt: skip
    messages = " | ".join(e.message for e in errors)
    assert "Invalid value 'explode' - at `$.type`" in messages
    assert "malformed JSON" in messages and "schema version 99" in messages
    assert all(not e.fatal for e in errors)


async def test_a_control_whose_body_names_another_session_acts_on_nothing(nc, controls):
    """Who may publish acme's controls may not cancel another tenant's turn by naming it."""
    victim = await controls.open(turn(tenant="other", session="zz"))
    hostile = Cancel(tenant="other", session="zz", reason="gotcha")
    await nc.publish(SUBJECTS.control("acme", "s1"), encode(hostile))
    [error] = await _errors(nc, "acme", "s1", 1)
    assert error.code == "subject_mismatch"
    assert "'other'" in error.message and "'acme'" in error.message
    assert not await _recorded(nc, "other.zz")
    assert not await _recorded(nc, "acme.s1")
    assert await stream_events(nc, "other", "zz") == []
    await publish(nc, Cancel(tenant="other", session="zz", reason="its own"))
    await asyncio.wait_for(victim.cancelled.wait(), 5.0)  # routed in order, after the hostile one
    assert victim.cancel_reason == "its own"


async def _errors(nc, tenant: str, session: str, count: int) -> list[Error]:
    async def enough() -> bool:
        return len(await stream_events(nc, tenant, session)) >= count

    await wait_for(enough, what=f"{count} error events")
    events = [e for e, _ in await stream_events(nc, tenant, session)]
    assert all(isinstance(e, Error) for e in events)
    return events  # type: ignore[return-value]


async def _recorded(nc, key: str) -> bool:
    """Whether the control bucket's leader holds a record of ``key``."""
    return await kv_read(nc, SUBJECTS.control_bucket, key) is not None
