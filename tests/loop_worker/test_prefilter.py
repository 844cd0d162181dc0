"""The tool pre-filter: a 60-tool catalog narrowed to the top K for each request, by
embeddings (the fake server's, or a real model's) or by BM25, with the tool vectors
cached and shared."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from loop_worker.engine.inmemory import LocalTools
from loop_worker.engine.prefilter import (
    InMemoryEmbeddingCache,
    OpenAIEmbeddings,
    Prefilter,
    cache_key,
    tool_text,
)
from loop_worker.engine.settings import PrefilterSettings
from loopmesh.testing.fake_llm import FakeLLM, tool_calls
from schemas import ToolSpec
from schemas.codec import encode
from schemas.events import LLMRequest, decode_event
from tests.loop_worker.catalog60 import catalog
from tests.loop_worker.scripted import Rig

LOOP_TOOLS = {"task_completion", "ask_question", "converse", "update_plan"}


def sixty_tools() -> LocalTools:
    tools = LocalTools()
    for spec in catalog():

        def run(_name: str = spec.name, **arguments: Any) -> str:
            return f"{_name} ran with {arguments}"

        tools.add(
            run,
            server=spec.server,
            name=spec.name,
            description=spec.description,
            input_schema=spec.input_schema,
        )
    return tools


def offered_names(request: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in request.get("tools", [])]


def embeddings_settings(fake: FakeLLM, **kw: Any) -> PrefilterSettings:
    return PrefilterSettings(
        enabled=True, embeddings_base_url=fake.base_url, embeddings_model="fake-embed", **kw
    )


async def test_without_an_endpoint_bm25_offers_the_top_k_and_the_loop_tools(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(
        tool_calls(("clock__current_time", {"timezone": "Asia/Tokyo"})),
        tool_calls(("task_completion", {"result": "It is 10:00 in Tokyo."})),
    )
    prefilter = PrefilterSettings(enabled=True, top_k=8)
    async with Rig.openai(fake_llm, tools=sixty_tools(), prefilter=prefilter) as rig:
        end = await rig.run("What time is it in Tokyo?")
    assert end.reason == "task_completion"
    assert len(fake_llm.requests) == 2
    for request in fake_llm.requests:
        names = offered_names(request)
        assert len(names) == 8 + len(LOOP_TOOLS)
        assert {n for n in names} >= LOOP_TOOLS
        assert "clock__current_time" in names
        assert "files__delete_file" not in names
    assert not fake_llm.embeddings  # no endpoint: nothing was embedded
    events = rig.of(LLMRequest)
    assert len(events) == 2
    first = events[0]
    assert first.tools == 12
    assert set(first.offered) == set(offered_names(fake_llm.requests[0]))
    assert first.selection is not None
    assert first.selection.method == "bm25"
    assert (first.selection.top_k, first.selection.candidates) == (8, 60)
    assert len(first.selection.scores) == 8
    best = max(first.selection.scores, key=first.selection.scores.__getitem__)
    assert best == "clock.current_time"
    assert first.selection.note == ""
    # the event survives the wire, and an old reader (no such fields) still reads it
    again = decode_event(encode(first))
    assert again == first


async def test_embeddings_rank_the_catalog_and_tool_vectors_are_computed_once(
    fake_llm: FakeLLM,
) -> None:
    fake_llm.script(
        tool_calls(("task_completion", {"result": "sent"})),
        tool_calls(("task_completion", {"result": "sent again"})),
    )
    settings = embeddings_settings(fake_llm, top_k=5)
    async with Rig.openai(fake_llm, tools=sixty_tools(), prefilter=settings) as rig:
        assert rig.engine.prefilter is not None
        try:
            await rig.run("send an email to bob about the invoice", id="t1")
            await rig.run("send an email to carol about the invoice", id="t2")
        finally:
            await rig.engine.prefilter.aclose()
    # the first turn embedded the query and the 60 tools; the second only its query
    assert [len(inputs) for inputs in fake_llm.embeddings] == [61, 1]
    assert fake_llm.embeddings[1] == ["send an email to carol about the invoice"]
    event = rig.of(LLMRequest)[0]
    assert event.selection is not None and event.selection.method == "embeddings"
    assert len(event.selection.scores) == 5
    assert "mail__send_email" in event.offered
    assert len(offered_names(fake_llm.requests[0])) == 5 + len(LOOP_TOOLS)


async def test_a_failing_endpoint_falls_back_to_bm25_and_says_why() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = PrefilterSettings(
        enabled=True, embeddings_base_url=f"http://127.0.0.1:{port}/v1", timeout_s=5
    )
    prefilter = Prefilter.from_settings(settings)
    try:
        selection = await prefilter.select("what time is it in Tokyo", catalog())
    finally:
        await prefilter.aclose()
    assert selection.method == "bm25"
    assert "embeddings failed" in selection.note
    assert "clock.current_time" in selection.scores


async def test_a_small_catalog_is_offered_whole() -> None:
    tools = catalog()[:5]
    selection = await Prefilter(PrefilterSettings(enabled=True, top_k=8)).select("x", tools)
    assert selection.method == "all"
    assert selection.tools == tuple(tools)


async def test_loop_tools_are_never_ranked_out() -> None:
    own = [ToolSpec(server="loop", name=n) for n in sorted(LOOP_TOOLS)]
    selection = await Prefilter(PrefilterSettings(enabled=True, top_k=2)).select(
        "what time is it", [*catalog(), *own]
    )
    assert {t.name for t in selection.tools if t.server == "loop"} == LOOP_TOOLS
    assert len(selection.tools) == 2 + len(LOOP_TOOLS)


async def test_select_tools_narrows_any_list_for_one_step(fake_llm: FakeLLM) -> None:
    prefilter = Prefilter(
        embeddings_settings(fake_llm, top_k=3),
        embedder=OpenAIEmbeddings(embeddings_settings(fake_llm)),
        cache=InMemoryEmbeddingCache(),
    )
    try:
        tools = await prefilter.select_tools("convert 10 miles to kilometres", catalog())
    finally:
        await prefilter.aclose()
    assert len(tools) == 3
    assert "unit_convert" in {t.name for t in tools}


def test_cache_keys_change_with_the_model_and_the_tool_text() -> None:
    spec = catalog()[0]
    changed = ToolSpec(server=spec.server, name=spec.name, description="Something else.")
    assert cache_key("m1", tool_text(spec)) == cache_key("m1", tool_text(spec))
    assert cache_key("m1", tool_text(spec)) != cache_key("m2", tool_text(spec))
    assert cache_key("m1", tool_text(spec)) != cache_key("m1", tool_text(changed))
    assert "timezone" in tool_text(spec)


@pytest.mark.parametrize("top_k", [0, 129])
def test_top_k_is_bounded(top_k: int) -> None:
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"top_k": top_k}, PrefilterSettings)


async def test_in_orchestrator_mode_each_step_is_offered_the_prefilters_pick() -> None:
    import json

    from loopmesh.testing.fake_llm import text

    steps = {"steps": [{"id": "1", "description": "find the current time in Tokyo"}]}
    async with FakeLLM() as fake:
        fake.script_for("planner", text(f"```json\n{json.dumps(steps)}\n```"), text("10:00"))
        fake.script_for("executor", text("It is 10:00 in Tokyo."))
        orchestrator = {"mode": "orchestrator", "planner_model": "planner"}
        async with Rig.openai(
            fake,
            tools=sixty_tools(),
            executor_model="executor",
            prefilter=PrefilterSettings(enabled=True, top_k=2),
            **orchestrator,
        ) as rig:
            assert rig.engine.prefilter is not None
            assert rig.engine.select_tools is rig.engine.prefilter
            end = await rig.run("What time is it in Tokyo?")
    assert end.content == "10:00"
    offered = offered_names(fake.requests_for("executor")[0])
    assert "clock__current_time" in offered
    assert len([n for n in offered if n not in LOOP_TOOLS]) == 2
    # the step's llm_request says what was offered and why, as the single loop's does
    planner, executor, synthesis = rig.of(LLMRequest)
    assert executor.model == "executor" and executor.tools == 2
    assert set(executor.offered) == set(offered)
    assert executor.selection is not None
    assert executor.selection.method == "bm25"
    assert (executor.selection.top_k, executor.selection.candidates) == (2, 60)
    assert set(executor.selection.scores) == {n.replace("__", ".") for n in offered}
    best = max(executor.selection.scores, key=executor.selection.scores.__getitem__)
    assert best == "clock.current_time"
    # the planner and the synthesis are offered no tools: nothing was selected for them
    assert planner.selection is None and synthesis.selection is None
    assert decode_event(encode(executor)) == executor
