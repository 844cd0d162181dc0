"""``[tenants] max_backlog`` for turns published straight to NATS: a turn published while
its tenant has as many waiting as it may is refused at once (``error`` code
``backlog_full``, ``loop_end`` reason ``error``), never runs, and is kept in the
dead-letter stream; the turns within the limit all run. Real loop workers on one
nats-server and on a 3-node cluster."""

from __future__ import annotations

import asyncio

import pytest

from loopmesh.settings import TenantSettings
from loopmesh.testing.durable import drained, stream_events, wait_for
from loopmesh.testing.fake_replies import tool_calls
from schemas import Subjects
from tests.conftest import BOTH
from tests.loop_worker.durable import mesh_on, send_turn, turn

pytestmark = pytest.mark.slow

LIMIT = 3
TURNS = 16  # on as many sessions, published at once


def slow() -> object:
    """A model reply that takes about 0.2 s to stream, then ends the turn."""
    return tool_calls(("task_completion", {"result": "ok"}), content="abcd", chunk_size=1,
                      delay_s=0.05)  # fmt: skip


async def ended(nc, tenant: str, session: str) -> list:
    return [e for e, _ in await stream_events(nc, tenant, session)]


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_turns_published_past_the_backlog_limit_are_refused_and_never_run(durable):
    s = Subjects()
    async with mesh_on(durable.url, replicas=durable.replicas) as mesh:
        mesh.fake.default = slow()
        tenants = {"acme": TenantSettings(max_backlog=LIMIT)}
        for name in ("w1", "w2"):  # one place each, nothing held waiting
            await mesh.loop_worker(name, max_active_turns=1, max_waiting_turns=0, tenants=tenants)
        await asyncio.gather(
            *(send_turn(mesh.nc, turn(f"t{i}", "hi", session=f"s{i}")) for i in range(TURNS))
        )

        async def all_ended() -> bool:
            for i in range(TURNS):
                if not any(e.type == "loop_end" for e in await ended(mesh.nc, "acme", f"s{i}")):
                    return False
            return True

        await wait_for(all_ended, timeout=90, what="every turn to end")
        ran, refused = [], []
        for i in range(TURNS):
            events = await ended(mesh.nc, "acme", f"s{i}")
            [end] = [e for e in events if e.type == "loop_end"]  # each ended once
            if end.reason == "task_completion":
                ran.append(i)
                continue
            assert end.reason == "error" and end.error.startswith("backlog_full"), end
            [error] = [e for e in events if e.type == "error"]
            assert error.code == "backlog_full" and f"max_backlog = {LIMIT}" in error.message
            assert not [e for e in events if e.type == "loop_start"]  # it never ran
            refused.append(i)
        # 16 turns at once, 2 places, 3 may wait: most are refused, and those within the
        # limit all ran (the first three heard, at least, were within it)
        assert refused, "no turn was refused"
        assert len(ran) >= LIMIT, ran
        await drained(mesh.nc, s.turns_stream)  # the refused ones were acked too

        js = mesh.nc.jetstream()

        async def buried() -> bool:
            info = await js.stream_info(s.deadletter_stream)
            return info.state.messages == len(refused)

        await wait_for(buried, what="a dead-letter record per refused turn")
        info = await js.stream_info(s.deadletter_stream)
        records = [
            await js.get_msg(s.deadletter_stream, seq)
            for seq in range(info.state.first_seq, info.state.last_seq + 1)
        ]
        assert sorted((r.headers or {})["Loopmesh-Subject"] for r in records) == sorted(
            s.turn("acme", f"s{i}") for i in refused
        )
        assert all((r.headers or {})["Loopmesh-Reason"].startswith("backlog_full") for r in records)

        # with room again, a refused turn published again (after the duplicate window,
        # under a new id) runs, and so does a new one
        again = refused[0]
        await send_turn(mesh.nc, turn(f"t{again}-again", "hi", session=f"s{again}"))
        await send_turn(mesh.nc, turn("late", "hi", session="late"))

        async def both_ran() -> bool:
            a = await ended(mesh.nc, "acme", f"s{again}")
            b = await ended(mesh.nc, "acme", "late")
            done = [e for e in a + b if e.type == "loop_end" and e.reason == "task_completion"]
            return len(done) == 2

        await wait_for(both_ran, timeout=30, what="the turns published with room to run")


@pytest.mark.parametrize("durable", ["single"], indirect=True)
async def test_a_tenant_without_a_limit_is_never_refused(durable):
    async with mesh_on(durable.url) as mesh:
        mesh.fake.default = slow()
        limited = {"other": TenantSettings(max_backlog=1)}
        await mesh.loop_worker(max_active_turns=1, max_waiting_turns=0, tenants=limited)
        await asyncio.gather(
            *(send_turn(mesh.nc, turn(f"t{i}", "hi", session=f"s{i}")) for i in range(8))
        )

        async def all_ran() -> bool:
            for i in range(8):
                events = await ended(mesh.nc, "acme", f"s{i}")
                if not any(e.type == "loop_end" for e in events):
                    return False
                assert [e.reason for e in events if e.type == "loop_end"] == ["task_completion"]
            return True

        await wait_for(all_ran, timeout=60, what="every turn to run")
