"""A streamed chat-completions reply, read from the provider's server-sent-event bytes.

:class:`SseSplitter` splits the response body into its events' ``data`` and
:func:`read_chunk` decodes each with msgspec straight into :class:`Chunk`: the few fields
the loop reads (the text, the tool-call fragments, the finish reason, the usage, an error
sent inside the stream); every other field is skipped unread. A model streams one chunk per
token, each its own read, so this is the loop worker's per-token cost:
``python -m bench.stream_parse`` measures it against the ``openai`` client's own SSE
decoding.

The events are framed as the SSE specification says (lines end in ``\\n``, ``\\r\\n`` or
``\\r``; a blank line ends an event; ``data`` lines join with ``\\n``; comments, ``event``,
``id`` and ``retry`` are ignored); an event of one ``data: `` line, what every provider
sends, takes the short path.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import msgspec


class FunctionDelta(msgspec.Struct, frozen=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, frozen=True):
    index: int | None = None
    id: str | None = None
    function: FunctionDelta | None = None


class Delta(msgspec.Struct, frozen=True):
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class Choice(msgspec.Struct, frozen=True):
    delta: Delta | None = None
    finish_reason: str | None = None


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int | None = None


class ChunkUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: PromptTokensDetails | None = None


class Chunk(msgspec.Struct, frozen=True):
    """What the loop reads of a streamed chat-completions chunk (the rest is skipped)."""

    model: str | None = None
    choices: list[Choice] | None = None
    usage: ChunkUsage | None = None
    error: Any = None  # an error the provider sends inside the stream: its JSON


class StreamChunkError(Exception):
    """A streamed chunk that is not JSON, or whose fields are not what the
    chat-completions API sends."""


_decode = msgspec.json.Decoder(Chunk).decode
_SHOWN = 200  # bytes of a bad chunk quoted in its error


def read_chunk(data: bytes) -> Chunk:
    """One event's ``data`` as a :class:`Chunk`; :class:`StreamChunkError` names what is
    wrong (msgspec's message: the field's path and what it held, or where the JSON breaks)."""
    try:
        return _decode(data)
    except msgspec.ValidationError as exc:
        raise StreamChunkError(f"a streamed chunk the loop cannot read: {exc}") from None
    except msgspec.DecodeError as exc:
        quoted = data[:_SHOWN].decode(errors="replace")
        raise StreamChunkError(
            f"a streamed chunk the loop cannot read: {exc}: {quoted!r}"
        ) from None


class SseSplitter:
    """The ``data`` of each event in an SSE byte stream, however its reads split it:
    :meth:`feed` each read, then :meth:`end`. A plain method, not a generator: it runs
    once per token, and each generator between the socket and the loop costs a resume."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, part: bytes) -> list[bytes]:
        pending = self._pending + part if self._pending else part
        if b"\r" in pending:
            pending = _lf(pending)
        if b"\n\n" not in pending:
            self._pending = pending
            return []
        *events, self._pending = pending.split(b"\n\n")
        out = []
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:
                out.append(event[6:])  # the short path: one data line
            elif (data := _data(event)) is not None:
                out.append(data)
        return out

    def end(self) -> list[bytes]:
        """What the body held after its last blank line (an event not ended by one)."""
        data = _data(_lf(self._pending))
        self._pending = b""
        return [] if data is None else [data]


async def sse_data(body: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """:class:`SseSplitter` over an async byte stream."""
    splitter = SseSplitter()
    async for part in body:
        for data in splitter.feed(part):
            yield data
    for data in splitter.end():
        yield data


def _lf(text: bytes) -> bytes:
    """Line ends as ``\\n``; a last ``\\r`` waits: the next read may bring its ``\\n``."""
    held = text.endswith(b"\r")
    if held:
        text = text[:-1]
    text = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return text + b"\r" if held else text


def _data(event: bytes) -> bytes | None:
    lines = [
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in event.rstrip(b"\r").split(b"\n")
        if line.startswith(b"data:") or line == b"data"
    ]
    return b"\n".join(lines) if lines else None
