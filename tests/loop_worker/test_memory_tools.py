"""The memory tools on a real loop worker and nats-server, with an embeddings endpoint
(the fake server's hashed embeddings: texts that share words are near): saves go to the
turn's user, or to the agent when asked; a search finds them, nearest first; a namespace
that is full refuses a save, clearly; and one tenant's user is not another's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from loop_worker.engine.settings import LoopSettings, MemorySettings
from loopmesh.memory import MemoryStore
from loopmesh.testing.durable import SUBJECTS
from schemas.events import ToolErrorEvent, ToolResultEvent
from tests.loop_worker.durable import Mesh, Watch, mesh_on, send_turn, turn


def call(tool: str, **args: object) -> str:
    return f"call memory__{tool} " + json.dumps(args)


@pytest.fixture
async def mesh(nats_server) -> AsyncIterator[Mesh]:
    async with mesh_on(nats_server.url) as mesh:
        assert mesh.fake is not None
        memory = MemorySettings(
            mode="tools", embeddings_base_url=mesh.fake.base_url, embeddings_model="hashed",
            max_per_namespace=2,
        )  # fmt: skip
        await mesh.loop_worker(loop=LoopSettings(max_iterations=4, memory=memory))
        yield mesh


async def result(
    mesh: Mesh, session: str, text: str, **kw: object
) -> ToolResultEvent | ToolErrorEvent:
    async with Watch(mesh.nc, kw.get("tenant", "acme"), session) as watch:  # type: ignore[arg-type]
        await send_turn(mesh.nc, turn("t1", text, session=session, **kw))  # type: ignore[arg-type]
        await watch.wait("loop_end", "t1", timeout=30)
    kinds = ToolResultEvent | ToolErrorEvent
    [found] = [e for e in watch.events if isinstance(e, kinds) and e.server == "memory"]
    return found


async def test_saves_searches_the_cap_and_tenants(mesh: Mesh) -> None:
    store = MemoryStore(mesh.nc.jetstream(), SUBJECTS.memory_bucket)
    saved = await result(mesh, "s1", call("save", text="Ada keeps bees in the garden"), user="ada")
    assert isinstance(saved, ToolResultEvent) and "(user ada)" in saved.content
    own = await result(mesh, "s2", call("save", text="I answer briefly", about="agent"), user="ada")
    assert isinstance(own, ToolResultEvent) and "(agent default)" in own.content
    found = await result(mesh, "s3", call("search", query="bees garden"), user="ada")
    assert isinstance(found, ToolResultEvent)
    lines = found.content.splitlines()
    assert "Ada keeps bees in the garden" in lines[0]  # nearest first, then the agent's own
    assert len(lines) <= 2

    await result(mesh, "s4", call("save", text="Ada was born in London"), user="ada")
    full = await result(mesh, "s5", call("save", text="Ada likes tea"), user="ada")
    assert isinstance(full, ToolErrorEvent) and full.code == "memory_full"
    assert "max_per_namespace" in full.message
    assert len(await store.list("acme", "user", "ada")) == 2

    # another tenant's ada is another user: nothing of acme's ada is found
    other = await result(
        mesh, "s1", call("search", query="bees garden"), tenant="globex", user="ada"
    )
    assert isinstance(other, ToolResultEvent) and "bees" not in other.content
    bad = await result(mesh, "s6", call("forget", id="nope"), user="ada")
    assert isinstance(bad, ToolErrorEvent) and bad.code == "not_found"
