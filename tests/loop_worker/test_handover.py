"""A session's next turn, published the moment its last one ends, on whichever of several
loop workers pulls it: handed over at once, never left to AckWait.

Clients send a session's next turn when they see its ``loop_end``, which is stored
before the last turn is acked and its lease released: the next turn usually arrives
while that hand-over is on its way, often at another worker than the last one."""

import asyncio
import logging

import pytest

from loopmesh.testing.durable import SUBJECTS, provision_short, wait_for
from schemas.events import LoopStart
from tests.conftest import BOTH
from tests.loop_worker.durable import Watch, mesh_on, send_turn, turn, turns_left

both = pytest.mark.parametrize("durable", BOTH, indirect=True)

SESSIONS = 16
TURNS = 6  # per session, back to back
ACK_WAIT_S = 30.0  # the default: a turn left to it would keep this test waiting


@pytest.fixture
async def mesh(durable):
    async with mesh_on(durable.url, replicas=durable.replicas, provisioned=True) as mesh:
        await provision_short(mesh.nc, lease_ttl_s=ACK_WAIT_S, replicas=durable.replicas)
        yield mesh


@pytest.fixture
def slow_acks(monkeypatch):
    """A turn's ack takes longer than its lease's release, as on a loaded cluster: the
    next turn's worker can then find the lease free while the last turn is still in
    the stream."""
    from loop_worker.turn import TurnRun

    ack = TurnRun._ack

    async def slow(self, t):
        await asyncio.sleep(0.1)
        await ack(self, t)

    monkeypatch.setattr(TurnRun, "_ack", slow)


@both
async def test_back_to_back_turns_on_two_workers_are_each_run_once_and_none_is_lost(
    mesh, slow_acks
):
    """Every turn runs once, on its first delivery: none is lost to a stale snapshot,
    handed back or delivered again. (Before hand-overs were fixed, a worker that took a
    session's lease early, found the last turn still in the stream and gave the lease
    back, then took it again as its own "continued" lease and started from the
    snapshot it had kept two turns ago; its checkpoint lost the race, and the turn
    waited out AckWait.)"""
    workers = [
        await mesh.loop_worker(name, ack_wait_s=ACK_WAIT_S, lease_ttl_s=ACK_WAIT_S)
        for name in ("w1", "w2")
    ]
    failed = asyncio.Event()
    outcomes = ("took over", "stale snapshot", "handing it back")

    class Failures(logging.Handler):  # a turn lost, stale or handed back is logged so
        def emit(self, record: logging.LogRecord) -> None:
            if any(o in record.getMessage() for o in outcomes):
                failed.set()

    handler = Failures(logging.WARNING)
    logging.getLogger("loopmesh.loop_worker").addHandler(handler)

    async def session(k: int) -> list[LoopStart]:
        async with Watch(mesh.nc, session=f"s{k}") as watch:
            for i in range(TURNS):
                turn_id = f"s{k}t{i}"
                await send_turn(mesh.nc, turn(turn_id, f"say {turn_id}", session=f"s{k}"))
                ended = asyncio.ensure_future(watch.wait("loop_end", turn_id, timeout=120))
                await asyncio.wait({ended, asyncio.ensure_future(failed.wait())},
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if not ended.done():
                    ended.cancel()
                    return []
                ended.result()
            return [e for e in watch.events if isinstance(e, LoopStart)]

    try:
        starts = await asyncio.gather(*(session(k) for k in range(SESSIONS)))
    finally:
        logging.getLogger("loopmesh.loop_worker").removeHandler(handler)
    stats = {w.service.name: w.service.stats for w in workers}
    assert not failed.is_set(), f"a turn was lost, stale or handed back: {stats}"
    for k, started in enumerate(starts):
        assert [(e.turn_id, e.resumed) for e in started] == [
            (f"s{k}t{i}", False) for i in range(TURNS)
        ]
    await wait_for(lambda: _acked(mesh.nc), what="every turn acked")
    info = await mesh.nc.jetstream().consumer_info(
        SUBJECTS.turns_stream, SUBJECTS.tenant_consumer("acme")
    )
    assert info.num_redelivered == 0
    assert sum(s["finished"] for s in stats.values()) == SESSIONS * TURNS


async def _acked(nc) -> bool:
    return await turns_left(nc) == 0
