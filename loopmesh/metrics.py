"""The metrics endpoint: ``/metrics`` (Prometheus text format) and ``/healthz``.

``/metrics`` is prometheus-client's own WSGI app (content negotiation, OpenMetrics,
gzip); a few lines route ``/healthz`` beside it and refuse other paths and methods. The
server is prometheus-client's arrangement too (``wsgiref`` in a daemon thread, a thread
per request), so a scrape never waits on the event loop; only the health check runs on
the loop, and a loop too busy to answer it within :data:`HEALTH_TIMEOUT_S` is unhealthy::

    async with MetricsServer(port=9090, healthy=lambda: nc.is_connected) as metrics:
        print(metrics.url)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from socketserver import ThreadingMixIn
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app

log = logging.getLogger("loopmesh.metrics")

Health = Callable[[], bool | Awaitable[bool]]

#: A health check that has not answered in this long counts as unhealthy.
HEALTH_TIMEOUT_S = 5.0

#: A plain-text answer's headers. Each response gets its own list: wsgiref adds
#: ``Content-Length`` to the list it is given, and a shared one kept the first answer's.
_TEXT = (("Content-Type", "text/plain; charset=utf-8"),)


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
        self._metrics = make_wsgi_app(registry)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        if self._server is not None:
            return
        self._loop = asyncio.get_running_loop()
        server_class = _Server6 if ":" in self.host else _Server
        server = make_server(self.host, self.port, self._app, server_class, _QuietHandler)
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name=f"metrics-{self.port}", daemon=True
        )
        self._thread.start()
        log.info("metrics listening url=%s", self.url)

    async def close(self) -> None:
        """Stop listening and wait for the server thread. Idempotent."""
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        if server is None:
            return
        await asyncio.to_thread(server.shutdown)
        server.server_close()
        if thread is not None:
            await asyncio.to_thread(thread.join)

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

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """The WSGI app (runs in a server thread)."""
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [*_TEXT, ("Allow", "GET, HEAD")])
            return [b"method not allowed\n"]
        if path == "/metrics":
            result: Iterable[bytes] = self._metrics(environ, start_response)
            return result
        if path == "/healthz":
            if self._healthy_from_thread():
                start_response("200 OK", [*_TEXT])
                return [b"ok\n"]
            start_response("503 Service Unavailable", [*_TEXT])
            return [b"unhealthy\n"]
        start_response("404 Not Found", [*_TEXT])
        return [b"not found\n"]

    def _healthy_from_thread(self) -> bool:
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        try:
            future = asyncio.run_coroutine_threadsafe(self._is_healthy(), loop)
            return future.result(HEALTH_TIMEOUT_S)
        except (RuntimeError, concurrent.futures.TimeoutError):
            return False  # the loop is gone or too busy to answer

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


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hung scrape does not hold the process open


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""
