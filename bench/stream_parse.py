"""What reading a model's stream costs per chunk, through the ``openai`` client:

    python -m bench.stream_parse [--chunks 2000] [--repeats 5]

The same SSE bytes (``--chunks`` content chunks of a chat-completions stream, one chunk
per read, as a model streaming token by token sends them) read three ways, in this
process, with an in-memory transport (no sockets: the figure is the client's and the
parse's own CPU):

- ``typed``: ``openai.AsyncStream[ChatCompletionChunk]``, the client's pydantic model
  built for every chunk (what ``chat.completions.create(stream=True)`` yields);
- ``json``: ``openai.AsyncStream[object]``, the chunk's JSON as the client decodes it;
- ``loop``: ``json`` converted by msgspec into the fields the loop reads
  (``loop_worker.engine.llm.read_chunk``): what :class:`OpenAILLM` does.

It prints the CPU microseconds per chunk of each, the best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from loop_worker.engine.llm import read_chunk


def sse_chunks(n: int) -> list[bytes]:
    """``n`` content chunks of one token each, the finish chunk and ``[DONE]``."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    out = []
    for i in range(n):
        delta = {"content": f" tok{i}"} if i else {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        out.append(b"data: " + json.dumps({**base, "choices": [choice]}).encode() + b"\n\n")
    end = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    out.append(b"data: " + json.dumps({**base, "choices": [end]}).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


async def per_chunk_us(kind: str, chunks: list[bytes]) -> float:
    def answer(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=_Chunks(chunks))

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    client = openai.AsyncOpenAI(base_url="http://llm/v1", api_key="k", http_client=http)
    chunk_type: type = ChatCompletionChunk if kind == "typed" else object
    started = time.process_time()
    stream = await client.post(
        "/chat/completions",
        body={"model": "m", "messages": [], "stream": True},
        cast_to=ChatCompletion,
        stream=True,
        stream_cls=openai.AsyncStream[chunk_type],  # type: ignore[valid-type]
    )
    async with stream:
        async for raw in stream:
            if kind == "loop":
                read_chunk(raw)
    spent = time.process_time() - started
    await client.close()
    return spent / len(chunks) * 1e6


async def main(args: argparse.Namespace) -> None:
    chunks = sse_chunks(args.chunks)
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for kind in ("typed", "json", "loop"):
            us = await per_chunk_us(kind, chunks)
            best[kind] = min(best.get(kind, us), us)
    print(f"CPU per streamed chunk, best of {args.repeats} runs of {args.chunks} chunks:")
    for kind, us in best.items():
        print(f"  {kind:6} {us:7.1f} us   ({us / best['typed']:.2f}x typed)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
