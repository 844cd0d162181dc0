"""The tool pre-filter in the durable loop worker: tool vectors in the shared KV bucket,
so the second worker embeds only its query; what was offered, in the events stream."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loop_worker.engine.settings import LoopSettings, PrefilterSettings
from loopmesh.testing.durable import connect_fast, provision_short
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas import Subjects, Turn
from schemas.events import LLMRequest, LoopEnd
from tests.loop_worker.durable import Mesh, Watch, send_turn

LOOP_TOOLS = 4


@pytest.fixture
async def mesh(nats_server) -> AsyncIterator[Mesh]:
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    async with FakeLLM(default=auto()) as llm:
        mesh = Mesh(nats_server.url, llm.base_url, nc)
        mesh.fake = llm  # type: ignore[attr-defined]
        try:
            yield mesh
        finally:
            await mesh.close()
            await nc.close()


def count_turn(turn_id: str, session: str, path: Path) -> Turn:
    args = {"path": str(path), "label": "a", "seconds": 0.0}
    return Turn(
        id=turn_id, tenant="acme", session=session, created_at=time.time(),
        input=f"call local__count {json.dumps(args)}",
    )  # fmt: skip


async def test_a_second_loop_worker_reads_the_tool_vectors_the_first_stored(
    mesh: Mesh, tmp_path: Path
) -> None:
    fake: FakeLLM = mesh.fake  # type: ignore[attr-defined]
    prefilter = PrefilterSettings(
        enabled=True, top_k=1, embeddings_base_url=fake.base_url, embeddings_model="fake-embed"
    )
    loop = LoopSettings(max_iterations=6, prefilter=prefilter)
    await mesh.tool_worker()
    first = await mesh.loop_worker("w1", loop=loop)
    async with Watch(mesh.nc, session="s1") as watch:
        await send_turn(mesh.nc, count_turn("t1", "s1", tmp_path / "a"))
        end = await watch.wait("loop_end", "t1")
        request = watch.of("llm_request", "t1")[0]
    assert isinstance(end, LoopEnd) and end.reason == "task_completion"
    assert isinstance(request, LLMRequest) and request.selection is not None
    assert request.selection.method == "embeddings"
    tools = request.selection.candidates
    assert tools >= 2  # the test tool pool's catalog
    assert len(request.offered) == 1 + LOOP_TOOLS
    assert [len(inputs) for inputs in fake.embeddings] == [1 + tools]
    kv = await mesh.nc.jetstream().key_value(Subjects().embeddings_bucket)
    assert len(await kv.keys()) == tools
    await first.stop()

    await mesh.loop_worker("w2", loop=loop)
    async with Watch(mesh.nc, session="s2") as watch:
        await send_turn(mesh.nc, count_turn("t2", "s2", tmp_path / "b"))
        end = await watch.wait("loop_end", "t2")
    assert isinstance(end, LoopEnd) and end.reason == "task_completion"
    assert [len(inputs) for inputs in fake.embeddings] == [1 + tools, 1]
