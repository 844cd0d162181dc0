import pytest

from loop_worker.errors import StaleSessionError
from loop_worker.store import KVSessionStore
from schemas import ChatMessage, SessionSnapshot
from tests.loop_worker.durable import SUBJECTS, connect_fast, provision_short


def snapshot(**kw) -> SessionSnapshot:
    return SessionSnapshot(tenant="acme", session="s1", **kw)


@pytest.fixture
async def store(nc):
    await provision_short(nc)
    store = KVSessionStore(nc.jetstream(), SUBJECTS)
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
    other = KVSessionStore(nc.jetstream(), SUBJECTS)
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
    other = KVSessionStore(nc.jetstream(), SUBJECTS)
    await other.start()
    await other.save(snapshot(iteration=5))
    with pytest.raises(StaleSessionError):
        await store.save(snapshot(iteration=1))


async def test_a_save_goes_through_a_nats_server_restart(nats_server, store):
    client = await connect_fast(nats_server.url)
    try:
        store = KVSessionStore(client.jetstream(), SUBJECTS)
        await store.start()
        await store.save(snapshot(iteration=1))
        await nats_server.restart()
        await store.save(snapshot(iteration=2))
        assert (await store.load("acme", "s1")).iteration == 2
    finally:
        await client.close()
