"""The tool pre-filter in the durable loop worker: tool vectors in the shared KV bucket,
so the second worker embeds only its query; what was offered, in the events stream."""

from __future__ import annotations

from pathlib import Path

from loop_worker.engine.settings import LoopSettings, PrefilterSettings
from schemas import Subjects
from schemas.events import LLMRequest, LoopEnd
from tests.loop_worker.durable import Mesh, Watch, count_task, send_turn, turn

LOOP_TOOLS = 4


async def test_a_second_loop_worker_reads_the_tool_vectors_the_first_stored(
    mesh: Mesh, tmp_path: Path
) -> None:
    fake = mesh.fake
    prefilter = PrefilterSettings(
        enabled=True, top_k=1, embeddings_base_url=fake.base_url, embeddings_model="fake-embed"
    )
    loop = LoopSettings(max_iterations=6, prefilter=prefilter)
    await mesh.tool_worker()
    first = await mesh.loop_worker("w1", loop=loop)
    async with Watch(mesh.nc, session="s1") as watch:
        await send_turn(mesh.nc, turn("t1", count_task(tmp_path / "a"), session="s1"))
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
        await send_turn(mesh.nc, turn("t2", count_task(tmp_path / "b"), session="s2"))
        end = await watch.wait("loop_end", "t2")
    assert isinstance(end, LoopEnd) and end.reason == "task_completion"
    assert [len(inputs) for inputs in fake.embeddings] == [1 + tools, 1]
