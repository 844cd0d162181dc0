"""One SSE client's view of a session's events.

An ordered consumer on the events stream, filtered to the session's subjects, starts
just after the sequence the client last saw (``since`` or ``Last-Event-ID``) or at new
events. Each message is a ``(sequence, type, JSON)`` item in the stream's own bounded
buffer; the stream sequence becomes the SSE ``id``, so a client that resumes from the
last id it got misses nothing and gets nothing twice.

A client that reads too slowly fills its buffer: the stream then stops taking events,
sends what it holds, ends with a ``cut`` event, and the client resumes by
``Last-Event-ID``. Nothing it does slows the other clients or the workers. A client that
asks for history older than the oldest event kept gets a ``trimmed`` event first.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.js import api as js_api

from schemas import Subjects

from .backend import Backend

log = logging.getLogger("loopmesh.gateway.stream")


class _TurnOf(msgspec.Struct):
    turn_id: str = ""


_turn_of = msgspec.json.Decoder(_TurnOf)


class Item(msgspec.Struct, frozen=True):
    """One SSE message: ``seq`` is None for the gateway's own notices."""

    seq: int | None
    event: str
    data: bytes


class Trimmed(msgspec.Struct, frozen=True, kw_only=True):
    """History between ``requested`` and ``first_available`` is gone (retention)."""

    requested: int
    first_available: int
    message: str


class Cut(msgspec.Struct, frozen=True, kw_only=True):
    """The client fell too far behind; resume with ``Last-Event-ID: last_id``."""

    last_id: int
    message: str


class EventStream:
    """``async with EventStream(...) as s: async for item in s``."""

    def __init__(
        self,
        backend: Backend,
        tenant: str,
        session: str,
        *,
        after: int | None,
        turn: str | None = None,
        buffer: int = 1_000,
    ) -> None:
        self._backend = backend
        subjects: Subjects = backend.subjects
        self._filter = f"{subjects.prefix}.events.{tenant}.{session}.*"
        self._after = after
        self._turn = turn.encode() if turn else None
        self._buffer: deque[Item] = deque()
        self._size = buffer
        self._arrived = asyncio.Event()
        self._overflowed = False
        self._last_sent = after or 0
        self._sub: Any = None
        self._notices: list[Item] = []

    async def __aenter__(self) -> EventStream:
        backend = self._backend
        kwargs: dict[str, Any]
        if self._after is None:
            kwargs = {"deliver_policy": js_api.DeliverPolicy.NEW}
        else:
            first, _ = await backend.events_bounds()
            start = self._after + 1
            if start < first:
                trimmed = Trimmed(
                    requested=start,
                    first_available=first,
                    message=(
                        f"events {start}..{first - 1} are no longer kept; "
                        f"this stream continues from {first}"
                    ),
                )
                self._notices.append(Item(None, "trimmed", msgspec.json.encode(trimmed)))
                start = first
            kwargs = {
                "deliver_policy": js_api.DeliverPolicy.BY_START_SEQUENCE,
                "config": js_api.ConsumerConfig(opt_start_seq=max(start, 1)),
            }
        self._sub = await backend._call(
            "subscribe to events",
            backend.js.subscribe(
                self._filter,
                stream=backend.subjects.events_stream,
                ordered_consumer=True,
                cb=self._on_msg,
                **kwargs,
            ),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("event stream unsubscribe failed error=%r", exc)

    async def _on_msg(self, msg: Msg) -> None:
        if self._overflowed:
            return
        if self._turn is not None:
            try:
                if _turn_of.decode(msg.data).turn_id.encode() != self._turn:
                    return
            except msgspec.DecodeError:
                return
        seq = msg.metadata.sequence.stream
        item = Item(seq, msg.subject.rpartition(".")[2], msg.data)
        if len(self._buffer) >= self._size:
            self._overflowed = True  # the reader sends what it holds, then a cut
        else:
            self._buffer.append(item)
        self._arrived.set()

    def __aiter__(self) -> AsyncIterator[Item]:
        return self._items()

    async def _items(self) -> AsyncIterator[Item]:
        for notice in self._notices:
            yield notice
        while True:
            if self._buffer:
                item = self._buffer.popleft()
                if item.seq is not None:
                    self._last_sent = item.seq
                yield item
                continue
            if self._overflowed:
                break
            self._arrived.clear()
            await self._arrived.wait()
        await self.close()
        cut = Cut(
            last_id=self._last_sent,
            message=(
                "this client fell too far behind and was cut; reconnect with "
                f"Last-Event-ID: {self._last_sent} to continue"
            ),
        )
        yield Item(None, "cut", msgspec.json.encode(cut))
