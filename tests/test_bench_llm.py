"""The fake LLM every system of ``python -m bench`` shares: ``echo k`` scripts k calls of
the offered echo tool, then the finish, and the request gaps it measures come back once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai

from bench.common import ECHO_TOOL, chat
from bench.llm_server import BenchLLM
from bench.llm_stream import STAMP, Pace, stamp

FINISH = {
    "type": "function",
    "function": {"name": "task_completion", "parameters": {"type": "object", "properties": {}}},
}


async def _session(client: openai.AsyncOpenAI, k: int, tools: list[Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"s1 echo {k}"}]
    for _ in range(k + 2):
        r = await client.chat.completions.create(model="fake-model", messages=messages, tools=tools)
        reply = r.choices[0].message.model_dump(exclude_none=True)
        messages.append(reply)
        calls = reply.get("tool_calls") or []
        if not calls or calls[0]["function"]["name"] != "echo":
            return messages
        messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "hi"})
    raise AssertionError("the session did not end")


async def test_echo_k_then_finish_with_the_offered_tool() -> None:
    async with BenchLLM() as llm:
        client = openai.AsyncOpenAI(base_url=llm.base_url, api_key="x", max_retries=0)
        messages = await _session(client, 3, [ECHO_TOOL, FINISH])
        await client.close()
    names = [m["tool_calls"][0]["function"]["name"] for m in messages if m.get("tool_calls")]
    assert names == ["echo", "echo", "echo", "task_completion"]


async def test_text_when_no_finish_tool_and_gaps_once() -> None:
    async with BenchLLM() as llm:
        client = openai.AsyncOpenAI(base_url=llm.base_url, api_key="x", max_retries=0)
        messages = await _session(client, 2, [ECHO_TOOL])
        streamed = await chat(client, [{"role": "user", "content": "s2 echo 1"}])
        await client.close()
        async with httpx.AsyncClient() as http:
            first = (await http.get(f"http://{llm.host}:{llm.port}/bench/gaps")).json()
            second = (await http.get(f"http://{llm.host}:{llm.port}/bench/gaps")).json()
    assert messages[-1] == {"role": "assistant", "content": "done"}
    assert streamed["tool_calls"][0]["function"]["name"] == "echo"
    assert len(first["gaps_ms"]) == 2  # three requests of session s1; s2 made one
    assert all(g >= 0 for g in first["gaps_ms"])
    assert second == {"gaps_ms": []}


async def test_stats_count_completions_and_bad_requests_get_400() -> None:
    async with BenchLLM() as llm:
        client = openai.AsyncOpenAI(base_url=llm.base_url, api_key="x", max_retries=0)
        await chat(client, [{"role": "user", "content": "s3 echo 1"}])
        await client.close()
        async with httpx.AsyncClient() as http:
            stats = (await http.get(f"http://{llm.host}:{llm.port}/bench/stats")).json()
            not_json = await http.post(f"{llm.base_url}/chat/completions", content=b"{nope")
            missing = await http.get(f"http://{llm.host}:{llm.port}/nowhere")
        reader, writer = await asyncio.open_connection(llm.host, llm.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        )
        chunked = await reader.read()  # the server answers and closes
        writer.close()
        await writer.wait_closed()
    assert stats["requests"] == 1
    assert stats["cpu_s"] > 0
    assert not_json.status_code == 400
    assert "body" in not_json.json()["error"]["message"]
    assert missing.status_code == 404
    assert chunked.startswith(b"HTTP/1.1 400 ")
    assert b"Content-Length" in chunked


async def _streamed(client: openai.AsyncOpenAI, messages: list[Any]) -> dict[str, Any]:
    stream = await client.chat.completions.create(
        model="fake-model", messages=messages, tools=[ECHO_TOOL, FINISH], stream=True
    )
    content, call = [], ""
    async for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and delta.content:
            content.append(delta.content)  # one token a chunk
            assert STAMP.fullmatch(delta.content)
        for fragment in (delta.tool_calls or ()) if delta is not None else ():
            call += fragment.function.name or "" if fragment.function else ""
    return {"role": "assistant", "content": "".join(content), "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": call, "arguments": "{}"}}
    ]}  # fmt: skip


async def test_a_paced_reply_streams_stamped_tokens_at_its_pace_then_the_call() -> None:
    pace = Pace(ttft_s=0.05, tokens_per_s=100, tokens=5)
    async with BenchLLM(pace=pace) as llm:
        client = openai.AsyncOpenAI(base_url=llm.base_url, api_key="x", max_retries=0)
        first = [{"role": "user", "content": "earlier\necho 3"}, {"role": "tool", "content": "x"}]
        first += [{"role": "user", "content": "bench-turn=t1\necho 1"}]
        started = time.time()
        reply = await _streamed(client, first)  # the same connection for both requests
        # the engine's own user messages have a name: the input is the one before it
        second = [*first, reply, {"role": "tool", "tool_call_id": "c", "content": "hi 0"}]
        second += [{"role": "user", "name": "loop", "content": "a reminder"}]
        finish = await _streamed(client, second)
        ended = time.time()
        await client.close()
        async with httpx.AsyncClient() as http:
            turns = (await http.get(f"http://{llm.host}:{llm.port}/bench/turns")).json()
            again = (await http.get(f"http://{llm.host}:{llm.port}/bench/turns")).json()
            stats = (await http.get(f"http://{llm.host}:{llm.port}/bench/stats")).json()
    assert reply["tool_calls"][0]["function"]["name"] == "echo"
    assert finish["tool_calls"][0]["function"]["name"] == "task_completion"
    stamps = [float(s) for s in STAMP.findall(reply["content"] + finish["content"])]
    assert len(stamps) == 10 and reply["content"] + finish["content"] == "".join(
        stamp(s) for s in stamps
    )
    assert started + 0.05 <= stamps[0] and stamps[-1] <= ended
    # token i is due i/100 s after the first (ms timers); one written late is not made up
    # for by a longer gap after it, so the gaps alone say nothing on a busy machine
    assert stamps[4] >= started + 0.05 + 0.04 - 0.002
    model_s, tokens, chars, replies = turns["turns"]["t1"]
    assert (tokens, replies, chars) == (10, 2, len(reply["content"] + finish["content"]))
    assert 2 * pace.nominal_s - 0.004 <= model_s <= ended - started
    assert again == {"turns": {}}
    assert stats["tokens"] == 10
