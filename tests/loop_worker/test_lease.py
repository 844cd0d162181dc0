import asyncio
import time

import pytest

from loop_worker.errors import LeaseLostError
from loop_worker.lease import Leases
from loopmesh.testing.durable import SUBJECTS, provision_short, wait_for
from tests.conftest import BOTH_SHARED, durable_nc

pytestmark = pytest.mark.parametrize("durable", BOTH_SHARED, indirect=True)  # R1 and R3


nc = durable_nc()


@pytest.fixture
async def leases(nc, durable):
    await provision_short(nc, lease_ttl_s=1.0, replicas=durable.replicas)

    async def make(owner: str) -> Leases:
        leases = Leases(nc, SUBJECTS, owner=owner)
        await leases.start()
        return leases

    return make


async def test_a_held_lease_cannot_be_taken_until_released(leases):
    a, b = await leases("a"), await leases("b")
    lease = await a.try_acquire("acme", "s1", "t1")
    assert lease is not None and a.ttl_s == 1.0
    assert await b.try_acquire("acme", "s1", "t2") is None
    assert (await b.holder("acme", "s1")).owner == "a"
    assert await b.try_acquire("acme", "s2", "t3") is not None  # other sessions are free
    await lease.release()
    assert await b.try_acquire("acme", "s1", "t2") is not None


async def test_a_dead_holders_lease_expires_with_the_ttl(leases):
    a, b = await leases("a"), await leases("b")
    assert await a.try_acquire("acme", "s1", "t1") is not None  # then a dies
    started = time.monotonic()
    lease = await asyncio.wait_for(b.acquire("acme", "s1", "t1"), 30)
    assert time.monotonic() - started > 0.5  # not before the TTL (1 s)
    assert lease.record.owner == "b"


async def test_a_kept_lease_outlives_its_ttl(leases):
    a, b = await leases("a"), await leases("b")
    lease = await a.try_acquire("acme", "s1", "t1")
    keeper = asyncio.create_task(lease.keep())
    taker = asyncio.create_task(b.acquire("acme", "s1", "t2"))
    try:
        # Renewals come a third of a TTL apart: after the 5th, more than a TTL has passed.
        await wait_for(lambda: lease.record.renewals >= 5 or keeper.done(), timeout=30)
        assert not keeper.done() and not taker.done()
        assert await b.try_acquire("acme", "s1", "t3") is None
    finally:
        keeper.cancel()
        taker.cancel()
        await asyncio.gather(keeper, taker, return_exceptions=True)


async def test_renewing_a_lease_someone_else_took_raises_lease_lost(leases):
    a, b = await leases("a"), await leases("b")
    lease = await a.try_acquire("acme", "s1", "t1")
    await b.acquire("acme", "s1", "t1")  # after a's lease lapsed
    with pytest.raises(LeaseLostError):
        await lease.renew()
    await lease.release()  # not ours any more: leaves b's lease alone
    assert (await b.holder("acme", "s1")).owner == "b"


async def test_a_released_lease_is_taken_again_by_its_worker_and_by_others(nc, leases):
    a, b = await leases("a"), await leases("b")
    info = await nc.jetstream().stream_info(f"KV_{SUBJECTS.leases_bucket}")
    before = info.state.last_seq
    for owner, turn in ((a, "t1"), (a, "t2"), (b, "t3"), (a, "t4")):
        lease = await owner.try_acquire("acme", "s1", turn)
        assert lease is not None, turn
        assert (await b.holder("acme", "s1")).turn_id == turn
        await lease.release()
        assert await b.holder("acme", "s1") is None
    info = await nc.jetstream().stream_info(f"KV_{SUBJECTS.leases_bucket}")
    assert info.state.last_seq - before == 8  # a write and a delete marker per turn


async def test_a_lease_continues_only_when_its_worker_was_the_last_to_hold_it(leases):
    a, b = await leases("a"), await leases("b")
    continued = []
    for owner, turn in ((a, "t1"), (a, "t2"), (b, "t3"), (a, "t4"), (a, "t5")):
        lease = await owner.try_acquire("acme", "s1", turn)
        assert lease is not None, turn
        continued.append(lease.continued)
        await lease.release(continuable=True)
    assert continued == [False, True, False, False, True]
    lease = await a.try_acquire("acme", "s1", "t6")
    assert lease is not None
    await wait_for(  # the TTL takes the lease: the next take reads, and does not continue
        lambda: _free(a), timeout=30, what="the lease to expire"
    )
    again = await a.try_acquire("acme", "s1", "t7")
    assert again is not None and not again.continued


async def test_a_take_while_the_workers_own_release_is_on_its_way_continues(leases):
    """A session's next turn can reach the worker while the last turn's hand-over is
    still on its way: the take waits for that release and continues from it (one
    write, and the turn starts warm) instead of racing it and reading the marker."""
    a = await leases("a")
    for turn in ("t1", "t3", "t5"):
        lease = await a.try_acquire("acme", "s1", turn)
        assert lease is not None
        _, again = await asyncio.gather(
            lease.release(continuable=True), a.try_acquire("acme", "s1", turn + "'")
        )
        assert again is not None and again.continued, turn
        await again.release(continuable=True)


async def test_a_lease_given_back_unused_does_not_continue(leases):
    """Only a release that ends a run of the session vouches for what its worker kept
    of it. A lease taken and given back unused (the session's last turn was still in
    the stream, running elsewhere) does not: another worker may have run turns of the
    session since this one last did. (It did, before: the loop worker then started a
    turn from a snapshot two turns old, its checkpoint lost the race, and the turn
    waited out AckWait.)"""
    a, b = await leases("a"), await leases("b")
    lease = await a.try_acquire("acme", "s1", "t1")
    await lease.release(continuable=True)  # a ran t1 and kept the session
    lease = await b.try_acquire("acme", "s1", "t2")
    await lease.release(continuable=True)  # b ran t2
    early = await a.try_acquire("acme", "s1", "t3")  # t2 not yet acked: given back
    assert early is not None and not early.continued
    await early.release()
    again = await a.try_acquire("acme", "s1", "t3")
    assert again is not None and not again.continued
    await again.release(continuable=True)


async def test_a_release_acks_first_and_wakes_a_waiting_take(leases):
    """The turn is acked before its lease is released (``after``), and the release
    wakes a worker waiting for the lease: the waiter sees the delete."""
    a, b = await leases("a"), await leases("b")
    lease = await a.try_acquire("acme", "s1", "t1")
    taker = asyncio.create_task(b.acquire("acme", "s1", "t2"))
    await wait_for(lambda: "acme.s1" in b._watch._keys, what="b waiting on the key")
    deletions = b._watch._keys["acme.s1"]
    order = []

    async def ack() -> None:
        order.append("acked")
        assert (await b.holder("acme", "s1")).owner == "a"  # not released yet

    await lease.release(after=ack())
    taken = await asyncio.wait_for(taker, 30)
    assert order == ["acked"] and taken.record.owner == "b" and deletions.count == 1
    assert "acme.s1" not in b._watch._keys  # the watch ended with its last waiter
    await taken.release()


async def test_a_lease_is_unlapsed_until_most_of_its_ttl_passes_without_a_renewal(leases):
    a = await leases("a")
    asked = time.monotonic()
    lease = await a.try_acquire("acme", "s1", "t1")
    assert lease is not None and lease.unlapsed()
    await wait_for(lambda: not lease.unlapsed(), timeout=30)  # a worker frozen too long
    assert time.monotonic() - asked >= 0.8  # ... past 80% of the TTL (1 s), not before
    await lease.renew()
    assert lease.unlapsed()
    await lease.release()


async def test_a_release_racing_a_renewal_still_frees_the_lease(leases):
    a = await leases("a")
    lease = await a.try_acquire("acme", "s1", "t1")
    before_renewal = lease.revision
    await lease.renew()
    lease.revision = before_renewal  # as if the renewal's ack had not come back yet
    await lease.release()
    assert await a.holder("acme", "s1") is None


async def test_a_lease_is_due_for_renewal_after_a_third_of_its_ttl(leases):
    a = await leases("a")
    lease = await a.try_acquire("acme", "s1", "t1")
    now = time.monotonic()
    assert not lease.due(now)
    assert lease.due(now + a.ttl_s / 3 + 0.01)
    await lease.release()
    assert not lease.due(now + a.ttl_s)


async def _free(leases: Leases) -> bool:
    return await leases.holder("acme", "s1") is None


async def test_leases_held_and_conflicts_are_counted(leases):
    from prometheus_client import REGISTRY

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    held, conflicts = sample("loopmesh_leases_held"), sample("loopmesh_lease_conflicts_total")
    a, b = await leases("a"), await leases("b")
    lease = await a.try_acquire("acme", "m1", "t1")
    assert lease is not None
    assert sample("loopmesh_leases_held") == held + 1
    assert await b.try_acquire("acme", "m1", "t2") is None
    assert sample("loopmesh_lease_conflicts_total") == conflicts + 1
    await lease.release()
    await lease.release()  # idempotent: counted once
    assert sample("loopmesh_leases_held") == held


async def test_a_late_release_leaves_a_second_take_of_the_same_turn_by_its_worker_alone(leases):
    """A turn delivered again to the worker still running it (its first delivery's
    in-progress acks lost, say): the second delivery takes the session's lease once
    the first delivery's lapsed. The first delivery's release, late, must not free
    the second's: same worker, same turn, but another take."""
    a, b = await leases("a"), await leases("b")
    first = await a.try_acquire("acme", "s1", "t1")
    assert first is not None
    await wait_for(lambda: _free(a), timeout=30, what="the first take to lapse")
    second = await a.try_acquire("acme", "s1", "t1")
    assert second is not None
    await first.release(continuable=True)
    assert await b.try_acquire("acme", "s1", "t2") is None  # still held by the second
    await second.renew()


async def test_a_lease_lapses_by_the_local_clock_a_margin_before_it_expires(leases):
    """What the loop worker fences its writes with: by its own clock, with no round trip;
    a lease that another worker can take by now counts as lapsed."""
    a, b = await leases("a"), await leases("b")
    lease = await a.try_acquire("acme", "s1", "t1")
    assert not lease.lapsed() and not lease.lapsed(a.ttl_s / 2)
    assert lease.lapsed(a.ttl_s)  # a margin of a whole TTL: lapsed from the start
    taken = await asyncio.wait_for(b.acquire("acme", "s1", "t2"), 30)  # its TTL passed
    assert lease.lapsed()  # whoever takes it over, this worker's clock already says so
    await taken.release()


async def test_one_of_a_set_of_keys_is_taken_while_any_is_free_and_a_dead_holders_lapses(leases):
    a, b = await leases("a"), await leases("b")
    keys = ["acme.slow.0", "acme.slow.1"]
    first, second = await a.try_acquire_one(keys, "t1"), await b.try_acquire_one(keys, "t2")
    assert first is not None and second is not None and first.key != second.key
    assert await b.try_acquire_one(keys, "t3") is None  # every key held
    await second.release()
    third = await b.try_acquire_one(keys, "t3")  # over the release's delete marker
    assert third is not None and third.key == second.key
    taken: list[object] = []  # a holds ``first`` and dies: it lapses with the TTL

    async def lapsed() -> bool:
        taken.append(await b.try_acquire_one(keys, "t4"))
        return taken[-1] is not None

    keeper = asyncio.create_task(third.keep())  # b keeps ``third``
    try:
        await wait_for(lapsed, timeout=30, every=0.1)
    finally:
        keeper.cancel()
    assert taken[-1].key == first.key and taken[-1].record.owner == "b"
