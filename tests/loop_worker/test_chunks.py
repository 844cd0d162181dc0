"""The SSE framing and chunk decoding under OpenAILLM (``engine/chunks.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from loop_worker.engine.chunks import Chunk, StreamChunkError, read_chunk, sse_data


async def datas(*parts: bytes) -> list[bytes]:
    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    return [d async for d in sse_data(body())]


BODY = (
    b": a comment\r\n"
    b'data: {"a": 1}\r\n\r\n'
    b"event: message\ndata: one\ndata:two\nid: 7\n\n"
    b"data\rretry: 5\r\r"
    b"data: [DONE]\n\n"
)
EVENTS = [b'{"a": 1}', b"one\ntwo", b"", b"[DONE]"]


async def test_events_read_alike_whichever_line_ends_and_fields_they_have() -> None:
    assert await datas(BODY) == EVENTS


async def test_events_read_alike_however_the_reads_split_the_bytes() -> None:
    for cut in range(1, len(BODY)):
        assert await datas(BODY[:cut], BODY[cut:]) == EVENTS, cut
    assert await datas(*(BODY[i : i + 1] for i in range(len(BODY)))) == EVENTS


async def test_a_last_event_without_its_blank_line_is_still_read() -> None:
    assert await datas(b"data: x\n\ndata: last\r") == [b"x", b"last"]
    assert await datas(b"data: x\n\n: only a comment") == [b"x"]


def test_a_chunk_keeps_only_the_fields_the_loop_reads() -> None:
    raw = (
        b'{"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",'
        b' "system_fingerprint": null, "choices": [{"index": 0, "logprobs": null,'
        b' "finish_reason": null, "delta": {"role": "assistant", "content": "hi",'
        b' "tool_calls": [{"index": 0, "id": "call_1", "type": "function",'
        b' "function": {"name": "search", "arguments": "{\\"q\\""}}]}}]}'
    )
    got = read_chunk(raw)
    assert isinstance(got, Chunk) and got.model == "m" and got.usage is None
    [choice] = got.choices or []
    assert choice.delta is not None and choice.delta.content == "hi"
    [call] = choice.delta.tool_calls or []
    assert (call.index, call.id, call.function and call.function.arguments) == (0, "call_1", '{"q"')


def test_a_bad_chunk_names_the_field_and_what_it_held() -> None:
    with pytest.raises(StreamChunkError, match=r"got `str` - at `\$.usage.total_tokens`"):
        read_chunk(b'{"usage": {"total_tokens": "3"}}')
    with pytest.raises(StreamChunkError, match=r"JSON is malformed.*'\{nope'"):
        read_chunk(b"{nope")
