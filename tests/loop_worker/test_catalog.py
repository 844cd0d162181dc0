"""The loop worker's live tool catalog: a KV watch of the catalog bucket on a real
nats-server, alone and inside running loop workers."""

from __future__ import annotations

import asyncio
import json

import pytest

from loop_worker.catalog import Catalog
from loop_worker.errors import CatalogNotLoadedError
from loopmesh.provision import provision
from loopmesh.testing.durable import SUBJECTS, connect_fast, wait_for
from schemas import catalog_key, definitions, encode
from schemas.events import Error, LoopEnd
from tests.loop_worker.durable import Watch, register_tool, send_turn, spec, turn

BUCKET = SUBJECTS.catalog_bucket


async def provision_catalog(nc, ttl_s: float = 30.0) -> None:
    await provision(nc.jetstream(), definitions(SUBJECTS, catalog_ttl_s=ttl_s))


def has(key: str):
    return lambda c: c.get(key) is not None


def lacks(key: str):
    return lambda c: c.get(key) is None


async def test_a_tool_put_after_the_first_load_is_offered_at_once(nc):
    await provision_catalog(nc)
    await register_tool(nc, spec("echo"))
    async with Catalog(nc, BUCKET) as catalog:
        await catalog.loaded()
        assert [s.name for s in catalog.specs()] == ["echo"]
        await register_tool(nc, spec("other", server="files"))
        assert await catalog.wait_for(has("files.other"), 5)
        assert sorted(s.name for s in catalog.specs()) == ["echo", "other"]
        assert catalog.watches == 1  # a watch, not re-reads


async def test_the_first_load_holds_every_tool_though_the_client_is_slow_to_read(nc):
    """nats-py marks a watch's initial values as in when the consumer has nothing
    pending and its callback has seen nothing: also true when the server has pushed
    every value to a client that has not read them yet. The first load waits for the
    last value there was instead."""
    await provision_catalog(nc)
    kv = await nc.jetstream().key_value(BUCKET)
    names = [f"t{i}" for i in range(300)]
    for name in names:
        await kv.put(catalog_key("local", name), encode(spec(name)))
    for _ in range(5):
        async with Catalog(nc, BUCKET) as catalog:
            await catalog.loaded()
            assert len(catalog.specs()) == len(names)


async def test_a_deleted_or_purged_tool_is_withdrawn(nc):
    await provision_catalog(nc)
    for name in ("a", "b", "c"):
        await register_tool(nc, spec(name))
    kv = await nc.jetstream().key_value(BUCKET)
    async with Catalog(nc, BUCKET) as catalog:
        await catalog.loaded()
        await kv.delete("local.a")
        assert await catalog.wait_for(lacks("local.a"), 5)
        await kv.purge("local.b")
        assert await catalog.wait_for(lacks("local.b"), 5)
        assert [s.name for s in catalog.specs()] == ["c"]


async def test_an_entry_whose_ttl_lapses_is_withdrawn_though_the_watch_says_nothing(nc):
    """nats-server 2.15 sends a watch nothing when a key lapses through the bucket's
    max_age: the catalog drops it on its own clock, and keeps entries put again."""
    # "live" is put again every 0.25 s: a 3 s TTL leaves a loaded machine's slow puts
    # and watch updates room to keep it in the catalog
    await provision_catalog(nc, ttl_s=3.0)
    await register_tool(nc, spec("old"))  # put before the watch: aged by its timestamp
    kv = await nc.jetstream().key_value(BUCKET)
    raw = await kv.watchall()  # what the server tells a plain watch
    seen: list[tuple[str, str | None]] = []

    async def record() -> None:
        async for entry in raw:
            if entry is not None:
                seen.append((entry.key, entry.operation))

    async def keep_alive() -> None:
        while True:
            await register_tool(nc, spec("live"))
            await asyncio.sleep(0.25)

    async with asyncio.TaskGroup() as tg:
        recorder = tg.create_task(record())
        refresher = tg.create_task(keep_alive())
        async with Catalog(nc, BUCKET) as catalog:
            await catalog.loaded()
            await register_tool(nc, spec("new"))  # put after: a full TTL from now
            assert await catalog.wait_for(has("local.new"), 10)
            assert await catalog.wait_for(lacks("local.old"), 10)
            assert await catalog.wait_for(lacks("local.new"), 10)
            assert catalog.get("local.live") is not None
            assert [s.name for s in catalog.specs()] == ["live"]
        refresher.cancel()
        await raw.stop()
    assert recorder.done()
    # the server dropped both keys, and no watch update said so
    assert not [op for key, op in seen if key in ("local.old", "local.new") and op is not None]


async def test_a_turn_waits_for_a_catalog_that_loads_late(nc):
    """Nothing to load yet (no bucket): ``loaded`` waits, and returns once it is in."""
    async with Catalog(nc, BUCKET) as catalog:
        waiting = asyncio.ensure_future(catalog.loaded(timeout=20))
        await provision_catalog(nc)
        await register_tool(nc, spec("echo"))
        await waiting
        assert catalog.is_loaded
        assert await catalog.wait_for(has("local.echo"), 5)


async def test_a_catalog_that_cannot_load_says_so_instead_of_offering_nothing(nc):
    async with Catalog(nc, BUCKET, load_timeout_s=0.3) as catalog:
        with pytest.raises(CatalogNotLoadedError) as err:
            await catalog.loaded()
    assert err.value.bucket == BUCKET and err.value.timeout_s == 0.3
    assert BUCKET in str(err.value) and "did not load" in str(err.value)
    with pytest.raises(CatalogNotLoadedError):  # closed: nothing will ever load
        await catalog.loaded()


async def test_changes_of_the_tool_set_are_reported_and_refreshes_are_not(nc):
    await provision_catalog(nc)
    await register_tool(nc, spec("echo"))
    calls: list[list[str]] = []
    kv = await nc.jetstream().key_value(BUCKET)
    async with Catalog(
        nc, BUCKET, on_change=lambda specs: calls.append([s.name for s in specs])
    ) as catalog:
        await catalog.loaded()
        await kv.put("local.echo", encode(spec("echo", description="refreshed")))
        await catalog.wait_for(lambda c: c.specs()[0].description == "refreshed", 5)
        await register_tool(nc, spec("more"))
        await catalog.wait_for(has("local.more"), 5)
        await kv.delete("local.more")
        await catalog.wait_for(lacks("local.more"), 5)
    assert calls == [["echo"], ["echo", "more"], ["echo"]]


async def test_the_watch_survives_a_nats_server_restart(nats_server):
    nc = await connect_fast(nats_server.url)
    try:
        await provision_catalog(nc)
        await register_tool(nc, spec("before"))
        async with Catalog(nc, BUCKET) as catalog:
            await catalog.loaded()
            await nats_server.restart()
            await wait_for(lambda: nc.is_connected, timeout=20, what="a reconnect")
            await register_tool(nc, spec("after"))
            assert await catalog.wait_for(has("local.after"), 30)
            assert catalog.get("local.before") is not None
            assert catalog.watches >= 2  # watched again after the reconnect
    finally:
        await nc.close()


# -- inside running loop workers ----------------------------------------------------------


def offered(request: dict) -> list[str]:
    return sorted(t["function"]["name"] for t in request.get("tools") or [])


async def test_a_tool_worker_started_after_the_loop_worker_is_offered_on_the_first_iteration(
    mesh, tmp_path
):
    await mesh.loop_worker()
    async with Watch(mesh.nc) as watch:
        await mesh.tool_worker()  # returns the moment the tool worker says it is ready
        args = json.dumps({"path": str(tmp_path / "n"), "label": "a"})
        await send_turn(mesh.nc, turn("t1", f"call local__count {args}"))
        end = await watch.wait("loop_end", "t1")
    assert isinstance(end, LoopEnd) and end.reason == "task_completion"
    first = mesh.fake.requests[0]
    assert {"local__count", "local__echo", "local__guarded"} <= set(offered(first))
    assert (tmp_path / "n").read_text() == "a\n"  # and the call reached it


async def test_a_deleted_tool_is_not_offered_to_the_next_turn(mesh):
    await register_tool(mesh.nc, spec("ephemeral"))
    await mesh.loop_worker()
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", "hello"))
        await watch.wait("loop_end", "t1")
        assert "local__ephemeral" in offered(mesh.fake.requests[-1])
        kv = await mesh.nc.jetstream().key_value(BUCKET)
        await kv.delete(catalog_key("local", "ephemeral"))
        worker = mesh.running[0].service
        assert await worker.tools.catalog.wait_for(lacks("local.ephemeral"), 5)
        seen = len(mesh.fake.requests)
        await send_turn(mesh.nc, turn("t2", "hello again"))
        await watch.wait("loop_end", "t2")
    assert "local__ephemeral" not in offered(mesh.fake.requests[seen])


async def test_a_turn_on_a_catalog_that_cannot_load_ends_with_a_clear_error(mesh):
    await mesh.nc.jetstream().delete_key_value(BUCKET)
    await mesh.loop_worker(catalog_load_timeout_s=0.5)
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", "hello"))
        end = await watch.wait("loop_end", "t1")
    assert isinstance(end, LoopEnd) and end.reason == "error"
    errors = [e for e in watch.of("error", "t1") if isinstance(e, Error)]
    assert errors and "tool catalog" in errors[0].message and BUCKET in errors[0].message
    assert mesh.fake.requests == []  # the model was never asked without its tools
