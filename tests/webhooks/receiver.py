"""A webhook receiver: a real HTTP server on loopback that answers from a script.

Each request takes the next answer of the script (then ``default``): a status code, or
:data:`HANG` (no answer: the request is held until the caller goes, or until
:attr:`Receiver.release` is set). Every request is recorded with its headers and body,
and a test waits for them with :meth:`Receiver.wait`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

HANG: Literal["hang"] = "hang"
Answer = int | Literal["hang"]


@dataclass(frozen=True)
class Request:
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    answer: Answer

    @property
    def ok(self) -> bool:
        return isinstance(self.answer, int) and 200 <= self.answer < 300


class Receiver:
    def __init__(self, *script: Answer, default: Answer = 200) -> None:
        self.script = list(script)
        self.default = default
        self.requests: list[Request] = []
        self.release = asyncio.Event()  # ends every held request (answered 200)
        self.port = 0
        self._changed = asyncio.Condition()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    @property
    def delivered(self) -> list[Request]:
        return [r for r in self.requests if r.ok]

    async def wait(
        self, predicate: Callable[[Receiver], bool], what: str, timeout: float = 20.0
    ) -> None:
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(lambda: predicate(self))
        except TimeoutError:
            raise AssertionError(
                f"no {what} within {timeout}s; got {[r.answer for r in self.requests]}"
            ) from None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        path = lines[0].split(" ")[1]
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        answer = self.script.pop(0) if self.script else self.default
        async with self._changed:
            self.requests.append(Request(path, headers, body, answer))
            self._changed.notify_all()
        status = answer
        if answer == HANG:
            gone = asyncio.ensure_future(reader.read())  # b"" once the caller hangs up
            released = asyncio.ensure_future(self.release.wait())
            try:
                await asyncio.wait({gone, released}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                released.cancel()
            if not self.release.is_set():
                writer.close()
                return
            status = 200
        writer.write(
            b"HTTP/1.1 %d X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n" % int(status)
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def receiving(*script: Answer, default: Answer = 200) -> AsyncIterator[Receiver]:
    receiver = Receiver(*script, default=default)
    server = await asyncio.start_server(receiver.handle, "127.0.0.1", 0)
    receiver.port = server.sockets[0].getsockname()[1]
    async with server:
        try:
            yield receiver
        finally:
            receiver.release.set()
