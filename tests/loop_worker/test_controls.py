import asyncio
import logging
import time

import pytest

from loop_worker.controls import Controls, send_control
from loopmesh.testing.durable import SUBJECTS, provision_short, wait_for
from schemas import ApprovalDecision, Cancel, Pause, Resume, Turn, encode


def turn(turn_id: str = "t1", **kw) -> Turn:
    return Turn(id=turn_id, tenant="acme", session="s1", input="hi", created_at=time.time(), **kw)


@pytest.fixture
async def controls(nc):
    await provision_short(nc)
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
    started = time.monotonic()
    await publish(nc, Cancel(tenant="acme", session="s1", reason="stop"))
    await asyncio.wait_for(control.cancelled.wait(), 1.0)
    assert control.cancel_reason == "stop"
    assert time.monotonic() - started < 0.2


async def test_a_control_for_another_turn_is_ignored(nc, controls):
    control = await controls.open(turn("t1"))
    routed = asyncio.Event()
    controls.on_routed = lambda c: routed.set()
    await publish(nc, Cancel(tenant="acme", session="s1", turn_id="t0"))
    await publish(nc, Pause(tenant="acme", session="s1", turn_id="t1"))
    await asyncio.wait_for(routed.wait(), 1.0)
    assert control.paused and not control.cancelled.is_set()


async def test_pause_and_resume_reach_the_running_turn(nc, controls):
    control = await controls.open(turn())
    await publish(nc, Pause(tenant="acme", session="s1"))
    await wait_for(lambda: control.paused, timeout=1)
    await publish(nc, Resume(tenant="acme", session="s1"))
    await asyncio.wait_for(control.wait_running(), 1.0)


async def test_a_cancel_sent_while_no_worker_runs_the_turn_applies_when_it_starts(nc, controls):
    t1 = turn("t1")
    await publish(nc, Cancel(tenant="acme", session="s1", turn_id="t1", reason="late"))
    await wait_for(lambda: _recorded(controls, "acme.s1"), what="the control record")
    control = await controls.open(t1)
    assert control.cancelled.is_set() and control.cancel_reason == "late"
    await controls.close_turn(t1, control)
    nxt = await controls.open(turn("t2"))  # the session's next turn is not cancelled
    assert not nxt.cancelled.is_set()


async def test_a_cancel_naming_no_turn_spares_turns_created_after_it(nc, controls):
    await send_control(nc, SUBJECTS, Cancel(tenant="acme", session="s1", at=time.time()))
    control = await controls.open(turn("t9"))
    assert not control.cancelled.is_set()


async def test_an_approval_recorded_while_no_worker_ran_is_found_by_wait_decision(nc, controls):
    decision = ApprovalDecision(tenant="acme", session="s1", call_id="t1-1-0", approved=True)
    await send_control(nc, SUBJECTS, decision)
    control = await controls.open(turn())
    got = await control.wait_decision("t1-1-0", timeout=1.0)
    assert got is not None and got.approved and got.call_id == "t1-1-0"
    assert await control.wait_decision("t1-1-1", timeout=0.05) is None


async def test_an_approval_arriving_while_waiting_wakes_the_wait(nc, controls):
    control = await controls.open(turn())
    waiter = asyncio.create_task(control.wait_decision("t1-1-0", timeout=5.0))
    await publish(
        nc, ApprovalDecision(tenant="acme", session="s1", call_id="t1-1-0", approved=False)
    )
    got = await asyncio.wait_for(waiter, 1.0)
    assert got is not None and got.approved is False


async def test_bad_control_messages_are_logged_and_ignored(nc, controls, caplog):
    control = await controls.open(turn())
    with caplog.at_level(logging.WARNING, logger="loopmesh.loop_worker.controls"):
        await nc.publish(SUBJECTS.control("acme", "s1"), b'{"type": "explode"}')
        await nc.publish(SUBJECTS.control("acme", "s1"), b"not json")
        await publish(nc, Cancel(tenant="acme", session="s1"))
        await asyncio.wait_for(control.cancelled.wait(), 1.0)
    assert sum("bad control message" in r.message for r in caplog.records) >= 2


async def _recorded(controls: Controls, key: str) -> bool:
    try:
        await controls.kv.get(key)
    except Exception:
        return False
    return True
