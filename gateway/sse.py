"""The SSE response: a stream's pre-encoded bytes written to the socket as they come.

No per-event encoding here (each frame was encoded once, for every client of the
session, by :mod:`gateway.fanout`); frames waiting together go out in one send. The
response ends when the stream ends (a cut), when a send blocks longer than
``send_timeout_s``, or when the client disconnects. One watchdog task per response
asks for a keep-alive comment on an idle stream and ends a stuck send: no timer is
armed per event (measured: a timeout around each send and each wait cost about as
much CPU as the rest of the per-client path).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from .stream import EventStream

log = logging.getLogger("loopmesh.gateway.sse")

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class SseResponse:
    def __init__(self, stream: EventStream, *, keepalive_s: float, send_timeout_s: float) -> None:
        self.stream = stream
        self.keepalive_s = keepalive_s
        self.send_timeout_s = send_timeout_s
        self._wrote_at = 0.0  # loop time of the last completed send
        self._sending_since: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        self._wrote_at = asyncio.get_running_loop().time()
        async with asyncio.TaskGroup() as tg:
            writer = tg.create_task(self._write(send))
            watcher = tg.create_task(_disconnected(receive))
            watchdog = tg.create_task(self._watchdog(writer))
            for task in (writer, watcher):
                task.add_done_callback(lambda _: (writer.cancel(), watcher.cancel()))
            writer.add_done_callback(lambda _: watchdog.cancel())
            watcher.add_done_callback(lambda _: watchdog.cancel())

    async def _write(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        async with contextlib.aclosing(self.stream.chunks()) as chunks:
            async for chunk in chunks:
                self._sending_since = loop.time()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._sending_since = None
                self._wrote_at = loop.time()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watchdog(self, writer: asyncio.Task[None]) -> None:
        loop = asyncio.get_running_loop()
        tick = min(self.keepalive_s, self.send_timeout_s) / 2
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            since = self._sending_since
            if since is not None and now - since >= self.send_timeout_s:
                log.info("SSE client did not read for %.0f s; closing", self.send_timeout_s)
                writer.cancel()
                return
            if since is None and now - self._wrote_at >= self.keepalive_s:
                self.stream.keepalive()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Guarded:
    """A response whose clean-up runs however it ends (finished, cut, disconnected)."""

    def __init__(self, response: ASGIApp, cleanup: Callable[[], Awaitable[None]]) -> None:
        self.response = response
        self.cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            await self.cleanup()
