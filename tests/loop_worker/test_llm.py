"""OpenAILLM through the real ``openai`` client against the fake server."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest

from loop_worker.engine.errors import LLMError
from loop_worker.engine.llm import OpenAILLM, to_openai_messages
from loop_worker.engine.settings import LLMSettings
from loopmesh.testing.fake_llm import FakeLLM, cut, empty, error, hang, text, tool_calls
from schemas import ChatMessage, ToolCall
from schemas.events import Usage

HI = [ChatMessage(role="user", content="hi")]
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


class Recorder:
    """Collects what the LLM reports: deltas, retries and (instead of waiting) sleeps."""

    def __init__(self) -> None:
        self.deltas: list[str] = []
        self.retries: list[tuple[int, str, float, str]] = []
        self.sleeps: list[float] = []

    async def on_delta(self, text: str) -> None:
        self.deltas.append(text)

    async def on_retry(self, attempt: int, reason: str, delay: float, model: str) -> None:
        self.retries.append((attempt, reason, delay, model))

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture(params=["lean", "httpx"])
async def make_llm(
    request: pytest.FixtureRequest, fake_llm: FakeLLM, rec: Recorder
) -> AsyncIterator[Callable[..., OpenAILLM]]:
    """Each test runs on both HTTP clients under the openai client (``[llm] http``)."""
    made: list[OpenAILLM] = []

    def make(rng: random.Random | None = None, **settings: Any) -> OpenAILLM:
        defaults: dict[str, Any] = {
            "base_url": fake_llm.base_url,
            "api_key": "test",
            "model": "primary",
            "timeout_s": 5.0,
            "backoff_initial_s": 0.01,
            "backoff_max_s": 8.0,
            "http": request.param,
        }
        llm = OpenAILLM(LLMSettings(**{**defaults, **settings}), sleep=rec.sleep, rng=rng)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        await llm.aclose()


async def test_text_streams_to_on_delta_in_order_and_is_returned_whole(fake_llm, make_llm, rec):
    fake_llm.script(text("streaming makes agents feel alive", chunk_size=4))
    result = await make_llm().complete(HI, on_delta=rec.on_delta)

    assert rec.deltas[:3] == ["stre", "amin", "g ma"]
    assert "".join(rec.deltas) == result.content == "streaming makes agents feel alive"
    assert (result.finish_reason, result.model, result.tool_calls) == ("stop", "primary", ())
    assert result.latency_ms > 0
    sent = fake_llm.requests[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == [{"role": "user", "content": "hi"}]
    assert "tools" not in sent and "temperature" not in sent


async def test_the_settings_and_options_are_sent_as_given_and_unset_ones_left_out(
    fake_llm, make_llm
):
    fake_llm.script(text("a"), text("b"))
    schema = {"type": "json_schema", "json_schema": {"name": "plan", "schema": {}}}
    llm = make_llm(seed=7, temperature=0.2, max_tokens=64)
    choice = {"type": "function", "function": {"name": "add"}}
    await llm.complete(HI, tools=TOOLS, tool_choice=choice, response_format=schema)
    await make_llm().complete(HI, tool_choice="required")

    given, bare = fake_llm.requests
    assert (given["seed"], given["temperature"], given["max_tokens"]) == (7, 0.2, 64)
    assert (given["tool_choice"], given["response_format"]) == (choice, schema)
    left_out = {"seed", "temperature", "max_tokens", "tools", "tool_choice", "response_format"}
    assert left_out.isdisjoint(bare), "a tool_choice without tools, or an unset setting"


async def test_two_tool_calls_are_assembled_from_their_fragments(fake_llm, make_llm):
    fake_llm.script(
        tool_calls(("search", {"query": "nats kv"}), ("add", {"a": 1, "b": 2}), content="Let me.")
    )
    result = await make_llm().complete(HI, tools=TOOLS)

    assert result.content == "Let me."
    assert result.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("search", {"query": "nats kv"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert [c.id for c in result.tool_calls] == ["call_chatcmpl-1_0", "call_chatcmpl-1_1"]
    assert fake_llm.requests[0]["tools"] == TOOLS


@pytest.mark.parametrize(
    ("omit", "ids"),
    [
        ({"omit_index": True}, ["call_chatcmpl-1_0", "call_chatcmpl-1_1"]),
        ({"omit_id": True}, ["call_0", "call_1"]),
        ({"omit_index": True, "omit_id": True}, ["call_0", "call_1"]),
    ],
)
async def test_tool_calls_without_index_or_id_are_still_assembled(fake_llm, make_llm, omit, ids):
    fake_llm.script(tool_calls(("search", {"query": "a long query"}), ("add", {"a": 1}), **omit))
    result = await make_llm().complete(HI, tools=TOOLS)
    assert result.tool_calls == (
        ToolCall(id=ids[0], name="search", arguments='{"query": "a long query"}'),
        ToolCall(id=ids[1], name="add", arguments='{"a": 1}'),
    )


async def test_usage_from_the_last_chunk_is_recorded(fake_llm, make_llm):
    fake_llm.script(text("hello"), text("hello", usage=False))
    llm = make_llm()
    assert (await llm.complete(HI)).usage == Usage(
        prompt_tokens=1, completion_tokens=2, total_tokens=3
    )
    assert (await llm.complete(HI)).usage is None


async def test_an_empty_reply_is_returned_as_it_is(fake_llm, make_llm, rec):
    fake_llm.script(empty())
    result = await make_llm().complete(HI, on_retry=rec.on_retry)
    assert (result.content, result.tool_calls, result.finish_reason) == ("", (), "stop")
    assert rec.retries == []


async def test_a_429_is_retried_once_then_succeeds(fake_llm, make_llm, rec):
    fake_llm.script(error(429, "slow down"), text("ok"))
    result = await make_llm().complete(HI, on_retry=rec.on_retry)

    assert result.content == "ok"
    [(attempt, reason, delay, model)] = rec.retries
    assert (attempt, model) == (1, "primary")
    assert "429" in reason and "slow down" in reason
    assert rec.sleeps == [delay]
    assert 0 <= delay <= 0.01


@pytest.mark.parametrize(("retry_after", "waited"), [(3, 3.0), (0.25, 0.25), (60, 8.0)])
async def test_retry_after_is_honoured_up_to_the_backoff_cap(
    fake_llm, make_llm, rec, retry_after, waited
):
    fake_llm.script(error(503, retry_after=retry_after), text("ok"))
    await make_llm(backoff_max_s=8.0).complete(HI, on_retry=rec.on_retry)
    assert rec.sleeps == [waited]
    assert rec.retries[0][2] == waited


async def test_backoff_grows_exponentially_with_full_jitter(fake_llm, make_llm, rec):
    fake_llm.script(error(500), error(500), error(500), text("ok"))
    await make_llm(rng=random.Random(7), max_retries=3, backoff_initial_s=1.0).complete(HI)

    expected = random.Random(7)
    assert rec.sleeps == [expected.uniform(0, cap) for cap in (1.0, 2.0, 4.0)]


async def test_spent_retries_fall_back_to_the_next_model(fake_llm, make_llm, rec):
    fake_llm.script(error(500), error(500), error(500), text("from the fallback"))
    llm = make_llm(max_retries=2, fallback_models=("backup",))
    result = await llm.complete(HI, on_retry=rec.on_retry)

    assert [r["model"] for r in fake_llm.requests] == ["primary"] * 3 + ["backup"]
    assert (result.content, result.model) == ("from the fallback", "backup")
    assert [(a, m) for a, _, _, m in rec.retries] == [(1, "primary"), (2, "primary")]


async def test_a_model_argument_replaces_the_primary(fake_llm, make_llm):
    fake_llm.script(error(500), text("ok"))
    llm = make_llm(max_retries=0, fallback_models=("backup",))
    await llm.complete(HI, model="special")
    assert [r["model"] for r in fake_llm.requests] == ["special", "backup"]


async def test_when_every_model_fails_the_error_names_each(fake_llm, make_llm):
    fake_llm.script(error(500, "boom"), error(500, "boom"), error(429), error(503, "down"))
    llm = make_llm(max_retries=1, fallback_models=("backup",))
    with pytest.raises(LLMError) as failed:
        await llm.complete(HI)

    message = str(failed.value)
    assert "primary: HTTP 500: boom" in message
    assert "backup: HTTP 503: down" in message
    assert failed.value.attempts == 4
    assert isinstance(failed.value.last, openai.InternalServerError)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_a_client_error_goes_to_the_next_model_without_retrying(
    fake_llm, make_llm, rec, status
):
    fake_llm.script(error(status, "nope"), text("ok"))
    result = await make_llm(fallback_models=("backup",)).complete(HI, on_retry=rec.on_retry)
    assert [r["model"] for r in fake_llm.requests] == ["primary", "backup"]
    assert result.content == "ok"
    assert rec.retries == [] and rec.sleeps == []


async def test_a_client_error_on_the_last_model_raises_at_once(fake_llm, make_llm):
    fake_llm.script(error(400, "bad request"))
    with pytest.raises(LLMError, match="primary: HTTP 400: bad request") as failed:
        await make_llm(max_retries=3).complete(HI)
    assert failed.value.attempts == 1


async def test_a_timeout_is_retried(fake_llm, make_llm, rec):
    fake_llm.script(hang(30), text("ok"))
    # the timeout holds for the retry too: room for its answer on a loaded machine
    result = await make_llm(timeout_s=2.0).complete(HI, on_retry=rec.on_retry)
    assert result.content == "ok"
    assert [r[1] for r in rec.retries] == ["timed out"]


async def test_a_stream_cut_short_is_retried(fake_llm, make_llm, rec):
    fake_llm.script(cut("a partial answer that never ends", after_chunks=2), text("whole"))
    result = await make_llm().complete(HI, on_delta=rec.on_delta, on_retry=rec.on_retry)

    assert result.content == "whole"
    assert "connection error" in rec.retries[0][1]
    assert rec.deltas == ["a partia", "l answer", "whole"]  # the caller drops on retry


async def test_cancelling_closes_the_stream_promptly(fake_llm, make_llm, rec):
    fake_llm.script(text("tick " * 200, chunk_size=5, delay_s=60))  # the next chunk: in 60 s
    first = asyncio.Event()
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)
        first.set()

    task = asyncio.create_task(make_llm().complete(HI, on_delta=on_delta))
    async with asyncio.timeout(30):
        await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(30):  # not waiting for the next chunk
            await task
    await fake_llm.wait_disconnects(1, timeout=30)
    assert deltas == ["tick "]


async def test_cancelling_while_waiting_for_headers_hangs_up(fake_llm, make_llm):
    fake_llm.script(hang(60))
    task = asyncio.create_task(make_llm().complete(HI))
    await fake_llm.wait_requests(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(30):  # the server would send headers in 60 s
            await task
    await fake_llm.wait_disconnects(1, timeout=30)


async def test_a_one_megabyte_reply_streams_in_many_chunks(fake_llm, make_llm, rec):
    big = "".join(f"line {i:07d} of a long answer\n" for i in range(40_000))[: 1 << 20]
    fake_llm.script(text(big, chunk_size=1024))
    result = await make_llm().complete(HI, on_delta=rec.on_delta)
    assert len(rec.deltas) == 1024
    assert result.content == big


def test_messages_become_chat_completion_dicts():
    messages = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="add", name="ada"),
        ChatMessage(
            role="assistant", tool_calls=(ToolCall(id="c1", name="add", arguments='{"a":1}'),)
        ),
        ChatMessage(role="tool", content="1", tool_call_id="c1", name="add"),
        ChatMessage(role="assistant", content="it is 1"),
    ]
    assert to_openai_messages(messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add", "name": "ada"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":1}'},
                }
            ],
        },
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
        {"role": "assistant", "content": "it is 1"},
    ]


async def test_closing_is_idempotent_and_leaves_a_given_client_open(fake_llm):
    fake_llm.script(text("still open"))
    async with openai.AsyncOpenAI(base_url=fake_llm.base_url, api_key="t", max_retries=0) as c:
        async with OpenAILLM(LLMSettings(), client=c) as llm:
            pass
        await llm.aclose()
        assert not c.is_closed()
        assert (await OpenAILLM(LLMSettings(), client=c).complete(HI)).content == "still open"
    owned = OpenAILLM(LLMSettings(base_url=fake_llm.base_url))
    await owned.aclose()
    await owned.aclose()
    assert owned._client.is_closed()


class RawServer:
    """An HTTP server on loopback that answers every request with the same SSE body,
    each of ``parts`` its own chunk of a chunked response: a provider that streams what
    the fake does not (malformed chunks, errors inside the stream, CRLF framing)."""

    def __init__(self, *parts: bytes) -> None:
        self.parts = parts
        self.served = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )  # fmt: skip
        await reader.readexactly(length)
        self.served += 1
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for part in self.parts:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> LLMSettings:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return LLMSettings(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="k", model="m", max_retries=2
        )

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()


def sse(*chunks: dict[str, Any] | bytes, end: bytes = b"\n\n") -> list[bytes]:
    """Each chunk as one event (its JSON, or bytes as they are), then ``[DONE]``."""
    data = [c if isinstance(c, bytes) else json.dumps(c).encode() for c in chunks]
    return [b"data: " + d + end for d in [*data, b"[DONE]"]]


def chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [choice],
        **more,
    }


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        (
            chunk({"content": 7}),
            "Expected `str | null`, got `int` - at `$.choices[0].delta.content`",
        ),
        ({"id": "c1", "choices": "oops"}, "Expected `array | null`, got `str` - at `$.choices`"),
        (chunk({"tool_calls": [{"index": "0"}]}), "at `$.choices[0].delta.tool_calls[0].index`"),
        (b'{"id": "c1", "choices": [', "Input data was truncated: '{"),
        (b"not json", "JSON is malformed"),
    ],
)
async def test_a_chunk_the_loop_cannot_read_fails_the_model_without_a_retry(
    rec: Recorder, bad: dict[str, Any] | bytes, named: str
) -> None:
    """A server that streams a chunk of another shape is not asked again: the same request
    would get the same answer. The error names the field and what it held, or quotes the
    chunk that is not JSON."""
    server = RawServer(*sse(chunk({"content": "a"}), bad))
    async with server as settings, OpenAILLM(settings, sleep=rec.sleep) as llm:
        with pytest.raises(LLMError) as caught:
            await llm.complete(HI, on_delta=rec.on_delta, on_retry=rec.on_retry)
    assert "a streamed chunk the loop cannot read" in str(caught.value)
    assert named in str(caught.value)
    assert rec.retries == [] and rec.deltas == ["a"]


async def test_an_error_sent_inside_the_stream_raises_the_clients_api_error(rec: Recorder) -> None:
    error = {"error": {"message": "the model overloaded", "type": "server_error"}}
    server = RawServer(*sse(chunk({"content": "a"}), error))
    async with server as settings, OpenAILLM(settings, sleep=rec.sleep) as llm:
        with pytest.raises(LLMError) as caught:
            await llm.complete(HI, on_retry=rec.on_retry)
    last = caught.value.last
    assert type(last) is openai.APIError and last.message == "the model overloaded"
    assert last.body == error["error"]
    assert len(rec.retries) == 2  # retried, as the client's stream error always was


async def test_crlf_framing_comments_and_bytes_split_anywhere_read_the_same(rec: Recorder) -> None:
    """Events framed with CRLF, a comment, a data field over two lines, an ``event`` line,
    and each event cut in two reads mid-line: the reply reads as sent."""
    calls = [{"index": 0, "id": "call_1", "function": {"name": "search", "arguments": '{"q":'}}]
    parts = sse(
        chunk({"role": "assistant", "content": "héllo "}),
        chunk({"content": "world"}),
        chunk({"tool_calls": calls}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "x"}'}}]}),
        chunk({}, "tool_calls"),
        chunk({}, None, usage={"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}),
        end=b"\r\n\r\n",
    )
    parts[1] = b": keep-alive\r\nevent: message\r\n" + parts[1]
    parts[2] = parts[2].replace(b'"content"', b'\r\ndata: "content"', 1)
    split = [half for p in parts for half in (p[: len(p) // 2 + 1], p[len(p) // 2 + 1 :])]
    async with RawServer(*split) as settings, OpenAILLM(settings, sleep=rec.sleep) as llm:
        result = await llm.complete(HI, tools=TOOLS, on_delta=rec.on_delta)
    assert rec.deltas == ["héllo ", "world"]
    assert result.tool_calls == (ToolCall(id="call_1", name="search", arguments='{"q": "x"}'),)
    assert (result.finish_reason, result.model) == ("tool_calls", "m")
    assert result.usage == Usage(prompt_tokens=4, completion_tokens=3, total_tokens=7)


@pytest.mark.parametrize(
    ("status", "raised"),
    [
        (400, openai.BadRequestError),
        (401, openai.AuthenticationError),
        (404, openai.NotFoundError),
        (429, openai.RateLimitError),
        (500, openai.InternalServerError),
    ],
)
async def test_an_http_error_keeps_the_openai_error_class(fake_llm, make_llm, status, raised):
    fake_llm.script(error(status, "no"))
    with pytest.raises(LLMError) as failed:
        await make_llm(max_retries=0).complete(HI)
    assert type(failed.value.last) is raised


async def test_a_timeout_between_chunks_is_retried(fake_llm, make_llm, rec):
    fake_llm.script(text("slow " * 10, chunk_size=5, delay_s=30), text("ok"))
    result = await make_llm(timeout_s=1.0).complete(HI, on_retry=rec.on_retry)
    assert result.content == "ok"
    assert [r[1] for r in rec.retries] == ["timed out"]
