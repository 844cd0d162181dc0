"""How the fake LLM server writes a reply: OpenAI-shaped SSE chunks or one JSON body.

Chunks carry ``id``, ``object: chat.completion.chunk``, ``created``, the requested
``model`` and ``choices[0].delta`` (role first); the last choice chunk has the
``finish_reason``; then, when ``stream_options.include_usage`` asked for it, a usage
chunk with empty ``choices``; then ``data: [DONE]``. ``cached_tokens`` (the server's
prompt cache, when it keeps one) goes in the usage's ``prompt_tokens_details``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from loopmesh.testing.fake_replies import Cut, Error, Hang, Reply, Text, ToolCalls

_FLUSH_BYTES = 64 * 1024


class ReplyResponse(Response):
    """Plays one reply; stops early when the client hangs up or the server closes."""

    def __init__(
        self,
        reply: Reply,
        body: dict[str, Any],
        *,
        ident: str,
        closing: asyncio.Event,
        on_disconnect: Callable[[], Awaitable[None]],
        cached_tokens: int | None = None,
    ) -> None:
        self.reply = reply
        self.cached_tokens = cached_tokens
        self.request = body
        self.ident = ident
        self.closing = closing
        self.on_disconnect = on_disconnect
        self.model = str(body.get("model") or "fake-model")
        self.created = int(time.time())
        self.complete = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with asyncio.TaskGroup() as tg:
            play = tg.create_task(self._play(send))
            hangup = tg.create_task(_wait_disconnect(receive))
            closing = tg.create_task(self.closing.wait())
            await asyncio.wait({play, hangup, closing}, return_when=asyncio.FIRST_COMPLETED)
            for task in (play, hangup, closing):
                task.cancel()
        if hangup.done() and not hangup.cancelled() and not self.complete:
            await self.on_disconnect()

    async def _play(self, send: Send) -> None:
        match self.reply:
            case Error(status=status, message=message, retry_after=retry_after):
                headers = {} if retry_after is None else {"retry-after": f"{retry_after:g}"}
                body = {"error": {"message": message, "type": "fake_error", "code": str(status)}}
                await _send_json(send, status, body, headers)
            case Hang(seconds=seconds):
                await asyncio.sleep(seconds)
                await _send_json(send, 504, {"error": {"message": "hung", "type": "timeout"}})
            case _ if self.request.get("stream"):
                await self._stream(send)
            case _:
                await _send_json(send, 200, self._whole())
        self.complete = True

    async def _stream(self, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        delay = self.reply.delay_s if isinstance(self.reply, Text | ToolCalls) else 0.0
        paced = 1 + self._content_chunks()  # the role and the content: delay_s apart
        buffer: list[bytes] = []
        size = 0
        for n, chunk in enumerate(self._chunks()):
            if isinstance(self.reply, Cut) and n > self.reply.after_chunks:
                await _send_body(send, b"".join(buffer), more=True)
                return  # no [DONE], no end of body: uvicorn drops the connection
            if delay and 1 < n < paced:  # role and first fragment at once, then delay_s apart
                await asyncio.sleep(delay)
            event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            buffer.append(event)
            size += len(event)
            if delay or size >= _FLUSH_BYTES:
                await _send_body(send, b"".join(buffer), more=True)
                buffer, size = [], 0
        buffer.append(b"data: [DONE]\n\n")
        await _send_body(send, b"".join(buffer), more=False)

    def _chunks(self) -> Iterator[dict[str, Any]]:
        yield self._chunk({"role": "assistant", "content": ""})
        reply = self.reply
        content = reply.content if isinstance(reply, Text | Cut | ToolCalls) else ""
        size = reply.chunk_size if isinstance(reply, Text | Cut | ToolCalls) else 8
        for i in range(0, len(content), max(1, size)):
            yield self._chunk({"content": content[i : i + size]})
        if isinstance(reply, ToolCalls):
            yield from self._tool_chunks(reply)
        finish = "tool_calls" if isinstance(reply, ToolCalls) and reply.calls else "stop"
        yield self._chunk({}, finish_reason=finish)
        include = (self.request.get("stream_options") or {}).get("include_usage")
        if include and getattr(reply, "usage", False):
            yield {**self._base(), "choices": [], "usage": self._usage(content, reply)}

    def _content_chunks(self) -> int:
        reply = self.reply
        if not isinstance(reply, Text | Cut | ToolCalls):
            return 0
        return -(-len(reply.content) // max(1, reply.chunk_size))

    def _tool_chunks(self, reply: ToolCalls) -> Iterator[dict[str, Any]]:
        step = max(1, reply.fragment_size)
        for index, (name, arguments) in enumerate(reply.calls):
            first: dict[str, Any] = {
                "index": index,
                "id": f"call_{self.ident}_{index}",
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            for i in range(0, len(arguments), step):
                yield self._tool_delta(reply, first)
                first = {"index": index, "function": {"arguments": arguments[i : i + step]}}
            yield self._tool_delta(reply, first)

    def _tool_delta(self, reply: ToolCalls, call: dict[str, Any]) -> dict[str, Any]:
        drop = {k for k, omit in (("index", reply.omit_index), ("id", reply.omit_id)) if omit}
        return self._chunk({"tool_calls": [{k: v for k, v in call.items() if k not in drop}]})

    def _base(self) -> dict[str, Any]:
        return {
            "id": self.ident,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
        }

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._base(), "choices": [choice]}

    def _usage(self, content: str, reply: Reply) -> dict[str, Any]:
        p = prompt_tokens(self.request.get("messages") or [])
        out = len(content) + sum(len(n) + len(a) for n, a in getattr(reply, "calls", ()))
        c = out // 4 + 1
        usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": min(self.cached_tokens, p)}
        return usage

    def _whole(self) -> dict[str, Any]:
        reply = self.reply
        content = reply.content if isinstance(reply, Text | Cut | ToolCalls) else ""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = "stop"
        if isinstance(reply, ToolCalls) and reply.calls:
            finish = "tool_calls"
            message["tool_calls"] = [
                {
                    "id": f"call_{self.ident}_{i}",
                    "type": "function",
                    "function": {"name": n, "arguments": a},
                }
                for i, (n, a) in enumerate(reply.calls)
            ]
        return {
            "id": self.ident,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            ],
            "usage": self._usage(content, reply),
        }


def message_tokens(message: dict[str, Any]) -> int:
    """The fake's count of a message's tokens: its text's length / 4."""
    return len(str(message.get("content") or "")) // 4


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "")) for m in messages) // 4 + 1


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_body(send: Send, data: bytes, *, more: bool) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


async def _send_json(
    send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    raw = [(b"content-type", b"application/json")]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await _send_body(send, json.dumps(body).encode(), more=False)
