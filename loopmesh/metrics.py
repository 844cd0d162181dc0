"""The metrics endpoint: ``/metrics`` (Prometheus text format) and ``/healthz``.

A small HTTP/1.1 server on asyncio streams, in the running event loop; it answers one
request per connection, which is all Prometheus and Kubernetes probes need::

    async with MetricsServer(port=9090, healthy=lambda: nc.is_connected) as metrics:
        print(metrics.url)
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = logging.getLogger("loopmesh.metrics")

Health = Callable[[], bool | Awaitable[bool]]

_READ_TIMEOUT_S = 5.0
_MAX_HEAD = 16 * 1024
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class MetricsServer:
    """Serves ``registry`` at ``/metrics`` and ``healthy()`` at ``/healthz`` (200 or 503).

    ``port=0`` picks a free port; :attr:`port` says which once started.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        registry: CollectorRegistry = REGISTRY,
        healthy: Health | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.registry = registry
        self.healthy = healthy
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        if self._server is not None:
            return
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics listening url=%s", self.url)

    async def close(self) -> None:
        """Stop listening and end open connections. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._handlers):
            task.cancel()
        await server.wait_closed()

    async def __aenter__(self) -> MetricsServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            async with asyncio.timeout(_READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > _MAX_HEAD:
                return
            method, _, rest = head.decode("latin-1").partition(" ")
            path = rest.partition(" ")[0].partition("?")[0]
            status, content_type, body = await self._route(method, path)
            writer.write(
                f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode("latin-1")
            )
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a client that sent no complete request gets nothing
        except ConnectionError:
            pass
        finally:
            self._handlers.discard(task)
            writer.close()

    async def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"method not allowed\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == "/healthz":
            ok = await self._is_healthy()
            return (
                (200, "text/plain; charset=utf-8", b"ok\n")
                if ok
                else (503, "text/plain; charset=utf-8", b"unhealthy\n")
            )
        return 404, "text/plain; charset=utf-8", b"not found\n"

    async def _is_healthy(self) -> bool:
        if self.healthy is None:
            return True
        try:
            result = self.healthy()
            if inspect.isawaitable(result):
                result = await result
            return bool(result)
        except Exception:
            log.exception("health check failed")
            return False
