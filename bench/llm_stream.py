"""Replies streamed at a model's pace, for ``bench/llm_server.py`` (``--ttft-ms``,
``--tokens-per-s``, ``--tokens``): the load bench's model (``python -m bench.load``).

A paced reply is an HTTP/1.1 response in chunked transfer encoding: the head and the
role chunk at once, then ``tokens`` content chunks of one token each, the first
``ttft_s`` after the request arrived and the next every ``1 / tokens_per_s``, then the
rest of the reply at once (the tool call in fragments, the finish reason, the usage,
``[DONE]``). Each token's text is `` t<the Unix time it was written, to the µs>``
(:func:`stamp`): a client recovers when the model emitted every token it receives from
the text alone, and the text it assembles is exactly the model's. A token that falls
due while the event loop is busy goes out with the next write, stamped with the time
it really went out.

Cheap per token: one timer callback and one write; a token's chunk is its text between
two byte strings encoded once per reply.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

import msgspec

#: A token's text: a space, ``t``, and the Unix time it was written (``t<s>.<µs>``).
STAMP = re.compile(r" t(\d+\.\d{6})")
_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


def stamp(now: float) -> str:
    """The text of a token written at Unix time ``now``."""
    return f" t{now:.6f}"


class Pace(msgspec.Struct, frozen=True, kw_only=True):
    """How a streamed reply is paced; ``tokens = 0`` and ``ttft_s = 0``: not at all (the
    whole reply in one write, as the other benches want)."""

    ttft_s: float = 0.0
    tokens_per_s: float = 50.0
    tokens: int = 0  # content tokens per reply

    @property
    def on(self) -> bool:
        return self.tokens > 0 or self.ttft_s > 0

    @property
    def nominal_s(self) -> float:
        """A reply's time from its request to its last token, as the model means it."""
        return self.ttft_s + max(0, self.tokens - 1) / self.tokens_per_s


class Streamed(msgspec.Struct, array_like=True):
    """What the server streamed for one turn: seconds from each reply's request to its
    last write (summed over the turn's replies), tokens, characters of content, replies."""

    model_s: float = 0.0
    tokens: int = 0
    chars: int = 0
    replies: int = 0


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class PacedReply:
    """One reply written over time on ``transport``; ``done(self)`` once it is all
    written (``model_s``, ``tokens`` and ``chars`` then say what it took)."""

    def __init__(
        self,
        transport: Any,
        pace: Pace,
        *,
        arrived: float,
        head: bytes,
        token: tuple[bytes, bytes],
        tail: bytes,
        done: Callable[[PacedReply], None],
    ) -> None:
        self.transport = transport
        self.pace = pace
        self.loop = asyncio.get_running_loop()
        # the request's arrival (a perf_counter reading) on the loop's clock
        self.start = self.loop.time() - (time.perf_counter() - arrived)
        self.head, self.token, self.tail = head, token, tail
        self.done = done
        self.tokens = self.chars = 0
        self.model_s = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        self.transport.write(_HEAD + _chunked(self.head))
        self._timer = self.loop.call_at(self.start + self.pace.ttft_s, self._tick)

    def _due(self, n: int) -> float:
        return self.start + self.pace.ttft_s + n / self.pace.tokens_per_s

    def _tick(self) -> None:
        now = self.loop.time()
        left = self.pace.tokens - self.tokens
        due = min(left, 1 + int((now - self._due(self.tokens)) * self.pace.tokens_per_s))
        out = []
        if due > 0:
            text = stamp(time.time()).encode()
            prefix, suffix = self.token
            out = [prefix, b'"', text, b'"', suffix] * due
            self.tokens += due
            self.chars += due * len(text)
        if self.tokens < self.pace.tokens:
            self.transport.write(_chunked(b"".join(out)))
            self._timer = self.loop.call_at(self._due(self.tokens), self._tick)
            return
        out.append(self.tail)
        self.transport.write(_chunked(b"".join(out)) + _LAST_CHUNK)
        self._timer = None
        self.model_s = self.loop.time() - self.start
        self.done(self)

    def cancel(self) -> None:
        """The connection closed: write nothing more."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
