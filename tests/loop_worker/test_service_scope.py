"""The subject is authoritative and ids are scoped per tenant and session: a durable
loop worker and a real tool worker on one nats-server, against the fake LLM."""

import asyncio
import json

import pytest

from loopmesh.testing.durable import (
    SUBJECTS,
    stream_events,
    wait_for,
)
from schemas import Turn, encode
from schemas.events import Error, LoopEnd, ToolResultEvent
from tests.loop_worker.durable import Watch, count_task, send_turn, turn, turns_left


async def refused(watch: Watch, turn_id: str) -> tuple[Error, LoopEnd]:
    end = await watch.wait("loop_end", turn_id)
    [error] = watch.of("error", turn_id)
    assert isinstance(error, Error) and isinstance(end, LoopEnd)
    assert error.fatal and end.reason == "error"
    assert end.error is not None and end.error.startswith(f"{error.code}: ")
    return error, end


async def test_a_turn_whose_body_names_another_tenant_is_refused_on_its_subjects_session(
    mesh, tmp_path
):
    await mesh.tool_worker()
    await mesh.loop_worker()
    js = mesh.nc.jetstream()
    hostile = turn("t1", count_task(tmp_path / "n", "x"), tenant="other", session="zz")
    async with Watch(mesh.nc, "acme", "s3") as watch:
        await js.publish(
            SUBJECTS.turn("acme", "s3"), encode(hostile), headers={"Nats-Msg-Id": "acme.s3.t1"}
        )
        error, _ = await refused(watch, "t1")
        assert error.code == "subject_mismatch"
        assert "names tenant 'other' session 'zz'" in error.message
        assert "published to tenant 'acme' session 's3'" in error.message
        # the worker goes on: acme's next turn runs
        await send_turn(mesh.nc, turn("t2", "say hi", session="s3"))
        assert (await watch.wait("loop_end", "t2")).reason != "error"
    assert not (tmp_path / "n").exists()
    assert await stream_events(mesh.nc, "other", "zz") == []
    kv = await js.key_value(SUBJECTS.sessions_bucket)
    assert "other.zz" not in await kv.keys()
    assert all("say hi" in json.dumps(r["messages"]) for r in mesh.fake.requests)
    await wait_for(lambda: _none_left(mesh.nc), what="the refused turn termed")


async def _none_left(nc) -> bool:
    return await turns_left(nc) == 0


@pytest.mark.parametrize(
    ("body", "msg_id", "code", "turn_id", "says"),
    [
        (b"{not json", None, "invalid_message", "unknown", "malformed JSON"),
        (
            b'{"v": 2, "id": "t7", "tenant": "acme", "session": "s3", "input": "hi"}',
            None, "unsupported_version", "t7", "schema version 2",
        ),
        (  # newer and not decodable as ours: the version is what it is told
            b'{"v": 3, "id": "t7", "input": {"parts": []}}',
            None, "unsupported_version", "t7", "schema version 3",
        ),
        (
            b'{"id": "t7", "input": "hi"}',
            None, "invalid_message", "t7", "missing required field `tenant`",
        ),
        (
            b'{"id": "bad id", "tenant": "acme", "session": "s3", "input": "hi"}',
            None, "invalid_message", "unknown", "at `$.id`",
        ),
        (
            encode(Turn(id="t7", tenant="acme", session="s3", input="hi")),
            "t7", "invalid_msg_id", "t7", "publish it with 'acme.s3.t7'",
        ),
    ],
)  # fmt: skip
async def test_a_turn_that_cannot_be_run_gets_an_error_event_saying_why(
    mesh, body, msg_id, code, turn_id, says
):
    await mesh.loop_worker()
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    async with Watch(mesh.nc, "acme", "s3") as watch:
        await mesh.nc.jetstream().publish(SUBJECTS.turn("acme", "s3"), body, headers=headers)
        error, _ = await refused(watch, turn_id)
    assert error.code == code
    assert says in error.message, error.message
    assert mesh.fake.requests == []
    await wait_for(lambda: _none_left(mesh.nc), what="the refused turn termed")


@pytest.mark.parametrize("at_once", [True, False])
async def test_two_tenants_turns_of_the_same_id_both_run_and_see_only_their_own(
    mesh, tmp_path, at_once
):
    """Before, the second turn ``t1`` was dropped as a duplicate, or (outside the
    window) its call ``t1-1-0`` was answered from the first tenant's effect record."""
    await mesh.tool_worker()
    await mesh.loop_worker(max_active_turns=4)
    tenants = {"acme": "alpha", "other": "omega"}
    async with Watch(mesh.nc, "acme", "s1") as acme, Watch(mesh.nc, "other", "s1") as other:
        watches = {"acme": acme, "other": other}
        for tenant, label in tenants.items():  # at once: both queued before either runs
            task = count_task(tmp_path / tenant, label, seconds=0.5 if at_once else 0.0)
            await send_turn(mesh.nc, turn("t1", task, tenant=tenant, session="s1"))
            if not at_once:  # the second finds the first's effect records in the bucket
                await watches[tenant].wait("loop_end", "t1")
        ends = await asyncio.gather(*(w.wait("loop_end", "t1") for w in watches.values()))
    assert [e.reason for e in ends] == ["task_completion", "task_completion"]
    for tenant, label in tenants.items():
        assert (tmp_path / tenant).read_text() == f"{label}\n"  # each tool ran once
        stored = [e for e, _ in await stream_events(mesh.nc, tenant, "s1")]
        assert {(e.tenant, e.session, e.turn_id) for e in stored} == {(tenant, "s1", "t1")}
        counted = [e for e in stored if isinstance(e, ToolResultEvent) and e.tool == "count"]
        assert [e.content for e in counted] == [f"counted {label}"]
        [end] = [e for e in stored if isinstance(e, LoopEnd)]
        assert label in end.content and (set(tenants.values()) - {label}).pop() not in end.content
    starts = {t: w.of("loop_start", "t1")[0].ts for t, w in watches.items()}
    finish = {t: w.of("loop_end", "t1")[0].ts for t, w in watches.items()}
    overlapped = starts["acme"] < finish["other"] and starts["other"] < finish["acme"]
    assert overlapped == at_once
    calls = [w.of("tool_call", "t1")[0] for w in watches.values()]
    assert len({c.call_id for c in calls}) == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(("lane", "priority"), [("interactive", "batch"), ("batch", "interactive")])
async def test_a_turn_whose_priority_differs_from_its_subjects_lane_is_refused(
    mesh, lane, priority
):
    await mesh.loop_worker()
    body = turn("t7", "hi", session="s3", priority=priority)
    async with Watch(mesh.nc, "acme", "s3") as watch:
        await mesh.nc.jetstream().publish(
            SUBJECTS.turn("acme", "s3", lane), encode(body), headers={"Nats-Msg-Id": body.msg_id}
        )
        error, _ = await refused(watch, "t7")
    assert error.code == "subject_mismatch"
    assert f"priority is {priority!r}" in error.message, error.message
    assert SUBJECTS.turn("acme", "s3", priority) in error.message
    assert mesh.fake.requests == []
    await wait_for(lambda: _none_left(mesh.nc), what="the refused turn acked")
