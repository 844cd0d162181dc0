"""Two deliveries of one turn on one worker: the second never loses the session's lease
to the first's late release.

A turn's first delivery stops renewing its lease once its hand-over starts (ack, then
release), and across a node restart the ack can take seconds: the lease lapses, and the
turn, its in-progress acks lost meanwhile, is delivered again to the same worker. That
second delivery takes the lapsed lease (a take retried through the restart) and starts.
When the first delivery's release comes at last, it must leave the second's lease
alone: same worker, same turn, but another take. Freed, it let the session's next turn
run while the second delivery was still loading the session, which then read the next
turn's snapshot and ran its turn again on top of it: the session counted the turn twice
(its events, under the same ids as the first run's, were dropped as duplicates)."""

import asyncio

import pytest
from prometheus_client import REGISTRY

from loop_worker.lease import Leases
from loop_worker.store import KVSessionStore
from loopmesh.testing.durable import SUBJECTS, kv_read, stream_events, tenant_consumer_of, wait_for
from schemas import SessionSnapshot, decode, encode
from tests.conftest import BOTH
from tests.loop_worker.durable import Watch, mesh_on, send_turn, turn, turns_left


@pytest.fixture
def slow_first_load(monkeypatch):
    """The worker's first snapshot load waits for ``go`` (``loading`` is set once it
    does): the second delivery's read, slow across the restart."""
    loading, go = asyncio.Event(), asyncio.Event()
    preload = KVSessionStore.preload

    async def slow(self, tenant, session, *, warm=False):
        if not loading.is_set():
            loading.set()
            await go.wait()
        return await preload(self, tenant, session, warm=warm)

    monkeypatch.setattr(KVSessionStore, "preload", slow)
    return loading, go


def _conflicts() -> float:
    return REGISTRY.get_sample_value("loopmesh_lease_conflicts_total") or 0.0


async def test_a_late_release_of_a_turns_first_delivery_leaves_the_second_its_lease(
    nats_server, slow_first_load
):
    loading, go = slow_first_load
    async with mesh_on(nats_server.url) as mesh:
        nc, js = mesh.nc, mesh.nc.jetstream()
        await mesh.loop_worker("w1")
        # t1's first delivery on w1, as its hand-over leaves it: its lease no longer
        # renewed, its ack and release still to come
        leases = Leases(nc, SUBJECTS, owner="w1")
        await leases.start()
        first = await leases.try_acquire("acme", "s1", "t1")
        assert first is not None
        async with Watch(nc) as watch:
            seq = await send_turn(nc, turn("t1", "say t1"))
            # the second delivery takes the lease once the first's lapses, and loads
            await asyncio.wait_for(loading.wait(), 30)
            # the first delivery's hand-over: t1 acked (it leaves the work queue), then
            # its lease released
            await js.delete_msg(SUBJECTS.turns_stream, seq)
            await first.release(continuable=True)
            conflicts = _conflicts()
            await send_turn(nc, turn("t2", "say t2"))
            # t2 finds the session held by t1's second delivery (or, wrongly, runs)
            await wait_for(
                lambda: _conflicts() > conflicts or bool(watch.of("loop_end", "t2")),
                timeout=30,
                what="t2 to find the session held",
            )
            go.set()
            await watch.wait("loop_end", "t1", timeout=30)
            await watch.wait("loop_end", "t2", timeout=30)
            runs = [
                (e.type, e.turn_id) for e in watch.events if e.type in ("loop_start", "loop_end")
            ]
        assert runs == [
            ("loop_start", "t1"), ("loop_end", "t1"), ("loop_start", "t2"), ("loop_end", "t2")
        ]  # fmt: skip
        kv = await js.key_value(SUBJECTS.sessions_bucket)
        snapshot = decode((await kv.get("acme.s1")).value or b"", SessionSnapshot)
        assert (snapshot.turn_id, snapshot.status, snapshot.turns) == ("t2", "idle", 2)
        assert [m.content for m in snapshot.messages if m.role == "user"] == ["say t1", "say t2"]


async def test_a_redelivery_whose_take_waited_for_the_first_deliverys_hand_over_is_not_run(
    nats_server, monkeypatch
):
    """The second delivery reads the turn still in the stream, then its take waits for
    the worker's own hand-over of the session: the first delivery's ack, then release.
    Once it has the lease, the turn has left the stream: it is not run again."""
    from loop_worker import turn as turn_module

    reads: list[int | None] = []
    first_turn = turn_module.first_turn

    async def recorded(*args):
        first = await first_turn(*args)
        reads.append(first)
        return first

    monkeypatch.setattr(turn_module, "first_turn", recorded)
    async with mesh_on(nats_server.url) as mesh:
        nc, js = mesh.nc, mesh.nc.jetstream()
        seq = await send_turn(nc, turn("t1", "say t1"))
        await tenant_consumer_of(nc, "acme")
        sub = await js.pull_subscribe_bind(SUBJECTS.tenant_consumer("acme"), SUBJECTS.turns_stream)
        [delivered] = await sub.fetch(1, timeout=10)  # the first delivery, held here
        held = asyncio.create_task(_in_progress(delivered))
        worker = await mesh.loop_worker("w1")
        # the first delivery on w1 ends: its lease taken, its hand-over on its way
        lease = await worker.service.leases.try_acquire("acme", "s1", "t1")
        assert lease is not None
        acked = asyncio.Event()
        hand_over = asyncio.create_task(lease.release(after=acked.wait(), continuable=True))
        held.cancel()
        await delivered.nak()  # the turn delivered again, to w1
        await wait_for(lambda: seq in reads, timeout=30, what="the second delivery's read")
        await js.delete_msg(SUBJECTS.turns_stream, seq)  # the first delivery's ack
        acked.set()
        await hand_over
        await wait_for(lambda: not worker.service._held, timeout=30, what="the delivery to end")
        assert await stream_events(nc, "acme", "s1") == []  # it did not run
        assert await kv_read(nc, SUBJECTS.sessions_bucket, "acme.s1") is None
        await sub.unsubscribe()


async def _in_progress(msg) -> None:
    while True:
        await msg.in_progress()
        await asyncio.sleep(0.5)  # within AckWait (2 s): the turn stays with this delivery


@pytest.mark.parametrize("durable", BOTH, indirect=True)
async def test_a_turn_delivered_again_after_its_session_moved_on_is_acked_not_run(durable):
    """A delivery of t1 that gets past the queue checks after t2 ran on top of it (a
    check that raced t1's ack: a stream leader that had not applied it yet; or a copy
    of t1 published again) finds t1 among the turns its session's snapshot ended: it is
    acked and not run, so the session holds t1 once."""
    async with mesh_on(durable.url, replicas=durable.replicas, workers=True) as mesh:
        nc = mesh.nc
        async with Watch(nc) as watch:
            for turn_id in ("t1", "t2"):
                await send_turn(nc, turn(turn_id, f"say {turn_id}"))
                await watch.wait("loop_end", turn_id, timeout=30)
            # t1 once more, under no Nats-Msg-Id, so the stream keeps it: in the queue
            # after t2, it passes every check of the stream
            again = turn("t1", "say t1")
            await nc.jetstream().publish(SUBJECTS.turn("acme", "s1"), encode(again))
            await wait_for(lambda: _empty(nc), timeout=30, what="the copy to be acked")
        value = await kv_read(nc, SUBJECTS.sessions_bucket, "acme.s1")
        snapshot = decode(value or b"", SessionSnapshot)
        assert (snapshot.turn_id, snapshot.status, snapshot.turns) == ("t2", "idle", 2)
        assert [m.content for m in snapshot.messages if m.role == "user"] == ["say t1", "say t2"]
        assert snapshot.ended_turns == ("t1", "t2")


async def _empty(nc) -> bool:
    return await turns_left(nc) == 0
