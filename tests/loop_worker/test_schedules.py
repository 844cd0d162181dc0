"""A schedule run by a real loop worker's scheduler, on one server and on the R3 cluster:
``skip`` skips the ticks that come while its run is still going (a slow tool call), and
fires again once that run has ended."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopmesh.jetstream import Publisher, open_kv
from loopmesh.schedules import ScheduleStore, new_schedule
from loopmesh.testing.durable import SUBJECTS, stream_events, wait_for
from loopmesh.testing.fake_llm import tool_calls
from schemas.events import LoopEnd
from schemas.schedules import ScheduleState
from tests.conftest import BOTH
from tests.loop_worker.durable import mesh_on

pytestmark = pytest.mark.parametrize("durable", BOTH, indirect=True)


async def test_skip_skips_ticks_while_the_run_is_still_going(durable, tmp_path: Path) -> None:
    ledger = tmp_path / "count"
    slow = ("local__count", {"path": str(ledger), "label": "a", "seconds": 3.0})
    async with mesh_on(durable.url, replicas=durable.replicas, workers=True) as mesh:
        mesh.fake.script(tool_calls(slow), tool_calls(("task_completion", {"result": "ok"})))
        publisher = Publisher(mesh.nc)
        kv = await open_kv(mesh.nc.jetstream(), publisher, SUBJECTS.schedules_bucket)
        store = ScheduleStore(kv, mesh.nc.jetstream(), SUBJECTS)
        schedule = new_schedule(
            "acme", id="often", cron="* * * * * *", input="count", session="s1", policy="skip"
        )
        await store.create(schedule)

        async def state() -> ScheduleState:
            found, _ = await store.state("acme", "often")
            return found or ScheduleState(uid=schedule.uid)

        await wait_for(ledger.exists, timeout=30, what="the first run's slow tool")

        async def fired_twice() -> bool:
            return sum(r.outcome == "fired" and r.published for r in (await state()).runs) >= 2

        await wait_for(fired_twice, timeout=30, what="a run after the first ended")
        await store.set_paused("acme", "often", True)
        runs = list(reversed((await state()).runs))  # oldest first
        first, second = [r for r in runs if r.outcome == "fired"][:2]

        async def both_ended() -> bool:
            ends = [
                e for e, _ in await stream_events(mesh.nc, "acme", "s1") if e.type == "loop_end"
            ]
            return {first.turn_id, second.turn_id} <= {e.turn_id for e in ends}

        await wait_for(both_ended, timeout=30, what="both runs to end")
        await publisher.close()
        stored = [e for e, _ in await stream_events(mesh.nc, "acme", "s1")]
    between = runs[runs.index(first) + 1 : runs.index(second)]
    assert len(between) >= 2 and {r.outcome for r in between} == {"skipped"}
    assert all(r.reason == f"run {first.turn_id} has not ended" for r in between)
    ends = [e for e in stored if isinstance(e, LoopEnd)]
    assert [e.turn_id for e in ends][:2] == [first.turn_id, second.turn_id]
    assert ends[0].reason == "task_completion"
    assert ledger.read_text() == "a\n"  # the first run's tool ran once
