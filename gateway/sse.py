"""The SSE response: a stream's pre-encoded bytes written to the socket as they come.

No per-event encoding here (each frame was encoded once, for every client of the
session, by :mod:`gateway.fanout`); frames waiting together go out in one send. The
response ends when the stream ends (a cut), when a send blocks longer than
``send_timeout_s``, or when the client disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.types import Receive, Scope, Send

from .stream import EventStream

log = logging.getLogger("loopmesh.gateway.sse")

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class SseResponse:
    def __init__(self, stream: EventStream, *, send_timeout_s: float) -> None:
        self.stream = stream
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        async with asyncio.TaskGroup() as tg:
            writer = tg.create_task(self._write(send))
            watcher = tg.create_task(_disconnected(receive))
            writer.add_done_callback(lambda _: watcher.cancel())
            watcher.add_done_callback(lambda _: writer.cancel())

    async def _write(self, send: Send) -> None:
        async with contextlib.aclosing(self.stream.chunks()) as chunks:
            async for chunk in chunks:
                try:
                    async with asyncio.timeout(self.send_timeout_s):
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except TimeoutError:
                    log.info("SSE client did not read for %.0f s; closing", self.send_timeout_s)
                    return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
