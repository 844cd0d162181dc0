"""The NATS connection every service uses.

The first connection must succeed within a couple of attempts, or :func:`connect`
raises :class:`~loopmesh.errors.NatsConnectError` naming the URL. Once connected, the
client reconnects forever, with jitter so that a fleet of workers does not stampede a
restarted server, and says so in the log::

    nc = await connect(settings.nats, name="loop-worker")
    try:
        ...
    finally:
        await nc.drain()
"""

from __future__ import annotations

import logging
import random
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.client import Server as _Server

from .errors import NatsConnectError
from .settings import NatsSettings

log = logging.getLogger("loopmesh.nats")

#: Attempts at the first connection before giving up (reconnects are unlimited).
FIRST_CONNECT_ATTEMPTS = 2

#: Where a client connects when no URL is configured: the server ``loopmesh up`` starts
#: by default (and the ``nats`` CLI's default).
DEFAULT_URL = "nats://127.0.0.1:4222"


async def connect(settings: NatsSettings, *, name: str | None = None) -> Client:
    """Connect to ``settings.url`` (or :data:`DEFAULT_URL`); then reconnect forever."""
    url = settings.url or DEFAULT_URL
    client_name = name or settings.name
    connected = False
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        if not connected:
            errors.append(exc)  # reported once, by NatsConnectError
            return
        log.warning("nats error url=%s name=%s error=%r", _current(nc), client_name, exc)

    async def on_disconnect() -> None:
        if connected and not nc.is_closed:
            log.warning("nats disconnected url=%s name=%s", url, client_name)

    async def on_reconnect() -> None:
        log.info("nats reconnected url=%s name=%s", _current(nc), client_name)

    async def on_closed() -> None:
        if connected:
            log.info("nats connection closed url=%s name=%s", url, client_name)

    def next_server(servers: list[_Server], info: dict[str, Any]) -> tuple[_Server, float]:
        # The least-tried server, after the base wait scaled by a random factor.
        server = min(servers, key=lambda s: (s.reconnects, random.random()))
        jitter = random.uniform(0.5, 1.5) if server.reconnects else random.random()
        wait = settings.reconnect_wait_s * jitter
        return server, wait

    nc = Client()
    try:
        await nc.connect(
            servers=[u.strip() for u in url.split(",") if u.strip()],
            name=client_name,
            connect_timeout=settings.connect_timeout_s,  # type: ignore[arg-type]
            reconnect_time_wait=settings.reconnect_wait_s,  # type: ignore[arg-type]
            max_reconnect_attempts=FIRST_CONNECT_ATTEMPTS - 1,
            reconnect_to_server_handler=next_server,
            user_credentials=settings.creds_file,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            closed_cb=on_closed,
        )
    except Exception as exc:
        await nc.close()
        cause = errors[-1] if errors else exc
        raise NatsConnectError(url, cause) from cause
    connected = True
    nc.options["max_reconnect_attempts"] = -1  # from now on, never give up
    log.info("nats connected url=%s name=%s", _current(nc), client_name)
    return nc


def _current(nc: Client) -> str:
    server = nc.connected_url
    return server.geturl() if server is not None else "-"


__all__ = ["Client", "connect", "nats"]
