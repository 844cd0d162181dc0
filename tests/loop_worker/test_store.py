import asyncio

import pytest

from loop_worker.engine.errors import StaleSessionError
from loop_worker.store import KVSessionStore
from loopmesh.testing.durable import SUBJECTS, connect_fast, kv_read, provision_short, wait_for
from schemas import ChatMessage, SessionSnapshot, decode, encode
from tests.conftest import BOTH_SHARED, durable_nc

pytestmark = pytest.mark.parametrize("durable", BOTH_SHARED, indirect=True)  # R1 and R3


def snapshot(**kw) -> SessionSnapshot:
    return SessionSnapshot(tenant="acme", session="s1", **kw)


nc = durable_nc()


@pytest.fixture
async def store(nc, durable):
    await provision_short(nc, replicas=durable.replicas)
    store = KVSessionStore(nc, SUBJECTS)
    await store.start()
    return store


async def test_a_saved_snapshot_loads_back(store):
    assert await store.load("acme", "s1") is None
    saved = snapshot(messages=(ChatMessage(role="user", content="hi"),), iteration=1)
    await store.save(saved)
    await store.save(snapshot(iteration=2, status="running", turn_id="t1"))
    loaded = await store.load("acme", "s1")
    assert loaded == snapshot(iteration=2, status="running", turn_id="t1")


async def test_a_save_over_someone_elses_newer_snapshot_is_refused(nc, store):
    other = KVSessionStore(nc, SUBJECTS)
    await other.start()
    await store.save(snapshot(iteration=1))
    await store.load("acme", "s1")
    await other.load("acme", "s1")
    await other.save(snapshot(iteration=2))
    with pytest.raises(StaleSessionError) as err:
        await store.save(snapshot(iteration=3))
    assert err.value.key == "acme.s1"
    assert (await other.load("acme", "s1")).iteration == 2


async def test_a_first_save_never_overwrites_an_existing_session(nc, store):
    other = KVSessionStore(nc, SUBJECTS)
    await other.start()
    await other.save(snapshot(iteration=5))
    with pytest.raises(StaleSessionError):
        await store.save(snapshot(iteration=1))


async def test_a_save_goes_through_a_nats_server_restart(durable, store):
    """On the cluster, a restart of the node that leads the sessions bucket."""
    client = await connect_fast(durable.url)
    try:
        store = KVSessionStore(client, SUBJECTS)
        await store.start()
        await store.save(snapshot(iteration=1))
        await durable.restart(f"KV_{SUBJECTS.sessions_bucket}")
        await store.save(snapshot(iteration=2))
        assert (await store.load("acme", "s1")).iteration == 2
    finally:
        await client.close()


@pytest.fixture
async def pipelined(nc, durable):
    await provision_short(nc, replicas=durable.replicas)
    store = KVSessionStore(nc, SUBJECTS, pipelined=True, commit_after_s=0.05)
    await store.start()
    return store


async def stored(nc) -> tuple[int, SessionSnapshot | None]:
    """(the sessions bucket's last sequence, what acme.s1 holds), as its leader has them."""
    info = await nc.jetstream().stream_info(f"KV_{SUBJECTS.sessions_bucket}")
    value = await kv_read(nc, SUBJECTS.sessions_bucket, "acme.s1")
    return info.state.last_seq, None if value is None else decode(value, SessionSnapshot)


async def test_a_pipelined_save_is_kept_until_commit_and_the_next_save_replaces_it(nc, pipelined):
    before, _ = await stored(nc)  # 0, but on a shared cluster the bucket was emptied
    assert await pipelined.load("acme", "s1") is None
    await pipelined.save(snapshot(iteration=1))
    await pipelined.save(snapshot(iteration=2))
    assert await stored(nc) == (before, None)  # nothing on the wire yet
    await pipelined.commit("acme", "s1")  # the dispatcher does this before a tool call
    await pipelined.flush("acme", "s1")
    assert await stored(nc) == (before + 1, snapshot(iteration=2))  # one write, the latest
    await pipelined.save(snapshot(iteration=3))
    await pipelined.flush("acme", "s1")
    assert (await stored(nc))[1] == snapshot(iteration=3)


async def test_a_kept_checkpoint_is_published_by_itself_soon_after(nc, pipelined):
    await pipelined.load("acme", "s1")
    committer = asyncio.create_task(pipelined.run())
    try:
        await pipelined.save(snapshot(iteration=1))
        await wait_for(lambda: _has(nc, snapshot(iteration=1)), what="the checkpoint")
    finally:
        committer.cancel()


async def _has(nc, expected: SessionSnapshot) -> bool:
    return (await stored(nc))[1] == expected


async def test_after_a_lost_race_every_pipelined_save_raises(nc, pipelined):
    other = KVSessionStore(nc, SUBJECTS)
    await other.start()
    await pipelined.load("acme", "s1")
    await other.save(snapshot(iteration=7))  # someone else took the session over
    await pipelined.save(snapshot(iteration=1))
    with pytest.raises(StaleSessionError):
        await pipelined.flush("acme", "s1")
    with pytest.raises(StaleSessionError):
        await pipelined.save(snapshot(iteration=2))
    assert (await stored(nc))[1] == snapshot(iteration=7)


async def test_a_preloaded_snapshot_is_what_the_next_load_returns(nc, store):
    await store.save(snapshot(iteration=1))
    await store.preload("acme", "s1")
    other = KVSessionStore(nc, SUBJECTS)
    await other.start()
    await other.load("acme", "s1")
    await other.save(snapshot(iteration=2))
    assert (await store.load("acme", "s1")).iteration == 1  # read by the preload
    with pytest.raises(StaleSessionError):  # the preload's revision was remembered
        await store.save(snapshot(iteration=3))
    assert (await store.load("acme", "s1")).iteration == 2  # a preload is used once


async def test_a_preload_that_failed_fails_the_next_load(nc):
    store = KVSessionStore(nc, SUBJECTS)  # not started: every read fails
    await store.preload("acme", "s1")
    with pytest.raises(RuntimeError, match="not started"):
        await store.load("acme", "s1")


async def test_a_warm_preload_uses_what_was_kept_when_the_sessions_last_turn_ended(nc, pipelined):
    """Kept when a turn ends with its checkpoint stored; used, with no read, only when
    the caller says nobody else held the session; used once. A snapshot written behind
    the store's back shows which way each preload went."""
    other = KVSessionStore(nc, SUBJECTS)
    await other.start()
    assert await pipelined.load("acme", "s1") is None
    await pipelined.save(snapshot(iteration=1))
    await pipelined.flush("acme", "s1")
    pipelined.forget("acme", "s1")  # the turn ended
    await other.load("acme", "s1")
    await other.save(snapshot(iteration=2))  # behind its back

    await pipelined.preload("acme", "s1", warm=True)
    assert (await pipelined.load("acme", "s1")).iteration == 1  # kept, not read
    await pipelined.save(snapshot(iteration=3))
    with pytest.raises(StaleSessionError):  # stale after all: the revision check says so
        await pipelined.flush("acme", "s1")
    pipelined.forget("acme", "s1")  # a lost race: nothing kept
    await pipelined.preload("acme", "s1", warm=True)
    assert (await pipelined.load("acme", "s1")).iteration == 2  # read

    await pipelined.save(snapshot(iteration=4))
    await pipelined.flush("acme", "s1")
    pipelined.forget("acme", "s1")
    await other.load("acme", "s1")
    await other.save(snapshot(iteration=5))
    await pipelined.preload("acme", "s1")  # not warm: read
    assert (await pipelined.load("acme", "s1")).iteration == 5
    pipelined.forget("acme", "s1")
    await pipelined.preload("acme", "s1", warm=True)  # nothing saved, but the load is kept
    assert (await pipelined.load("acme", "s1")).iteration == 5


async def test_ended_sessions_are_kept_within_a_byte_budget(nc, pipelined, monkeypatch):
    import loop_worker.store as store_module

    size = len(encode(snapshot(summary="x" * 1000, iteration=1)))
    monkeypatch.setattr(store_module, "WARM_BYTES", size * 2)
    for name in ("a", "b", "c"):
        other = SessionSnapshot(tenant="acme", session=name, summary="x" * 1000, iteration=1)
        await pipelined.load("acme", name)
        await pipelined.save(other)
        await pipelined.flush("acme", name)
        pipelined.forget("acme", name)
    writer = KVSessionStore(nc, SUBJECTS)
    await writer.start()
    for name in ("a", "b", "c"):
        await writer.load("acme", name)
        await writer.save(SessionSnapshot(tenant="acme", session=name, iteration=9))
    seen = {}
    for name in ("a", "b", "c"):
        await pipelined.preload("acme", name, warm=True)
        seen[name] = (await pipelined.load("acme", name)).iteration
    assert seen == {"a": 9, "b": 1, "c": 1}  # the oldest made room
