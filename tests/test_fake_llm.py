"""The fake LLM server speaks OpenAI's wire format: checked with the real ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from loopmesh.testing.fake_llm import FakeLLM, auto, cut, empty, error, hang, text, tool_calls

USER = [{"role": "user", "content": "hello"}]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def client(fake_llm: FakeLLM) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=fake_llm.base_url, api_key="test", max_retries=0, timeout=5
    ) as c:
        yield c


async def stream(
    client: openai.AsyncOpenAI, messages: list[dict[str, Any]] = USER, **kw: Any
) -> list[ChatCompletionChunk]:
    chunks = []
    response = await client.chat.completions.create(
        model=kw.pop("model", "m-1"),
        messages=messages,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    async for chunk in response:
        chunks.append(chunk)
    return chunks


def tool_deltas(chunks: list[ChatCompletionChunk]) -> list[Any]:
    return [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]


async def test_text_streams_in_fragments_with_role_first_and_usage_last(fake_llm, client):
    fake_llm.script(text("The quick brown fox jumps", chunk_size=5))
    chunks = await stream(client, model="echo-me")

    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks[1:] if c.choices]
    assert [p for p in pieces if p] == ["The q", "uick ", "brown", " fox ", "jumps"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens > 0
    assert {c.model for c in chunks} == {"echo-me"}
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert fake_llm.requests[0]["messages"] == USER


async def test_tool_call_arguments_arrive_as_fragments_per_index(fake_llm, client):
    fake_llm.script(tool_calls(("search", {"query": "nats jetstream"}), ("add", {"a": 1, "b": 2})))
    chunks = await stream(client, tools=[{"type": "function", "function": {"name": "search"}}])
    deltas = tool_deltas(chunks)

    firsts = [d for d in deltas if d.id]
    assert [(d.index, d.type, d.function.name) for d in firsts] == [
        (0, "function", "search"),
        (1, "function", "add"),
    ]
    later = [d for d in deltas if not d.id]
    assert all(d.function.name is None and d.type is None for d in later)
    for index, expected in ((0, {"query": "nats jetstream"}), (1, {"a": 1, "b": 2})):
        parts = [d.function.arguments for d in deltas if d.index == index and d.function.arguments]
        assert len(parts) > 1
        assert json.loads("".join(parts)) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert fake_llm.requests[0]["tools"][0]["function"]["name"] == "search"


async def test_omit_index_and_omit_id_leave_those_fields_out(fake_llm, client):
    fake_llm.script(
        tool_calls(("a", {"x": 1}), ("b", {"y": 2}), omit_index=True),
        tool_calls(("a", {"x": 1}), omit_id=True),
    )
    no_index = tool_deltas(await stream(client))
    no_id = tool_deltas(await stream(client))

    assert no_index and all(d.index is None for d in no_index)
    assert [d.function.name for d in no_index if d.id] == ["a", "b"]
    assert no_id and all(d.id is None for d in no_id)
    assert {d.index for d in no_id} == {0}


async def test_empty_reply_has_no_content_and_no_tool_calls(fake_llm, client):
    fake_llm.script(empty())
    chunks = await stream(client)
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert not tool_deltas(chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


async def test_scripted_errors_become_the_matching_openai_exceptions(fake_llm, client):
    fake_llm.script(error(429, "slow down", retry_after=2), error(500), error(400, "bad"))
    with pytest.raises(openai.RateLimitError) as limited:
        await stream(client)
    assert limited.value.response.headers["retry-after"] == "2"
    assert "slow down" in str(limited.value)
    with pytest.raises(openai.InternalServerError):
        await stream(client)
    with pytest.raises(openai.BadRequestError):
        await stream(client)


async def test_an_exhausted_script_answers_500_so_the_test_notices(fake_llm, client):
    with pytest.raises(openai.InternalServerError, match="script exhausted"):
        await stream(client)


async def test_hang_times_out_the_client_and_the_server_sees_it_leave(fake_llm, client):
    fake_llm.script(hang(30))
    with pytest.raises(openai.APITimeoutError):
        await stream(client, timeout=0.2)
    await fake_llm.wait_disconnects(1, timeout=10)


async def test_cut_drops_the_connection_before_the_stream_finishes(fake_llm, client):
    fake_llm.script(cut("abcdefghijklmnopqrstuvwxyz", after_chunks=2))
    seen: list[str] = []
    with pytest.raises(openai.APIConnectionError):
        response = await client.chat.completions.create(model="m", messages=USER, stream=True)
        async for chunk in response:
            seen.append(chunk.choices[0].delta.content or "")
            assert chunk.choices[0].finish_reason is None
    assert "".join(seen) == "abcdefghijklmnop"


async def test_without_stream_the_reply_is_one_completion(fake_llm, client):
    fake_llm.script(text("whole"), tool_calls(("f", {"k": "v"})))
    first = await client.chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
    second = await client.chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
    assert first.choices[0].message.content == "whole"
    call = second.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("f", {"k": "v"})
    assert second.choices[0].finish_reason == "tool_calls"


async def test_models_are_listed(fake_llm, client):
    assert [m.id async for m in client.models.list()] == ["fake-model"]


async def test_auto_calls_the_tool_the_user_asks_for_then_completes(fake_llm, client):
    fake_llm.default = auto()
    tools = [
        {"type": "function", "function": {"name": "local__echo"}},
        {"type": "function", "function": {"name": "agent__task_completion"}},
    ]
    asked = [{"role": "user", "content": 'please call echo {"text": "hi"}'}]
    first = tool_deltas(await stream(client, asked, tools=tools))
    args = "".join(d.function.arguments or "" for d in first)
    assert (first[0].function.name, json.loads(args)) == ("local__echo", {"text": "hi"})

    answered = [
        *asked,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "local__echo", "arguments": args},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "hi"},
    ]
    second = tool_deltas(await stream(client, answered, tools=tools))
    result = json.loads("".join(d.function.arguments or "" for d in second))
    assert second[0].function.name == "agent__task_completion"
    assert result == {"result": "done: hi"}

    plain = await stream(client, USER, tools=tools)
    assert tool_deltas(plain)[0].function.name == "agent__task_completion"


async def test_auto_without_tools_answers_with_text(fake_llm, client):
    fake_llm.default = auto()
    chunks = await stream(client)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok: hello"


async def test_wait_requests_gives_up_at_its_deadline(fake_llm):
    with pytest.raises(TimeoutError):
        await fake_llm.wait_requests(1, timeout=0.05)


async def test_the_command_line_server_plays_a_script_then_answers_in_auto_mode(tmp_path: Path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"kind": "text", "content": "scripted"}]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loopmesh.testing.fake_llm",
        "--port",
        "0",
        "--script",
        str(script),
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
        base_url = line.split()[-1]
        async with openai.AsyncOpenAI(base_url=base_url, api_key="t", max_retries=0) as c:
            first = await stream(c)
            second = await stream(c)
        assert "".join(x.choices[0].delta.content or "" for x in first if x.choices) == "scripted"
        assert "".join(x.choices[0].delta.content or "" for x in second if x.choices) == "ok: hello"
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
