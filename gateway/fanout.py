"""One live feed per session, shared by all of that session's SSE clients.

A gateway process keeps, for each (tenant, session) that has at least one open event
stream, ONE ordered JetStream consumer on the session's events (:class:`SessionFeed`).
Each message it delivers is turned once into an :class:`Item` holding its SSE frame,
already encoded, and handed to every client of the session: a client costs an append
to its own bounded buffer and a wake-up, not a consumer and an encoding of its own.

The feed reads the stream that holds the session's events (its partition's, with
``[nats] partitions`` above 1: a sequence is an id only within one stream, and all of a
session's events are in one). It starts just after that stream's last sequence when it
is opened and remembers the last sequence it handed out (``last_seq``). A client joins
synchronously: from that moment it gets every item with a sequence above ``last_seq``
at join time, and what it needs from before (a resume by ``Last-Event-ID`` or
``since``) it replays itself from the stream, up to that sequence (see
:mod:`gateway.stream`). So the hand-over is by sequence: no gap, nothing twice. The
feed ends when its last client leaves.

A client whose buffer is full is dropped from the feed (it is cut); the feed itself
never waits for anyone.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Protocol

import msgspec
from nats.aio.msg import Msg
from nats.js import api as js_api

from loopmesh.jetstream import ordered_subscribe

from .backend import Backend

log = logging.getLogger("loopmesh.gateway.fanout")

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


class _TurnOf(msgspec.Struct):
    turn_id: str = ""


_turn_of = msgspec.json.Decoder(_TurnOf)


class Item(msgspec.Struct, frozen=True):
    """One SSE message and its encoded frame; ``seq`` is None for the gateway's notices."""

    seq: int | None
    event: str
    data: bytes
    turn_id: str = ""
    frame: bytes = b""


def frame(seq: int | None, event: str, data: bytes) -> bytes:
    """The SSE frame of one message (``\\r\\n`` line ends, as sse-starlette wrote them)."""
    head = b"event: %s\r\n" % event.encode()
    if seq is not None:
        head = b"id: %d\r\n" % seq + head
    lines = _LINE_BREAK.split(data) if (b"\n" in data or b"\r" in data) else (data,)
    return head + b"".join(b"data: %s\r\n" % line for line in lines) + b"\r\n"


def event_type(subject: str) -> str:
    """The event type of an event's subject: its fifth token
    (``<prefix>.events.<tenant>.<session>.<type>``), not its last, which is the
    partition's number when the events are partitioned."""
    tokens = subject.split(".", 5)
    return tokens[4] if len(tokens) > 4 else ""


def item(seq: int | None, event: str, data: bytes) -> Item:
    turn_id = ""
    if seq is not None:
        try:
            turn_id = _turn_of.decode(data).turn_id
        except msgspec.DecodeError:
            turn_id = ""
    return Item(seq, event, data, turn_id, frame(seq, event, data))


class Listener(Protocol):
    def offer(self, item: Item) -> bool:
        """Take ``item``; False when full (the listener is then dropped: it is cut)."""
        ...


class SessionFeed:
    """The session's one ordered consumer and the listeners it feeds."""

    def __init__(self, backend: Backend, tenant: str, session: str) -> None:
        self.backend = backend
        self.tenant = tenant
        self.session = session
        self.filter = backend.subjects.session_events(tenant, session)
        self.stream = backend.subjects.events_stream_of(tenant, session)
        self.last_seq = 0
        self.listeners: set[Listener] = set()
        self.users = 0  # streams holding the feed (listening or about to)
        self._sub: Any = None

    async def open(self) -> None:
        _, last = await self.backend.events_bounds(self.tenant, self.session)
        self.last_seq = last
        self._sub = await self.backend._call(
            "subscribe to events",
            ordered_subscribe(
                self.backend.nc,
                self.filter,
                js=self.backend.js,
                stream=self.stream,
                cb=self._on_msg,
                deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
                config=js_api.ConsumerConfig(opt_start_seq=last + 1),
            ),
        )

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        self.listeners.clear()
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("session feed unsubscribe failed error=%r", exc)

    def join(self, listener: Listener) -> int:
        """Feed ``listener`` every item after the returned sequence."""
        self.listeners.add(listener)
        return self.last_seq

    def leave(self, listener: Listener) -> None:
        self.listeners.discard(listener)

    async def _on_msg(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.last_seq:
            return  # never hand out a sequence twice
        self.last_seq = seq
        one = item(seq, event_type(msg.subject), msg.data)
        full = [lsn for lsn in self.listeners if not lsn.offer(one)]
        for listener in full:
            self.listeners.discard(listener)


class Fanout:
    """The gateway process's session feeds, opened on demand, closed when unused."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._feeds: dict[tuple[str, str], SessionFeed] = {}
        self._opening: dict[tuple[str, str], asyncio.Future[SessionFeed]] = {}

    async def acquire(self, tenant: str, session: str) -> SessionFeed:
        """The session's feed (opened if needed); give it back with :meth:`release`."""
        key = (tenant, session)
        while True:
            feed = self._feeds.get(key)
            if feed is not None:
                feed.users += 1
                return feed
            opening = self._opening.get(key)
            if opening is None:
                break
            try:
                await asyncio.shield(opening)
            except Exception:
                pass  # the opener reports it; try again (the next attempt may succeed)
        done: asyncio.Future[SessionFeed] = asyncio.get_running_loop().create_future()
        self._opening[key] = done
        feed = SessionFeed(self.backend, tenant, session)
        try:
            await feed.open()
        except BaseException as exc:
            done.set_exception(exc if isinstance(exc, Exception) else RuntimeError("cancelled"))
            done.exception()  # retrieved: waiters only retry
            raise
        finally:
            del self._opening[key]
        self._feeds[key] = feed
        feed.users += 1
        done.set_result(feed)
        return feed

    async def release(self, feed: SessionFeed) -> None:
        feed.users -= 1
        if feed.users == 0 and self._feeds.get((feed.tenant, feed.session)) is feed:
            del self._feeds[(feed.tenant, feed.session)]
            await feed.close()

    def feeds(self) -> int:
        return len(self._feeds)

    async def close(self) -> None:
        feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:
            await feed.close()
