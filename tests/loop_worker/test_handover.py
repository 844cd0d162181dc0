"""A session's next turn, published the moment its last one ends, on whichever of several
loop workers pulls it: handed over at once, never left to AckWait.

Clients send a session's next turn when they see its ``loop_end``, which is stored
before the last turn is acked and its lease released: the next turn usually arrives
while that hand-over is on its way, often at another worker than the last one. Or they
send it before: it then waits, held by its worker, for the turn before it to end. And
whichever worker a turn is delivered to takes it at once, not when its pull request
expires."""

import asyncio
import logging

import pytest

from loopmesh.testing.durable import SUBJECTS, Proc, provision_short, wait_for, worker_env
from schemas.events import LoopEnd, LoopStart
from tests.conftest import BOTH
from tests.loop_worker.durable import Watch, mesh_on, send_turn, turn, turns_left

both = pytest.mark.parametrize("durable", BOTH, indirect=True)

SESSIONS = 16
TURNS = 6  # per session, back to back
ACK_WAIT_S = 30.0  # long: a turn left to AckWait would keep this test waiting


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


PULL_EXPIRES_S = 600  # each pull request lasts ten minutes, longer than the test waits
#: Turns of the tenant delivered and not yet acked, fleet-wide (``[tenants] max_active_turns``,
#: its consumer's max_ack_pending): past it the consumer delivers a turn only when one is
#: acked, so turns stay pending while both workers' pull requests wait.
MAX_ACTIVE = 4


@pytest.mark.slow
async def test_turns_on_two_worker_processes_start_as_soon_as_they_are_delivered(
    mesh, durable, tmp_path
):
    """Two loop-worker processes whose pull requests last ten minutes. Half the sessions
    publish all their turns at once (each next one while the one before runs), half
    back to back: every turn ends, in its session's order, on its first delivery (none
    handed back or delivered again). A worker that kept the turns delivered to it until
    its pull request was done (a fetch that waits for its batch to fill, as nats-py's
    does) would keep them ten minutes, past this test's wait."""
    config = tmp_path / "loopmesh.toml"
    config.write_text(f"[tenants.acme]\nmax_active_turns = {MAX_ACTIVE}\n")
    procs = []
    try:
        for name in ("w1", "w2"):
            env = worker_env(
                durable.url, mesh.llm_url, replicas=durable.replicas, name=name,
                ack_wait_s=ACK_WAIT_S, lease_ttl_s=ACK_WAIT_S, fetch_timeout_s=PULL_EXPIRES_S,
            )  # fmt: skip
            env["LOOPMESH_CONFIG"] = str(config)
            procs.append(proc := Proc("-m", "loop_worker", env=env))
            await proc.start("loop worker ready")

        async def session(k: int, at_once: bool) -> list[LoopStart | LoopEnd]:
            ids = [f"s{k}t{i}" for i in range(TURNS)]
            async with Watch(mesh.nc, session=f"s{k}") as watch:
                for turn_id in ids:
                    await send_turn(mesh.nc, turn(turn_id, f"say {turn_id}", session=f"s{k}"))
                    if not at_once:
                        await watch.wait("loop_end", turn_id, timeout=60)
                await watch.wait("loop_end", ids[-1], timeout=60)
                return [e for e in watch.events if isinstance(e, (LoopStart, LoopEnd))]

        ran = await asyncio.gather(*(session(k, at_once=k % 2 == 0) for k in range(SESSIONS)))
        for k, events in enumerate(ran):
            assert [(e.type, e.turn_id) for e in events] == [
                (t, f"s{k}t{i}") for i in range(TURNS) for t in ("loop_start", "loop_end")
            ], f"session s{k} ran out of order or twice"
            assert not any(isinstance(e, LoopStart) and e.resumed for e in events)
        await wait_for(lambda: _acked(mesh.nc), what="every turn acked")
        consumer = SUBJECTS.tenant_consumer("acme")
        info = await mesh.nc.jetstream().consumer_info(SUBJECTS.turns_stream, consumer)
        assert info.config.max_ack_pending == MAX_ACTIVE
        assert info.delivered.consumer_seq == SESSIONS * TURNS, "a turn was delivered again"
    finally:
        for proc in procs:
            await proc.close()
