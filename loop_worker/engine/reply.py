"""A streamed chat-completions reply, read off the raw HTTP response.

:func:`read_reply` reads the reply's SSE bytes straight from the client's HTTP response
(:class:`~loop_worker.engine.llm.OpenAILLM` asks for it raw) and decodes each event with
:mod:`.chunks` into a :class:`Reply`: the text, passed to ``on_delta`` as it arrives, the
tool calls, assembled from their fragments per ``index`` (:class:`ToolCallAssembler`),
the finish reason, the usage and the model. What the ``openai`` client's own stream does
besides is done here: an ``error`` sent inside the stream raises ``openai.APIError``, a
timeout or a broken connection while reading raises ``APITimeoutError`` or
``APIConnectionError``, the body is read to its end after ``[DONE]`` (HTTP/1.1 then keeps
the connection), and the response is closed on every exit, cancellation too.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import openai

from schemas import ToolCall
from schemas.events import Usage

from .chunks import Chunk, SseSplitter, read_chunk
from .protocols import OnDelta

try:  # the openai client's transport: httpx2 from openai 3.x's later releases, else httpx
    import httpx2
except ImportError:  # pragma: no cover - the floor's openai, on httpx alone
    httpx2 = None  # type: ignore[assignment]

#: What reading a response body raises on a timeout, and on a broken connection (the
#: openai client's own stream maps the same to its errors).
_TIMEOUTS: tuple[type[Exception], ...] = (httpx.TimeoutException,)
_BROKEN: tuple[type[Exception], ...] = (httpx.RequestError, ssl.SSLError, anyio.EndOfStream)
if httpx2 is not None:
    _TIMEOUTS += (httpx2.TimeoutException,)
    _BROKEN += (httpx2.RequestError,)


class StreamCutError(Exception):
    """The stream ended before the model finished (no ``finish_reason``)."""


def _body(response: Any) -> AsyncIterator[bytes]:
    """The response's body as its transport reads it: ``response.stream`` itself when it
    has no content coding (what a model's stream is sent with), one generator fewer per
    read than ``aiter_bytes``, which decodes gzip and the like."""
    if response.headers.get("content-encoding", "identity").lower() == "identity":
        return aiter(response.stream)
    return response.aiter_bytes()


async def read_reply(response: Any, on_delta: OnDelta | None) -> Reply:
    """Read ``response``'s streamed reply to its end, passing its text to ``on_delta``;
    the response is closed on every exit."""
    reply = Reply(response.request)  # httpx's or httpx2's, as the client's errors take
    splitter = SseSplitter()
    try:
        async for part in _body(response):
            for data in splitter.feed(part):
                if (text := reply.take(data)) and on_delta is not None:
                    await on_delta(text)
        for data in splitter.end():
            if (text := reply.take(data)) and on_delta is not None:
                await on_delta(text)
    except _TIMEOUTS as exc:
        raise openai.APITimeoutError(request=reply.request) from exc
    except _BROKEN as exc:
        raise openai.APIConnectionError(request=reply.request) from exc
    finally:
        await response.aclose()  # on every exit, cancellation too
    return reply


class Reply:
    """A streamed reply as its events arrive: :meth:`take` reads one event's data."""

    def __init__(self, request: Any) -> None:
        self.request = request
        self.content: list[str] = []
        self.calls = ToolCallAssembler()
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.model = ""
        self.done = False

    def take(self, data: bytes) -> str | None:
        """Read one event; its text, if it brings some. After ``[DONE]`` the rest of the
        body is read and skipped: HTTP/1.1 then keeps the connection."""
        if self.done:
            return None
        if data.startswith(b"[DONE]"):
            self.done = True
            return None
        chunk = read_chunk(data)
        if chunk.error is not None:
            raise _stream_error(chunk.error, self.request)
        self.model = self.model or chunk.model or ""
        self.usage = _usage(chunk) or self.usage
        text = None
        for choice in (chunk.choices or ())[:1]:
            self.finish = choice.finish_reason or self.finish
            if (delta := choice.delta) is None:  # some servers' last chunk
                continue
            if delta.content:
                self.content.append(delta.content)
                text = delta.content
            for fragment in delta.tool_calls or ():
                self.calls.add(fragment)
        return text


class ToolCallAssembler:
    """Builds whole tool calls from streamed fragments, defensively.

    A fragment with an ``index`` belongs to that index's call. One without continues the
    latest call, unless it brings a different ``id``, or a ``function.name`` while the
    latest call already has one: then it starts a new call. Calls without an id get
    ``call_<n>`` (``n``: position in the response). Arguments are concatenated as text.
    """

    def __init__(self) -> None:
        self._calls: list[dict[str, Any]] = []
        self._by_index: dict[int, dict[str, Any]] = {}

    def add(self, fragment: Any) -> None:
        index: int | None = getattr(fragment, "index", None)
        ident: str | None = getattr(fragment, "id", None)
        function = getattr(fragment, "function", None)
        name: str | None = getattr(function, "name", None)
        arguments: str | None = getattr(function, "arguments", None)
        call = self._by_index.get(index) if index is not None else self._latest()
        if call is not None and (
            (ident and call["id"] and ident != call["id"])
            or (index is None and name and call["name"])
        ):
            call = None
        if call is None:
            call = {"id": None, "name": None, "arguments": []}
            self._calls.append(call)
            if index is not None:
                self._by_index[index] = call
        call["id"] = call["id"] or ident
        call["name"] = call["name"] or name
        if arguments:
            call["arguments"].append(arguments)

    def _latest(self) -> dict[str, Any] | None:
        return self._calls[-1] if self._calls else None

    def result(self) -> tuple[ToolCall, ...]:
        return tuple(
            ToolCall(
                id=c["id"] or f"call_{n}",
                name=c["name"] or "",
                arguments="".join(c["arguments"]) or "{}",
            )
            for n, c in enumerate(self._calls)
        )


def _stream_error(error: Any, request: Any) -> openai.APIError:
    """An ``error`` sent inside the stream, raised as the openai client's stream does."""
    message = error.get("message") if isinstance(error, dict) else None
    if not message or not isinstance(message, str):
        message = "An error occurred during streaming"
    return openai.APIError(message, request, body=error)


def _usage(chunk: Chunk) -> Usage | None:
    u = chunk.usage
    if u is None:
        return None
    details = u.prompt_tokens_details
    return Usage(
        prompt_tokens=u.prompt_tokens or 0,
        completion_tokens=u.completion_tokens or 0,
        total_tokens=u.total_tokens or 0,
        cached_tokens=(details.cached_tokens or 0) if details is not None else 0,
    )
