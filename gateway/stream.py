"""One SSE client's view of a session's events.

Live events come from the session's shared feed (:mod:`gateway.fanout`): the client
joins it first, which fixes the sequence ``join`` after which the feed hands it every
event. A client that resumes from an older sequence (``since`` or ``Last-Event-ID``)
then replays the events after that sequence, up to ``join``, from the stream with a
consumer of its own, and goes on with what the feed buffered for it meanwhile: no gap,
nothing twice. The sequence in the session's events stream (its partition's) is the
SSE ``id``, so a client that resumes from the last id it got misses nothing and gets
nothing twice.

A client that reads too slowly fills its bounded buffer: the feed drops it, the stream
sends what it holds, ends with a ``cut`` event, and the client resumes by
``Last-Event-ID``. Nothing it does slows the other clients or the workers. A client that
asks for history older than the oldest event kept gets a ``trimmed`` event first, and
one that asked for history a ``caught_up`` event once all of it is sent. An idle
stream gets a ``: keepalive`` comment when its writer asks (:meth:`keepalive`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator

import msgspec

from .fanout import Fanout, Item, SessionFeed, event_type, item

KEEPALIVE = b": keepalive\r\n\r\n"
_REPLAY_BATCH = 256


class Trimmed(msgspec.Struct, frozen=True, kw_only=True):
    """History between ``requested`` and ``first_available`` is gone (retention)."""

    requested: int
    first_available: int
    message: str


class CaughtUp(msgspec.Struct, frozen=True, kw_only=True):
    """Every stored event the client asked for has been sent; live ones follow."""

    last_id: int
    message: str


class Cut(msgspec.Struct, frozen=True, kw_only=True):
    """The client fell too far behind; resume with ``Last-Event-ID: last_id``."""

    last_id: int
    message: str


class EventStream:
    """``async with EventStream(...) as s: async for chunk in s.chunks()``: the SSE
    bytes to write, several frames at a time when several are waiting."""

    def __init__(
        self,
        fanout: Fanout,
        tenant: str,
        session: str,
        *,
        after: int | None,
        turn: str | None = None,
        buffer: int = 1_000,
    ) -> None:
        self._fanout = fanout
        self._tenant, self._session = tenant, session
        self._after = after
        self._turn = turn
        self._size = buffer
        self._live: deque[Item] = deque()
        self._arrived = asyncio.Event()
        self._overflowed = False
        self._last_sent = after or 0
        self._feed: SessionFeed | None = None
        self._join = 0
        self._replay_from: int | None = None
        self._notices: list[Item] = []
        self._keepalive_due = False
        self.was_cut = False

    async def __aenter__(self) -> EventStream:
        feed = self._feed = await self._fanout.acquire(self._tenant, self._session)
        try:
            self._join = feed.join(self)
            if self._after is not None and self._after < self._join:
                await self._check_kept(self._after + 1)
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        feed, self._feed = self._feed, None
        if feed is not None:
            feed.leave(self)
            await self._fanout.release(feed)

    async def _check_kept(self, start: int) -> None:
        first, _ = await self._fanout.backend.events_bounds(self._tenant, self._session)
        if start < first:
            trimmed = Trimmed(
                requested=start,
                first_available=first,
                message=(
                    f"events {start}..{first - 1} are no longer kept; "
                    f"this stream continues from {first}"
                ),
            )
            self._notices.append(item(None, "trimmed", msgspec.json.encode(trimmed)))
            start = first
        if start <= self._join:
            self._replay_from = start

    # -- the feed's side --------------------------------------------------------------

    def offer(self, one: Item) -> bool:
        if self._turn is not None and one.turn_id != self._turn:
            return True
        if self._after is not None and one.seq is not None and one.seq <= self._after:
            return True  # resumed from past the feed's position
        if len(self._live) >= self._size:
            self._overflowed = True  # the reader sends what it holds, then a cut
            self._arrived.set()
            return False
        self._live.append(one)
        self._arrived.set()
        return True

    # -- the writer's side ------------------------------------------------------------

    def keepalive(self) -> None:
        """Send a ``: keepalive`` comment next if nothing else is waiting."""
        self._keepalive_due = True
        self._arrived.set()

    async def chunks(self) -> AsyncGenerator[bytes]:
        if self._notices:
            yield b"".join(n.frame for n in self._notices)
        replayed = True
        if self._replay_from is not None:
            async for batch in self._replay(self._replay_from):
                self._last_sent = batch[-1].seq or self._last_sent
                yield b"".join(i.frame for i in batch)
                if self._overflowed:
                    replayed = False  # what the feed holds is past a gap: not sent
                    break
        if replayed and self._after is not None:
            last = max(self._join, self._after)
            caught_up = CaughtUp(
                last_id=last, message=f"history up to {last} sent; live events follow"
            )
            yield item(None, "caught_up", msgspec.json.encode(caught_up)).frame
        while replayed:
            if self._live:
                items = list(self._live)
                self._live.clear()
                self._last_sent = items[-1].seq or self._last_sent
                yield b"".join(i.frame for i in items)
                continue
            if self._overflowed:
                break
            if self._keepalive_due:
                self._keepalive_due = False
                yield KEEPALIVE
                continue
            self._arrived.clear()
            await self._arrived.wait()
        await self.close()
        self.was_cut = True
        cut = Cut(
            last_id=self._last_sent,
            message=(
                "this client fell too far behind and was cut; reconnect with "
                f"Last-Event-ID: {self._last_sent} to continue"
            ),
        )
        yield item(None, "cut", msgspec.json.encode(cut)).frame

    async def _replay(self, start: int) -> AsyncIterator[list[Item]]:
        """The session's stored events from ``start`` to ``join``, in batches."""
        backend = self._fanout.backend
        subjects = backend.subjects
        stored = backend.stored_events(
            subjects.events_stream_of(self._tenant, self._session),
            subjects.session_events(self._tenant, self._session),
            start, "event replay", _REPLAY_BATCH,
        )  # fmt: skip
        async with contextlib.aclosing(stored):
            async for msgs in stored:
                batch: list[Item] = []
                joined = False
                for msg in msgs:
                    seq = msg.metadata.sequence.stream
                    if seq > self._join:  # the feed has it
                        joined = True
                        break
                    one = item(seq, event_type(msg.subject), msg.data)
                    if self._turn is None or one.turn_id == self._turn:
                        batch.append(one)
                    if seq == self._join:
                        joined = True
                        break
                if batch:
                    yield batch
                if joined:
                    return
