"""A TCP proxy on loopback whose connections a test can drop, as a network would:
``down()`` aborts every open connection and refuses new ones until ``up()``."""

from __future__ import annotations

import asyncio
import contextlib


class Proxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.accepting = True
        self.dropped = 0  # connections aborted by down()
        self.requests = bytearray()  # every byte clients sent, to read their requests
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.down()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def down(self) -> None:
        self.accepting = False
        for writer in list(self._open):
            writer.transport.abort()
            self.dropped += 1
        self._open.clear()

    def up(self) -> None:
        self.accepting = True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.accepting:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_writer))
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, self.requests), self._pipe(up_reader, writer)
            )
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]
            for w in (writer, up_writer):
                self._open.discard(w)
                w.transport.abort()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        record: bytearray | None = None,
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if record is not None:
                    record += data
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()  # the other side ended: so does this one
