"""What reading a model's stream costs the loop worker per chunk, and how many streaming
sessions a core reads at a model's pace:

    python -m bench.stream_parse [--chunks 2000] [--repeats 5]
                                 [--sessions 50] [--tokens-per-s 50] [--tokens 100]
                                 [--seconds 10] [--paths sse,engine] [--no-http]

A model streams one chunk per token, each its own read. The stream read three ways:

- ``typed``: ``openai.AsyncStream[ChatCompletionChunk]``, the client's SSE decoding and
  its pydantic model built for every chunk (``chat.completions.create(stream=True)``);
- ``sse``: ``openai.AsyncStream[object]``, the client's SSE decoding and JSON, each chunk
  converted by msgspec into the loop's fields (:func:`client_complete`);
- ``engine``: :class:`OpenAILLM` itself: the raw response's bytes split into events and
  each decoded by msgspec straight into the loop's fields (``engine/chunks.py``);
- ``bytes``: the raw response's bytes as ``engine`` gets them, not parsed at all: what the
  client and its transport (``--transport``: ``lean``, loopmesh's HTTP/1.1 transport;
  ``httpx``, the client's own stack of httpx, httpcore, h11 and anyio) cost per read,
  the floor under ``engine`` on that transport;
- ``socket``: no HTTP client: an asyncio protocol on the socket finds the events in what
  it reads and decodes them as ``engine`` does (:class:`SocketReply`): what the event loop's
  read and the decoding cost per chunk, the floor under any client.

**In memory** (no sockets: the client's and the parse's own CPU): the same SSE bytes,
``--chunks`` content chunks one per read, each way; CPU µs per chunk, the best of
``--repeats`` runs.

**Over HTTP** (``--paths``, ``socket,bytes,sse,engine``; ``--no-http`` skips it):
``bench.llm_server`` paced in its own process, ``--tokens`` content chunks per reply at
``--tokens-per-s``, then a tool call, the finish and the usage; this process (uvloop, as
the loop worker) runs ``--sessions`` sessions each asking for the next reply as soon as
the last one ends, for ``--seconds`` after a warm-up. Printed per path: this process's
CPU µs per content chunk (``time.process_time`` over the chunks received: the requests,
reads and the replies' tails included), the share of a core that was, the added latency
per token (its receipt minus the time the server stamped in its text, p50/p99/max), and
the sessions one core reads at that rate (``1e6 / (µs per chunk x tokens per s)``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import msgspec
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from bench.common import LLMServer
from bench.llm_stream import STAMP, Pace
from loop_worker.engine.chunks import Chunk, read_chunk
from loop_worker.engine.http1 import Http1Transport
from loop_worker.engine.llm import OpenAILLM
from loop_worker.engine.reply import ToolCallAssembler
from loop_worker.engine.settings import LLMSettings
from loopmesh.aio import run
from schemas import ChatMessage

HI = [ChatMessage(role="user", content="hi")]
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
}
OnDelta = Callable[[str], Awaitable[None]]
_STAMPED = re.compile(rb" t\d+\.\d{6}")


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


async def client_complete(
    client: openai.AsyncOpenAI, on_delta: OnDelta, typed: bool = False
) -> None:
    """One reply read through the client's own stream (``typed``: its pydantic chunks),
    each chunk converted by msgspec into the loop's fields and assembled as the loop
    does."""
    chunk_type: type = ChatCompletionChunk if typed else object
    stream = await client.post(
        "/chat/completions",
        body=BODY,
        cast_to=ChatCompletion,
        stream=True,
        stream_cls=openai.AsyncStream[chunk_type],  # type: ignore[valid-type]
    )
    calls = ToolCallAssembler()
    async with stream:
        async for raw in stream:
            if typed:
                raw = raw.model_dump()
            chunk = msgspec.convert(raw, Chunk)
            for choice in (chunk.choices or ())[:1]:
                if (delta := choice.delta) is None:
                    continue
                if delta.content:
                    await on_delta(delta.content)
                for fragment in delta.tool_calls or ():
                    calls.add(fragment)


async def raw_bytes(client: openai.AsyncOpenAI, on_delta: OnDelta) -> None:
    """One reply's bytes through the client's HTTP stack, unparsed; ``on_delta`` once per
    stamped token they hold (for the count and the latency)."""
    response = await client.post(
        "/chat/completions", body=BODY, cast_to=httpx.Response, stream=True
    )
    try:
        async for part in response.aiter_bytes():
            for stamp in _STAMPED.finditer(part):
                await on_delta(stamp.group(0).decode())
    finally:
        await response.aclose()


class Window:
    """What the sessions received while it was open: tokens, and (receipt, text) pairs."""

    def __init__(self) -> None:
        self.open = False
        self.tokens = 0
        self.received: list[tuple[float, str]] = []

    def note(self, text: str) -> None:
        if self.open:
            self.tokens += 1
            self.received.append((time.time(), text))

    async def on_delta(self, text: str) -> None:
        self.note(text)

    def latencies_ms(self) -> list[float]:
        out = []
        for at, text in self.received:
            out.extend((at - float(s)) * 1000 for s in STAMP.findall(text))
        return out


class SocketReply(asyncio.Protocol):
    """One reply read straight off a socket (``Connection: close``): each event found in
    what arrives (the chunked framing lies between events) and decoded by msgspec."""

    def __init__(self, request: bytes, on_text: Callable[[str], None]) -> None:
        self.request, self.on_text = request, on_text
        self.buffer = b""
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (start := self.buffer.find(b"data: ")) >= 0:
            if (end := self.buffer.find(b"\n\n", start)) < 0:
                return
            event, self.buffer = self.buffer[start + 6 : end], self.buffer[end + 2 :]
            if event.startswith(b"[DONE]"):
                continue
            for choice in (read_chunk(event).choices or ())[:1]:
                if choice.delta is not None and choice.delta.content:
                    self.on_text(choice.delta.content)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def socket_reply(client: openai.AsyncOpenAI, on_text: Callable[[str], None]) -> None:
    url = client.base_url
    body = json.dumps(BODY).encode()
    request = (
        b"POST %s/chat/completions HTTP/1.1\r\nhost: %s\r\nconnection: close\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
    ) % (url.raw_path.rstrip(b"/"), url.host.encode(), len(body), body)
    loop = asyncio.get_running_loop()
    _, reply = await loop.create_connection(
        lambda: SocketReply(request, on_text), url.host, url.port
    )
    await reply.done


async def read_once(path: str, client: openai.AsyncOpenAI, window: Window) -> None:
    on_delta = window.on_delta
    if path == "socket":
        await socket_reply(client, window.note)
    elif path == "bytes":
        await raw_bytes(client, on_delta)
    elif path == "engine":
        await OpenAILLM(LLMSettings(model="m"), client=client).complete(HI, on_delta=on_delta)
    else:
        await client_complete(client, on_delta, typed=path == "typed")


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


async def per_chunk_us(path: str, chunks: list[bytes]) -> float:
    """CPU µs per chunk of one reply of ``chunks`` read through ``path``, in memory."""

    def answer(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=_Chunks(chunks))

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    client = openai.AsyncOpenAI(
        base_url="http://llm/v1", api_key="k", http_client=http, max_retries=0
    )
    started = time.process_time()
    await read_once(path, client, Window())
    spent = time.process_time() - started
    await client.close()
    return spent / len(chunks) * 1e6


def transport(args: argparse.Namespace) -> dict[str, Any]:
    """The client's HTTP transport: ``lean`` (:class:`Http1Transport`, what
    :class:`OpenAILLM` uses by default), the client's own (``httpx``), or
    ``openai.DefaultAioHttpClient`` (``aiohttp``, ``pip install openai[aiohttp]``)."""
    if args.transport == "aiohttp":
        return {"http_client": openai.DefaultAioHttpClient()}
    if args.transport == "lean":
        return {"http_client": openai.DefaultAsyncHttpxClient(transport=Http1Transport())}
    return {}


async def over_http(path: str, base_url: str, args: argparse.Namespace) -> dict[str, float]:
    """``args.sessions`` sessions streaming back to back through ``path``; the figures
    over ``args.seconds`` after a warm-up of one reply's time."""
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key="k", max_retries=0, timeout=120, **transport(args)
    )
    window = Window()
    reply_s = args.tokens / args.tokens_per_s

    async def session(i: int) -> None:
        await asyncio.sleep(reply_s * i / args.sessions)  # not all in lockstep
        while True:
            await read_once(path, client, window)

    tasks = [asyncio.create_task(session(i)) for i in range(args.sessions)]
    await asyncio.sleep(reply_s * 1.5)
    window.open = True
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.sleep(args.seconds)
    window.open = False
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    failed = [t.exception() for t in tasks if not t.cancelled() and t.exception()]
    if failed:
        raise RuntimeError(f"{len(failed)} sessions failed: {failed[0]!r}")
    latencies = sorted(window.latencies_ms())
    us = cpu / max(1, window.tokens) * 1e6
    return {
        "tokens": window.tokens,
        "tokens_per_s": window.tokens / wall,
        "cpu_us_per_chunk": us,
        "core_share": cpu / wall,
        "p50_ms": statistics.median(latencies) if latencies else float("nan"),
        "p99_ms": latencies[int(len(latencies) * 0.99)] if latencies else float("nan"),
        "max_ms": latencies[-1] if latencies else float("nan"),
        "sessions_per_core": 1e6 / (us * args.tokens_per_s),
    }


async def main(args: argparse.Namespace) -> None:
    chunks = sse_chunks(args.chunks)
    best: dict[str, float] = {}
    for _, path in itertools.product(range(args.repeats), ("typed", "sse", "engine")):
        us = await per_chunk_us(path, chunks)
        best[path] = min(best.get(path, us), us)
    print(f"In memory: CPU per streamed chunk, best of {args.repeats} replies of {args.chunks}:")
    for path, us in best.items():
        print(f"  {path:6} {us:7.1f} us   (sse: {best['sse'] / us:.2f}x this)")
    if args.no_http:
        return
    pace = Pace(tokens_per_s=args.tokens_per_s, tokens=args.tokens)
    print(
        f"\nOver HTTP: {args.sessions} sessions, replies of {args.tokens} tokens at "
        f"{args.tokens_per_s:g}/s back to back, {args.seconds:g} s each path, "
        f"the client on {args.transport}:"
    )
    figures: dict[str, dict[str, float]] = {}
    async with LLMServer(pace) as server:
        for path in args.paths:
            f = figures[path] = await over_http(path, server.base_url, args)
            print(
                f"  {path:6} {f['cpu_us_per_chunk']:6.1f} us CPU per chunk  "
                f"{f['core_share'] * 100:5.1f} % of a core  "
                f"{f['tokens_per_s']:7.0f} chunks/s  "
                f"added latency per token p50 {f['p50_ms']:.1f} / p99 {f['p99_ms']:.1f} / "
                f"max {f['max_ms']:.1f} ms  "
                f"{f['sessions_per_core']:5.0f} sessions per core at {args.tokens_per_s:g} tok/s"
            )
    us = {path: f["cpu_us_per_chunk"] for path, f in figures.items()}
    if "sse" in us and "engine" in us:
        print(f"  engine: {us['sse'] / us['engine']:.2f}x less CPU per chunk than sse")
    if "bytes" in us and "engine" in us:
        share = us["bytes"] / us["engine"] * 100
        print(f"  the transport's reads alone (bytes): {share:.0f} % of engine's CPU per chunk")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m bench.stream_parse",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--chunks", type=int, default=2000, help="per in-memory reply")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=50, help="streaming at once")
    parser.add_argument("--tokens-per-s", type=float, default=50.0)
    parser.add_argument("--tokens", type=int, default=100, help="content tokens per reply")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured, per path")
    parser.add_argument(
        "--paths",
        type=lambda s: s.split(","),
        default=["socket", "bytes", "sse", "engine"],
        help="socket,bytes,sse,engine",
    )
    parser.add_argument("--no-http", action="store_true", help="in memory only")
    parser.add_argument(
        "--transport", choices=["lean", "httpx", "aiohttp"], default="lean",
        help="the client's, over HTTP (aiohttp: openai[aiohttp] installed)",
    )  # fmt: skip
    run(main(parser.parse_args()))
