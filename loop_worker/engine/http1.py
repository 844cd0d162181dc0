"""A lean HTTP/1.1 transport for the ``openai`` client: the model's stream, read cheaply.

A model streams one chunk per token, each its own read, and the client's own HTTP stack
(httpx, httpcore, h11, anyio) costs several times what decoding the chunk does
(``python -m bench.stream_parse``). :class:`Http1Transport` is an httpx transport
(``httpx.AsyncBaseTransport``, the documented way to replace one), so the client keeps
everything above it: its base URL, auth, headers, timeouts, status errors, and proxies
from the environment (httpx mounts its own transport for a proxied URL). Below it, one
:class:`asyncio.Protocol` per connection parses the response as it arrives and hands
each piece of the body to the reader, with no task, stream or lock per read.

What it speaks: HTTP/1.1 over TCP or TLS; a body framed by ``Content-Length``, by
chunked transfer coding, or by the connection's close; interim ``1xx`` responses
skipped; idle connections kept per origin and used again. A request on an idle
connection that fails before any byte of its response (the server had closed it, its
close unseen: lost in a partition, or the server restarted) goes once more on a new
connection, after the origin's other idle connections are dropped. What it refuses: a response
it cannot frame (``RemoteProtocolError``). Errors are httpx's own, so the openai client
and :mod:`.llm` map them as they map httpcore's: a connect failure ``ConnectError``, a
timeout ``ConnectTimeout`` / ``ReadTimeout``, a connection lost mid-body ``ReadError``
(``RemoteProtocolError`` when the body was cut short of its framing).

Timeouts are httpx's per request (``request.extensions["timeout"]``): ``connect`` for
the connection, ``read`` for each wait for the response's next bytes.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

try:  # the openai client's transport: httpx2 from openai 3.x's later releases, else httpx
    import httpx2 as hx
except ImportError:  # pragma: no cover - an openai on httpx alone
    import httpx as hx  # type: ignore[no-redef]

_HEAD_MAX = 64 * 1024  # a response head larger than this is refused
_BUFFERED_MAX = 256 * 1024  # body bytes read ahead of the reader before reading pauses
_IDLE_MAX = 16  # idle connections kept per origin

# Parser states.
_HEAD, _LENGTH, _SIZE, _DATA, _DATA_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)

Origin = tuple[str, str, int]


class Http1Transport(hx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=Http1Transport())``; idle connections are kept per
    origin (scheme, host, port), at most :data:`_IDLE_MAX` each."""

    def __init__(self, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context
        self._idle: dict[Origin, list[_Connection]] = {}
        self._closed = False

    async def handle_async_request(self, request: hx.Request) -> hx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        url = request.url
        scheme = url.scheme
        if scheme not in ("http", "https"):
            raise hx.UnsupportedProtocol(f"{scheme!r} is not http or https", request=request)
        origin = (scheme, url.host, url.port or (443 if scheme == "https" else 80))
        timeouts = request.extensions.get("timeout", {})
        body = await request.aread()
        head = _request_head(request, len(body))
        conn = self._take_idle(origin)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(origin, timeouts.get("connect"), request)
        conn.send(head, body, request, timeouts.get("read"))
        try:
            status, reason, headers = await conn.head()
        except (hx.RemoteProtocolError, hx.ReadError):
            if not reused or conn.answered:
                raise
            # an idle connection the server had closed unseen (its close lost in a
            # partition, or the server restarted): the others idle as long are likely
            # gone too, so they are dropped and the request goes once more on a new one
            self._drop_idle(origin)
            conn = await self._connect(origin, timeouts.get("connect"), request)
            conn.send(head, body, request, timeouts.get("read"))
            status, reason, headers = await conn.head()
        return hx.Response(
            status,
            headers=headers,
            stream=_Body(conn, self, origin),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason},
        )

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _take_idle(self, origin: Origin) -> _Connection | None:
        conns = self._idle.get(origin)
        while conns:
            conn = conns.pop()
            if conn.reusable():
                return conn
            conn.close()
        return None

    def _drop_idle(self, origin: Origin) -> None:
        for conn in self._idle.pop(origin, []):
            conn.close()

    def _give_back(self, origin: Origin, conn: _Connection) -> None:
        conns = self._idle.setdefault(origin, [])
        if self._closed or not conn.reusable() or len(conns) >= _IDLE_MAX:
            conn.close()
        else:
            conns.append(conn)

    async def _connect(
        self, origin: Origin, timeout: float | None, request: hx.Request
    ) -> _Connection:
        scheme, host, port = origin
        context: ssl.SSLContext | None = None
        if scheme == "https":
            context = self._ssl = self._ssl or hx.create_ssl_context()  # as httpx's
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    _Connection, host, port, ssl=context, server_hostname=host if context else None
                )
        except TimeoutError as exc:
            raise hx.ConnectTimeout(
                f"no connection to {host}:{port} within {timeout} s", request=request
            ) from exc
        except (OSError, ssl.SSLError) as exc:
            raise hx.ConnectError(
                f"cannot connect to {host}:{port}: {exc}", request=request
            ) from exc
        return conn


def _request_head(request: hx.Request, length: int) -> bytes:
    target = request.url.raw_path
    lines = [b"%s %s HTTP/1.1" % (request.method.encode(), target)]
    framed = False
    for name, value in request.headers.raw:
        lower = name.lower()
        if lower == b"transfer-encoding":
            continue  # the body is sent whole, framed by its length
        if lower == b"content-length":
            framed = True
            value = b"%d" % length
        lines.append(name + b": " + value)
    if not framed and (length or request.method not in ("GET", "HEAD")):
        lines.append(b"Content-Length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n"


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: sends a request, parses its response as it arrives."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._state = _DONE
        self._buffer = b""
        self._left = 0  # body bytes still due in this Content-Length body or chunk
        self._keep = True  # the connection may carry another request after this one
        self._head: asyncio.Future[tuple[int, bytes, list[tuple[bytes, bytes]]]] | None = None
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None
        self._lost = False
        self._request: hx.Request | None = None
        self._method = b"GET"
        self._read_timeout: float | None = None
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.answered = False  # a byte of the response to the last request came

    # -- the reader's side ---------------------------------------------------------------

    def send(self, head: bytes, body: bytes, request: hx.Request, read: float | None) -> None:
        assert self._transport is not None
        self._request, self._method = request, request.method.encode()
        self._state, self._buffer, self._error = _HEAD, b"", None
        self.answered = False
        self._keep = not _says_close(request.headers.get("connection"))
        self._head = self._loop.create_future()
        self._read_timeout = read
        self._last_read = self._loop.time()
        if read is not None:
            self._timer = self._loop.call_at(self._last_read + read, self._check_timeout)
        self._transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self._transport.write(body)

    async def head(self) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        assert self._head is not None
        try:
            return await self._head
        except BaseException:
            self.close()
            raise

    def take(self) -> bytes | None:
        """The next piece of the body read so far, if any."""
        if not self._pieces:
            return None
        piece = self._pieces.popleft()
        self._buffered -= len(piece)
        if self._paused and self._buffered < _BUFFERED_MAX // 2:
            self._paused = False
            if self._transport is not None:
                self._transport.resume_reading()
        return piece

    async def wait(self) -> bool:
        """Wait for more of the body; false once it has ended (its error raised)."""
        if self._error is not None:
            raise self._error
        if self._state == _DONE:
            return False
        self._last_read = max(self._last_read, self._loop.time())
        self._waiter = self._loop.create_future()
        await self._waiter
        return True

    def complete(self) -> bool:
        return self._state == _DONE and self._error is None and not self._pieces

    def reusable(self) -> bool:
        return self._keep and not self._lost and self.complete()

    def close(self) -> None:
        self._keep = False
        self._cancel_timer()
        if self._transport is not None:
            self._transport.close()

    # -- the protocol's side -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        self.answered = True
        try:
            self._feed(data)
        except _ProtocolError as exc:
            self._fail(hx.RemoteProtocolError(str(exc), request=self._request))
            self.close()
            return
        if self._buffered > _BUFFERED_MAX and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        return None  # close: a response is never followed by more of our requests

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._keep = False
        self._cancel_timer()
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
        elif self._state == _HEAD and self._head is not None and not self._buffer:
            self._fail(
                hx.RemoteProtocolError(
                    "the server closed the connection without a response", request=self._request
                )
            )
        elif self._state != _DONE:
            self._fail(
                hx.ReadError(
                    f"the connection was lost before the response ended ({exc or 'closed'})",
                    request=self._request,
                )
            )
        self._wake()

    # -- parsing -------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._buffer:
            data, self._buffer = self._buffer + data, b""
        while data:
            state = self._state
            if state in (_DATA, _LENGTH):
                take = data if len(data) <= self._left else data[: self._left]
                self._left -= len(take)
                self._piece(take)
                data = data[len(take) :]
                if not self._left:
                    self._state = _DATA_END if state == _DATA else self._end()
            elif state == _SIZE:
                end = data.find(b"\r\n")
                if end < 0:
                    self._hold(data)
                    return
                size = data[:end].split(b";", 1)[0].strip()
                try:
                    self._left = int(size, 16)
                except ValueError:
                    raise _ProtocolError(f"bad chunk size {size[:40]!r}") from None
                data = data[end + 2 :]
                self._state = _DATA if self._left else _TRAILER
            elif state == _DATA_END:
                if len(data) < 2:
                    self._hold(data)
                    return
                if data[:2] != b"\r\n":
                    raise _ProtocolError("a chunk does not end in CRLF")
                data = data[2:]
                self._state = _SIZE
            elif state == _TRAILER:
                end = data.find(b"\r\n")
                if end < 0:
                    self._hold(data)
                    return
                data = data[end + 2 :]
                if end == 0:  # the blank line after the trailers
                    self._state = self._end()
            elif state == _UNTIL_CLOSE:
                self._piece(data)
                return
            elif state == _HEAD:
                end = data.find(b"\r\n\r\n")
                if end < 0:
                    self._hold(data)
                    return
                head, data = data[:end], data[end + 4 :]
                self._parse_head(head)
            else:  # _DONE: bytes nobody asked for; the connection is not used again
                self._keep = False
                return

    def _hold(self, data: bytes) -> None:
        if len(data) > _HEAD_MAX:
            raise _ProtocolError(f"a line or head longer than {_HEAD_MAX} bytes")
        self._buffer = data

    def _piece(self, data: bytes) -> None:
        if data:
            self._pieces.append(data)
            self._buffered += len(data)

    def _parse_head(self, head: bytes) -> None:
        status_line, *lines = head.split(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise _ProtocolError(f"bad status line {status_line[:80]!r}")
        status = int(parts[1])
        reason = parts[2] if len(parts) > 2 else b""
        if 100 <= status < 200 and status != 101:
            return  # an interim response: the final one follows
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        chunked = False
        for line in lines:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise _ProtocolError(f"bad header line {line[:80]!r}")
            value = value.strip()
            headers.append((name, value))
            lower = name.lower()
            if lower == b"content-length":
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise _ProtocolError(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif lower == b"transfer-encoding":
                chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
            elif lower == b"connection" and _says_close(value.decode("latin-1")):
                self._keep = False
        if parts[0] == b"HTTP/1.0":
            self._keep = False
        if self._method == b"HEAD" or status in (204, 304):
            self._state = self._end()
        elif chunked:
            self._state = _SIZE
        elif length is not None:
            self._left = length
            self._state = _LENGTH if length else self._end()
        else:
            self._keep = False
            self._state = _UNTIL_CLOSE
        if self._head is not None and not self._head.done():
            self._head.set_result((status, reason, headers))

    def _end(self) -> int:
        self._cancel_timer()
        return _DONE

    # -- waking and failing --------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        self._keep = False
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        else:
            self._error = self._error or error

    def _check_timeout(self) -> None:
        """One timer a connection, moved on only when it fires: a read waits at most
        ``read`` seconds for the next bytes."""
        self._timer = None
        if self._read_timeout is None or self._state == _DONE or self._lost:
            return
        due = self._last_read + self._read_timeout
        now = self._loop.time()
        if now < due:
            self._timer = self._loop.call_at(due, self._check_timeout)
            return
        waiting = (self._head is not None and not self._head.done()) or (
            self._waiter is not None and not self._waiter.done()
        )
        if not waiting:  # the reader is busy elsewhere: it gets the full wait when it asks
            self._timer = self._loop.call_at(now + self._read_timeout, self._check_timeout)
            return
        error = hx.ReadTimeout(
            f"no response bytes for {self._read_timeout} s", request=self._request
        )
        self._fail(error)
        self._wake()
        self.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _ProtocolError(Exception):
    pass


def _says_close(value: Any) -> bool:
    return bool(value) and "close" in str(value).lower()


class _Body(hx.AsyncByteStream):
    """A response's body; at its end, or on close, its connection goes back to the idle
    pool when the whole body was read, else it is closed."""

    def __init__(self, conn: _Connection, transport: Http1Transport, origin: Origin) -> None:
        self._conn, self._transport, self._origin = conn, transport, origin
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            while (piece := conn.take()) is not None:
                yield piece
            if not await conn.wait():
                break
        self._release()

    async def aclose(self) -> None:
        self._release()

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._conn.complete():
            self._transport._give_back(self._origin, self._conn)
        else:
            self._conn.close()
